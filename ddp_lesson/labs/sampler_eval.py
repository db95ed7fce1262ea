"""Validation accuracy over 3 ranks: padded shards vs a mean of rank means vs exact sums.

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.sampler_eval --dataset-len 10

A toy classifier wrong only on index 0, evaluated three ways (docs/pitfalls.md A3, A10):
padded ``DistributedSampler(shuffle=False)`` shards count the repeats twice (N=10, R=3:
10/12 = 0.833); a mean of each rank's accuracy on unpadded ``DistributedEvalSampler`` shards
overweights the short shards ((3/4 + 3/3 + 3/3) / 3 = 0.917);
:func:`ddp_lesson.evaluation.evaluate_exact` sums correct and count with one ``all_reduce``
and divides once: 9/10 = 0.9, the single-process value. Notebook 02 runs it on 3 ranks.
Also home to the toy datasets of the evaluation tests.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset

from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.evaluation import evaluate_exact
from ddp_lesson.labs import gather
from ddp_lesson.sampler import DistributedEvalSampler, DistributedSampler


class ToyClassification(Dataset):
    """Item i is ``(tensor(i), tensor(i % num_classes))``: the input *is* the index; with
    :meth:`predictor`, a model with chosen mistakes.

    Raises:
        ValueError: ``n < 0`` or ``num_classes < 2``.
    """

    def __init__(self, n: int, num_classes: int = 2):
        if n < 0 or num_classes < 2:
            raise ValueError(f"need n >= 0 and num_classes >= 2, got n={n}, "
                             f"num_classes={num_classes}")
        self.n, self.num_classes = n, num_classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} is outside [0, {self.n - 1}]")
        return torch.tensor(i), torch.tensor(i % self.num_classes)

    def predictor(self, wrong=(0,)):
        """``predict(inputs)``: the true label, except on the indices in ``wrong``."""
        wrong = torch.tensor(sorted(wrong), dtype=torch.int64)
        C = self.num_classes

        def predict(x: torch.Tensor) -> torch.Tensor:
            label = x % C
            miss = torch.isin(x, wrong.to(x.device))
            return torch.where(miss, (label + 1) % C, label)

        return predict


class ToySegmentation(Dataset):
    """Small deterministic "scenes": item i is ``(image (1, H, W) float32, target (H, W) int64)``.

    The target holds classes ``0..C-1`` (skewed frequencies) and about 10% void pixels (255);
    the image is the class plus noise in [-0.9, 0.9], so :func:`toy_segmenter` makes some
    mistakes. Item i depends only on ``(seed, i)``.
    """

    def __init__(self, n: int, size=(6, 8), num_classes: int = 4, seed: int = 0):
        self.n, self.size, self.num_classes, self.seed = n, tuple(size), num_classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} is outside [0, {self.n - 1}]")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        H, W = self.size
        # skew the class frequencies, so per-class IoUs differ and mIoU != pixel accuracy
        probs = torch.tensor([0.5 ** c for c in range(self.num_classes)])
        cls = torch.multinomial(probs, H * W, replacement=True, generator=g).reshape(H, W)
        noise = (torch.rand(H, W, generator=g) * 1.8 - 0.9)
        image = (cls.float() + noise).unsqueeze(0)
        void = torch.rand(H, W, generator=g) < 0.1
        target = torch.where(void, torch.full_like(cls, 255), cls)
        return image, target


def toy_segmenter(images: torch.Tensor, num_classes: int = 4) -> torch.Tensor:
    """Predict ``(B, H, W)`` classes from ``(B, 1, H, W)`` images: round and clamp."""
    return images[:, 0].round().clamp(0, num_classes - 1).long()


def main(n: int = 10) -> None:
    """Run under torchrun (3 processes for the A3 numbers); rank 0 prints the comparison.

    Synchronises: each :func:`evaluate_exact` (one all_reduce), one ``all_gather_object``.
    """
    env = init_distributed(timeout=60)
    R = env.world_size
    dataset = ToyClassification(n)
    predict = dataset.predictor(wrong=(0,))  # right everywhere except on index 0

    padded_shard = list(DistributedSampler(dataset, shuffle=False))
    exact_shard = list(DistributedEvalSampler(dataset))
    print(f"padded shard {padded_shard} | unpadded shard {exact_shard}")

    naive = evaluate_exact(predict, dataset, padded=True, device=env.device)
    exact = evaluate_exact(predict, dataset, device=env.device)
    # each rank's own accuracy on its unpadded shard, then the (wrong) mean of them
    local_acc = exact.local_correct / exact.local_count if exact.local_count else None
    accs = gather(local_acc)
    if env.is_main:
        single = sum(int(predict(x[None])[0] == y) for x, y in dataset) / len(dataset)
        print(f"N={n}, R={R}, model wrong on index 0 only")
        print(f"padded DistributedSampler:   {naive.correct}/{naive.count} correct "
              f"= {naive.accuracy:.3f}  (padding repeats counted)")
        present = [a for a in accs if a is not None]
        terms = " + ".join(f"{a:.3f}" for a in present)
        print(f"mean of per-rank accuracies: ({terms}) / {len(present)} "
              f"= {sum(present) / len(present):.3f}")
        print(f"exact (sums all-reduced):    {exact.correct}/{exact.count} correct "
              f"= {exact.accuracy:.3f}")
        print("exact equals the single-process accuracy:", exact.accuracy == single)
        print("every sample counted exactly once:", exact.num_samples == len(dataset))
    cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset-len", type=int, default=10, help="dataset length N")
    main(p.parse_args().dataset_len)
