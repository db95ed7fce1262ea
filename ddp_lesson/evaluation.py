"""Exact distributed evaluation: every sample counted exactly once, at any world size.

Two things go wrong when a validation metric is computed over ranks (docs/pitfalls.md A3, A5, A10):

1. **Padding.** ``DistributedSampler`` pads the shards to equal length by repeating samples,
   so a metric over the gathered shards counts those samples twice. N=10, R=3, a model right
   on every sample but index 0: the padded shards hold 12 entries, index 0 twice, and the
   accuracy comes out 10/12 = 0.833 instead of 9/10 = 0.9 (:func:`naive_padded_accuracy`).
   With ``shuffle=True`` which samples repeat changes with the epoch, so even the wrong number
   is not reproducible (A5).
2. **Means of means.** Without padding the shards differ in length (4, 3, 3), and the mean of
   the per-rank accuracies weights a sample on a short shard more: (3/4 + 3/3 + 3/3) / 3 =
   0.917, again not 0.9 (:func:`mean_of_rank_accuracies`).

The cure (:func:`evaluate_exact`): unpadded shards
(:class:`ddp_lesson.sampler.DistributedEvalSampler`: rank r takes ``range(r, N, R)``), and each
rank keeps *sums and counts* — correct predictions, counted targets, a confusion matrix — that
are all-reduced once, at the end; the ratio is taken after the sum. Integer sums do not depend
on the order of addition, so the result equals a single-process evaluation exactly, at world
size 1, 2, 3 or any other. Because the shards are uneven, the loop must run no collective per
batch (A10): the ranks with fewer batches would leave the others waiting. The trainer's mIoU
(``ddp_lesson.train``) is this function's, with a confusion matrix.

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

    Simulates R ranks in one process: each rank evaluates the indices
    ``DistributedSampler(N, R, rank, shuffle, seed)`` yields at ``epoch`` (padded to
    ``ceil(N/R)`` each), and the per-sample results of all ranks are pooled. Padded repeats
    count twice, so the result depends on R (and, with ``shuffle``, on seed and epoch: A5).
    Since every padded shard has the same length, this equals the mean of the per-rank
    accuracies too. No process group.

    Args:
        correct: ``correct[i]`` is whether the model is right on dataset index i (length N).
        num_replicas: world size R, ``>= 1``.
        shuffle, seed, epoch: the sampler's settings (``shuffle=False`` as in A3).

    Returns:
        (correct entries) / (R * ceil(N / R)), a float in [0, 1].

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

    Each rank r evaluates ``range(r, N, R)`` (no repeats) and reports its own accuracy; the
    R accuracies are averaged. When R does not divide N the shards differ in length, so a
    sample on a short shard weighs more and the mean is not the dataset's accuracy. A rank
    with an empty shard (N < R) has no accuracy and is left out. No process group.

    Args:
        correct: per-index correctness, length N.
        num_replicas: world size R, ``>= 1``.

    Returns:
        Mean over ranks with a non-empty shard of (correct on the shard) / (shard length).

    Raises:
        ValueError: ``correct`` is empty or ``num_replicas < 1``.
    """
    flags = _check_correct(correct, num_replicas)
    shards = [range(r, len(flags), num_replicas) for r in range(num_replicas)]
    accs = [sum(flags[i] for i in s) / len(s) for s in shards if len(s)]
    return sum(accs) / len(accs)


def sharded_exact_accuracy(correct: Sequence[bool], num_replicas: int) -> float:
    """The cure, simulated in one process: unpadded shards, sums and counts added, then divided.

    Each rank r counts ``(correct, count)`` over ``range(r, N, R)``; the pairs are summed
    (what one ``all_reduce`` does) and divided once. Equals ``sum(correct) / N`` for every
    R. No process group.

    Args:
        correct: per-index correctness, length N.
        num_replicas: world size R, ``>= 1``.

    Returns:
        (sum over ranks of correct) / (sum over ranks of count).

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

    A synchronisation point (one ``all_reduce`` of two int64 numbers); every rank must call
    it and every rank gets the same result. Not a mean of per-rank accuracies: with shards
    of different lengths that would be wrong (:func:`mean_of_rank_accuracies`).

    Args:
        correct: correct predictions on this rank's shard.
        count: predictions counted on this rank's shard (``>= correct``).
        device: where to reduce; default CUDA under NCCL, else CPU.

    Returns:
        ``sum(correct) / sum(count)`` over ranks; NaN when no rank counted anything.

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

    Attributes:
        correct: correct predictions, summed over ranks (targets equal to ``ignore_index``
            are not counted).
        count: counted targets (samples for classification, non-void pixels for
            segmentation), summed over ranks.
        num_samples: dataset items evaluated, summed over ranks: ``len(dataset)`` with the
            exact sampler, more with ``padded=True``.
        local_num_samples: items this rank evaluated (its shard length).
        local_correct, local_count: this rank's own sums before the reduction.
        accuracy: ``correct / count`` (NaN when ``count == 0``).
        confusion: ``(C, C)`` int64 CPU tensor summed over ranks, or None without
            ``num_classes``.
        miou: mean IoU from ``confusion`` (classes absent from target and prediction left
            out), or None.
        per_class_iou: float64 ``(C,)`` tensor with NaN for absent classes, or None.
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
    (``range(rank, N, R)``: no padding, no shuffling, so order and repeats cannot change the
    result, A5), accumulating integer sums — correct predictions, counted targets, items and
    (with ``num_classes``) a confusion matrix. After the loop the sums are packed into one
    int64 vector and all-reduced **once**; accuracy and mIoU are computed from the totals.
    The result equals a single-process evaluation exactly, for any world size.

    Synchronisation: exactly one ``all_reduce`` at the end, on every rank; none per batch,
    because shard lengths differ by up to one and a per-batch collective would hang the
    ranks with more batches (A10). Without a process group it reduces nothing: with
    ``num_replicas``/``rank`` not given it evaluates the whole dataset in this process;
    with them given, only that rank's shard (useful to look at one rank's share).

    Args:
        predict: ``predict(inputs) -> predictions``, called under ``torch.no_grad()``;
            ``predictions`` must have the shape of the batch's targets (class indices:
            ``(B,)`` for classification, ``(B, H, W)`` for segmentation), e.g.
            ``lambda x: model(x).argmax(1)``.
        dataset: a map-style dataset of ``(input, target)`` pairs; ``target`` holds class
            indices (int) or ``ignore_index``.
        num_classes: C; when given, a confusion matrix and mIoU are computed too.
        batch_size: items per batch on each rank.
        ignore_index: target value that counts nowhere (Cityscapes "void" = 255).
        device: where inputs, targets and the reduction go; default CUDA under NCCL
            (``torch.cuda.current_device()``), else CPU.
        num_replicas, rank: override the process group's world size and rank.
        padded: use the *padded* ``DistributedSampler(shuffle=False)`` instead — reproduces
            the A3 bug, for teaching; never for real evaluation.
        collate_fn: passed to the ``DataLoader``.
        num_workers: the ``DataLoader``'s worker processes (0: load in this process).

    Returns:
        An :class:`ExactEval`, identical on every rank.

    Raises:
        ValueError: a batch's predictions and targets differ in shape, or a label is out of
            ``[0, num_classes)`` (from :func:`ddp_lesson.metrics.confusion_matrix`).
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
