"""Exact distributed evaluation: every sample counted exactly once, at any world size.

Two things go wrong when a validation metric is computed over ranks (docs/pitfalls.md A3, A5,
A10):

1. **Padding.** ``DistributedSampler`` pads the shards to equal length by repeating samples.
   N=10, R=3, a model right on every sample but index 0: the padded shards hold 12 entries,
   index 0 twice, and the accuracy comes out 10/12 = 0.833 instead of 9/10 = 0.9
   (:func:`naive_padded_accuracy`); with ``shuffle=True`` the repeats change each epoch (A5).
2. **Means of means.** Unpadded shards differ in length (4, 3, 3), and the mean of per-rank
   accuracies, (3/4 + 3/3 + 3/3) / 3 = 0.917, is again not 0.9 (:func:`mean_of_rank_accuracies`).

The cure (:func:`evaluate_exact`): unpadded shards
(:class:`ddp_lesson.sampler.DistributedEvalSampler`, rank r takes ``range(r, N, R)``), integer
sums and counts all-reduced once at the end, the ratio taken after the sum: a single-process
evaluation exactly, at any world size. No collective per batch (A10): ranks with fewer batches
would leave the others waiting. The trainer's mIoU is this function's, with a confusion matrix.

Sources: pytorch/pytorch#25162 and #22584 (padding skews validation), mosaicml/composer PR
#2218 ("exact eval"), pytorch/vision#4559 (shuffled eval sampler).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .env import all_reduce_sum, group_active, reduce_device

__all__ = [
    "naive_padded_accuracy",
    "mean_of_rank_accuracies",
    "sharded_exact_accuracy",
    "exact_accuracy",
    "ExactEval",
    "evaluate_exact",
]


# --------------------------------------------------------------------------- one-process models

def _check_correct(correct: Sequence[bool], num_replicas: int) -> list[bool]:
    flags = [bool(c) for c in correct]
    if not flags:
        raise ValueError("correct is empty: there is no sample to evaluate")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return flags


def naive_padded_accuracy(correct: Sequence[bool], num_replicas: int, shuffle: bool = False,
                          seed: int = 0, epoch: int = 0) -> float:
    """The A3 bug: accuracy over every rank's *padded* ``DistributedSampler`` shard.

    Simulates R ranks in one process: each evaluates what ``DistributedSampler(N, R, rank,
    shuffle, seed)`` yields at ``epoch`` (``ceil(N/R)`` indices each), and all results are
    pooled, so padded repeats count twice and the result depends on R (and, shuffled, on seed and
    epoch: A5). ``correct[i]``: whether the model is right on index i. No process group.

    Returns:
        (correct entries) / (R * ceil(N / R)), in [0, 1].

    Raises:
        ValueError: ``correct`` is empty or ``num_replicas < 1``.
    """
    from .sampler import shard_indices

    flags = _check_correct(correct, num_replicas)
    seen = [i for r in range(num_replicas)
            for i in shard_indices(len(flags), num_replicas, r, shuffle, seed, epoch)]
    return sum(flags[i] for i in seen) / len(seen)


def mean_of_rank_accuracies(correct: Sequence[bool], num_replicas: int) -> float:
    """The other bug: unpadded shards, but the per-rank accuracies are averaged.

    Rank r evaluates ``range(r, N, R)`` and reports its own accuracy; when R does not divide N a
    sample on a short shard weighs more. Ranks with an empty shard (N < R) are left out. No
    process group.

    Raises:
        ValueError: ``correct`` is empty or ``num_replicas < 1``.
    """
    flags = _check_correct(correct, num_replicas)
    shards = [range(r, len(flags), num_replicas) for r in range(num_replicas)]
    accs = [sum(flags[i] for i in s) / len(s) for s in shards if len(s)]
    return sum(accs) / len(accs)


def sharded_exact_accuracy(correct: Sequence[bool], num_replicas: int) -> float:
    """The cure, simulated in one process: each rank's ``(correct, count)`` over
    ``range(r, N, R)`` summed (what one ``all_reduce`` does), then divided: ``sum(correct) / N``
    for every R. No process group.

    Raises:
        ValueError: ``correct`` is empty or ``num_replicas < 1``.
    """
    flags = _check_correct(correct, num_replicas)
    pairs = [(sum(flags[i] for i in range(r, len(flags), num_replicas)),
              len(range(r, len(flags), num_replicas))) for r in range(num_replicas)]
    return sum(c for c, _ in pairs) / sum(n for _, n in pairs)


# --------------------------------------------------------------------------- across ranks

def _reduce_device(device=None):
    """Where a tensor must live for the default group's all_reduce (CUDA for NCCL)."""
    import torch

    return torch.device(device) if device is not None else reduce_device()


def exact_accuracy(correct: int, count: int, device=None) -> float:
    """Global accuracy from this rank's ``(correct, count)``: sums all-reduced, then divided.

    One ``all_reduce`` of two int64 numbers (on ``device``; default CUDA under NCCL, else CPU):
    every rank must call it, and every rank gets ``sum(correct) / sum(count)``, NaN when no rank
    counted anything.

    Raises:
        ValueError: ``correct`` or ``count`` negative, or ``correct > count``.
    """
    import torch

    if correct < 0 or count < 0 or correct > count:
        raise ValueError(f"need 0 <= correct <= count, got correct={correct}, count={count}")
    pair = torch.tensor([int(correct), int(count)], dtype=torch.int64,
                        device=_reduce_device(device))
    c, n = all_reduce_sum(pair).tolist()
    return c / n if n else math.nan


@dataclass
class ExactEval:
    """The result of :func:`evaluate_exact`, the same on every rank.

    ``correct``, ``count`` (counted targets: samples, or non-void pixels) and ``num_samples``
    (items, ``len(dataset)`` unless ``padded``) are summed over ranks; ``local_*`` are this rank's
    own. ``accuracy = correct / count`` (NaN when 0). With ``num_classes``: ``confusion``, a
    ``(C, C)`` int64 CPU tensor summed over ranks, ``miou`` and ``per_class_iou`` (float64
    ``(C,)``, NaN for absent classes); else None.
    """

    correct: int
    count: int
    num_samples: int
    local_num_samples: int
    local_correct: int
    local_count: int
    accuracy: float
    confusion: object = None
    miou: float | None = None
    per_class_iou: object = None


def evaluate_exact(predict: Callable, dataset, *, num_classes: int | None = None,
                   batch_size: int = 1, ignore_index: int = 255, device=None,
                   num_replicas: int | None = None, rank: int | None = None,
                   padded: bool = False, collate_fn=None, num_workers: int = 0) -> ExactEval:
    """Evaluate ``predict`` over a dataset split across ranks, counting each sample once.

    Each rank runs over its :class:`ddp_lesson.sampler.DistributedEvalSampler` shard
    (``range(rank, N, R)``, no padding, no shuffling: A5), summing correct predictions, counted
    targets, items and (with ``num_classes``) a confusion matrix; the sums are packed into one
    int64 vector and all-reduced **once**, then accuracy and mIoU computed: a single-process
    evaluation exactly, at any world size.

    Synchronisation: that one ``all_reduce``, none per batch (shards differ by up to one: A10).
    Without a process group nothing is reduced: the whole dataset, or the shard of the given
    ``num_replicas``/``rank``.

    Args:
        predict: ``predict(inputs)`` under ``torch.no_grad()``, returning class indices shaped
            like the batch's targets (``(B,)`` or ``(B, H, W)``), e.g. ``model(x).argmax(1)``.
        dataset: a map-style dataset of ``(input, target)`` pairs.
        num_classes: C; when given, a confusion matrix and mIoU too.
        batch_size, collate_fn, num_workers: the ``DataLoader``'s, on each rank.
        ignore_index: the target value that counts nowhere (Cityscapes "void" = 255).
        device: where inputs, targets and the reduction go; default CUDA under NCCL, else CPU.
        num_replicas, rank: override the process group's world size and rank.
        padded: the *padded* ``DistributedSampler(shuffle=False)`` instead: the A3 bug, for
            teaching only.

    Returns:
        An :class:`ExactEval`, identical on every rank.

    Raises:
        ValueError: predictions and targets differ in shape, or a label is outside
            ``[0, num_classes)`` (:func:`ddp_lesson.metrics.confusion_matrix`).
    """
    import torch
    from torch.utils.data import DataLoader

    from .metrics import confusion_matrix, miou_from_confusion
    from .sampler import DistributedEvalSampler, DistributedSampler

    if not group_active():
        num_replicas = 1 if num_replicas is None else num_replicas
        rank = 0 if rank is None else rank
    dev = _reduce_device(device)
    if padded:
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                     shuffle=False)
    else:
        sampler = DistributedEvalSampler(dataset, num_replicas=num_replicas, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False,
                        collate_fn=collate_fn, num_workers=num_workers)
    correct = count = items = 0
    cm = None
    if num_classes is not None:
        cm = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=dev)
    with torch.no_grad():
        for inputs, target in loader:  # no collective in here (A10)
            if isinstance(inputs, torch.Tensor):
                inputs = inputs.to(dev)
            target = torch.as_tensor(target).to(dev)
            pred = torch.as_tensor(predict(inputs)).to(dev)
            if pred.shape != target.shape:
                raise ValueError(f"predictions have shape {tuple(pred.shape)} but targets "
                                 f"{tuple(target.shape)}")
            keep = target != ignore_index
            correct += int((pred[keep] == target[keep]).sum())
            count += int(keep.sum())
            items += int(target.shape[0]) if target.dim() else 1
            if cm is not None:
                cm += confusion_matrix(pred, target, num_classes, ignore_index)
    local = (items, correct, count)
    packed = torch.tensor([correct, count, items], dtype=torch.int64, device=dev)
    if cm is not None:
        packed = torch.cat([packed, cm.reshape(-1)])
    total = all_reduce_sum(packed).cpu()  # the only synchronisation point
    correct, count, items = (int(v) for v in total[:3])
    result = ExactEval(correct=correct, count=count, num_samples=items,
                       local_num_samples=local[0], local_correct=local[1],
                       local_count=local[2],
                       accuracy=correct / count if count else math.nan)
    if cm is not None:
        result.confusion = total[3:].reshape(num_classes, num_classes)
        result.miou, result.per_class_iou, _ = miou_from_confusion(result.confusion)
    return result
