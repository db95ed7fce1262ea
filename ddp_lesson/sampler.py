"""Sharding helpers and samplers beyond :class:`DistributedSampler`; the sampler itself is the core.

:class:`DistributedSampler`, :func:`global_order` and :func:`num_samples_per_rank` are
:mod:`ddp_lesson.core.sampler`'s (one implementation, checks included; index for index torch's,
``tests/sampler/test_sampler.py``). Here: pure index math that shows every rank's shard from one
process (:func:`padded_order`, :func:`shard_indices`, :func:`padding_count`,
:func:`contiguous_shard_indices`), the unpadded :class:`DistributedEvalSampler` for exact
evaluation, :class:`DistributedWeightedSampler` (one weighted draw shared by every rank, padded
and dealt out) and :class:`IterableShard` (a stream split by rank and DataLoader worker).
Nothing here communicates.
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info

from .core.sampler import (
    DistributedSampler,
    check_int,
    check_world,
    global_order,
    num_samples_per_rank,
    pad_or_cut,
)

__all__ = [
    "DistributedSampler",
    "DistributedEvalSampler",
    "num_samples_per_rank",
    "padding_count",
    "global_order",
    "padded_order",
    "shard_indices",
    "contiguous_shard_indices",
    "DistributedWeightedSampler",
    "weighted_draw",
    "weighted_padded_draw",
    "IterableShard",
    "iterable_shard_counts",
]


def padding_count(n: int, num_replicas: int) -> int:
    """Duplicates ``drop_last=False`` adds so the total divides by R, all ranks together:
    ``R * ceil(N / R) - N``; 0 when R divides N or ``N = 0``, above N when ``N < R`` (N=3, R=8
    pads 5: padding wraps round several times). ValueError for ``n < 0`` or ``R < 1``."""
    return num_replicas * num_samples_per_rank(n, num_replicas) - n


def padded_order(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                 epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The global order made divisible by R (:func:`pad_or_cut`): the list the ranks share out,
    ``R * num_samples_per_rank(n, R, drop_last)`` long. Padding wraps round to the start (as
    often as ``N < R`` needs, case A7); ``drop_last`` cuts the tail. ValueError as
    :func:`num_samples_per_rank`."""
    return pad_or_cut(global_order(n, shuffle, seed, epoch), num_replicas, drop_last)


def shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = False,
                  seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """Rank ``rank``'s indices for one epoch, what :class:`DistributedSampler` yields:
    ``padded_order(...)[rank::R]``. Striding spreads the padding repeats one per rank at most
    (case A3); every rank must use the same scheme (case A9, :func:`contiguous_shard_indices`).
    Pure index arithmetic. ValueError: ``n < 0``, ``R < 1`` or ``rank`` outside ``[0, R - 1]``."""
    num_replicas, rank = check_world(num_replicas, rank)
    indices = padded_order(n, num_replicas, shuffle, seed, epoch, drop_last)
    return indices[rank:len(indices):num_replicas]


def contiguous_shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = False,
                             seed: int = 0, epoch: int = 0,
                             drop_last: bool = False) -> list[int]:
    """The PyTorch 0.3 scheme (its ``torch/utils/data/distributed.py``): rank ``r`` takes the
    contiguous block ``padded_order(...)[r * num_samples:(r + 1) * num_samples]``. A valid
    partition, but not torch's today: mixing it with :func:`shard_indices` across ranks or a
    resume breaks the partition (case A9). Errors as :func:`shard_indices`."""
    num_replicas, rank = check_world(num_replicas, rank)
    num_samples = num_samples_per_rank(n, num_replicas, drop_last)
    indices = padded_order(n, num_replicas, shuffle, seed, epoch, drop_last)
    offset = num_samples * rank
    return indices[offset:offset + num_samples]


# --------------------------------------------------------------------------- samplers

class DistributedEvalSampler(Sampler[int]):
    """Unpadded interleaved shards for exact evaluation: each sample counted exactly once.

    Rank ``r`` gets ``range(r, N, R)``, in order: no shuffling, padding or dropping, so the
    shards partition ``range(N)`` and metrics summed over ranks equal one process's (unlike
    :class:`DistributedSampler`'s padded shards, case A3). The price: shard lengths differ by
    up to one (N=10, R=3: 4, 3, 3), so the evaluation loop must run no collective per batch
    (case A10); reduce ``(correct, count)`` once at the end. Never communicates.

    Args: ``dataset`` (only ``len`` is used), ``num_replicas``, ``rank``: as
    :class:`DistributedSampler`, with the same checks (:func:`check_world`).
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.num_replicas, self.rank = check_world(num_replicas, rank)
        self.dataset = dataset
        self.epoch = 0
        self.num_samples = len(range(self.rank, len(dataset), self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        """This rank's shard length; may be one less than another rank's."""
        return len(range(self.rank, len(self.dataset), self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """Accepted so a loop can treat both samplers alike; the order never changes."""
        self.epoch = epoch


# --------------------------------------------------------------------------- weighted sampling

def _check_weights(weights) -> torch.Tensor:
    """``weights`` as a 1-D double CPU tensor, checked: finite, >= 0, not all zero."""
    try:
        w = torch.as_tensor(weights, dtype=torch.double).detach().cpu().clone()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"weights must be a sequence of numbers, got {type(weights).__name__}: "
                        f"{exc}") from None
    if w.dim() != 1 or w.numel() == 0:
        raise ValueError(f"weights must be a non-empty 1-D sequence, got shape {tuple(w.shape)}")
    bad = (~torch.isfinite(w)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"weights must be finite: weights[{i}] = {w[i].item()} "
                         f"({bad.numel()} of {w.numel()} not finite)")
    negative = (w < 0).nonzero().flatten()
    if negative.numel():
        i = int(negative[0])
        raise ValueError(f"weights must be >= 0: weights[{i}] = {w[i].item()} "
                         f"({negative.numel()} of {w.numel()} negative)")
    if not bool((w > 0).any()):
        raise ValueError(f"weights are all zero ({w.numel()} of them): nothing can be drawn")
    return w


def weighted_draw(weights, num_samples: int, replacement: bool = True, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    """The draw every rank of a :class:`DistributedWeightedSampler` makes, before padding.

    ``torch.multinomial(torch.as_tensor(weights, dtype=torch.double), num_samples,
    replacement, generator=torch.Generator().manual_seed(seed + epoch))``: the call torch's
    ``WeightedRandomSampler`` makes (``torch/utils/data/sampler.py``), on a private generator
    seeded from values all ranks share, so every rank draws the same list without talking.

    Args:
        weights: one non-negative weight per dataset index (need not sum to 1).
        num_samples: how many indices to draw, ``>= 1``.
        replacement: draw with replacement (an index may come more than once).
        seed, epoch: the generator's seed is ``seed + epoch``; equal on every rank.

    Returns:
        ``num_samples`` dataset indices in ``[0, len(weights) - 1]``.

    Raises:
        ValueError: a weight is negative or not finite, all weights are zero,
            ``num_samples < 1``, or ``replacement=False`` with ``num_samples`` above the
            number of nonzero weights.
    """
    w = _check_weights(weights)
    num_samples = _check_num_draws(num_samples, w, replacement)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.multinomial(w, num_samples, replacement, generator=g).tolist()


def _check_num_draws(num_samples, w: torch.Tensor, replacement: bool) -> int:
    num_samples = check_int("num_samples", num_samples, 1)
    nonzero = int((w > 0).sum())
    if not replacement and num_samples > nonzero:
        raise ValueError(f"replacement=False cannot draw num_samples={num_samples} distinct "
                         f"indices: only {nonzero} of the {w.numel()} weights are nonzero")
    return num_samples


def weighted_padded_draw(weights, num_samples: int, num_replicas: int, replacement: bool = True,
                         seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """:func:`weighted_draw` made divisible by ``num_replicas``: the list the ranks share out.

    ``drop_last=False``: padded with its own first elements (wrapping round, several times if
    ``num_samples < num_replicas``) to ``R * ceil(num_samples / R)``; ``drop_last=True``: cut
    to ``R * (num_samples // R)``. As :func:`padded_order` does for a permutation.

    Raises:
        ValueError: as :func:`weighted_draw`, or ``num_replicas < 1``.
    """
    draw = weighted_draw(weights, num_samples, replacement, seed, epoch)
    return pad_or_cut(draw, num_replicas, drop_last)


class DistributedWeightedSampler(Sampler[int]):
    """Weighted sampling (class imbalance) split across ranks: one draw, dealt out like torch's.

    torch's ``WeightedRandomSampler`` has no distributed form, and
    ``DistributedSampler(WeightedRandomSampler(w, n))`` uses only its ``len()``: it yields
    *positions* ``0..n-1``, the weights silently ignored. Here every rank draws the *same*
    list each epoch (:func:`weighted_draw`: ``torch.multinomial`` on float64 weights, generator
    seeded ``seed + epoch``), pads it with its own first elements to a multiple of R (or cuts
    it, ``drop_last``) and rank ``r`` takes ``padded[r::R]``. Call :meth:`set_epoch` each epoch
    on every rank. Never communicates; a None ``num_replicas``/``rank`` is read from the group.

    Args: ``weights`` (one per index, >= 0, finite, not all zero), ``num_samples`` (drawn per
    epoch, all ranks together, >= 1), ``num_replicas``, ``rank``, ``replacement`` (default
    True), ``seed``, ``drop_last``. Attributes: the arguments, ``epoch``,
    ``num_samples_per_rank`` (``len(self)``) and ``total_size`` (``num_samples_per_rank * R``).

    Raises: ValueError naming the number for each bad argument (also ``replacement=False``
    with more draws than nonzero weights); RuntimeError as :func:`check_world`. Warns when
    ``drop_last`` leaves every rank empty. Weights 2.0 for items 0..49 and 1.0 for 50..99,
    ``num_samples=100``, R = 8: 13 per rank, 104 entries in all.
    """

    def __init__(self, weights, num_samples: int, *, num_replicas: int | None = None,
                 rank: int | None = None, replacement: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.num_replicas, self.rank = check_world(num_replicas, rank)
        self.weights = _check_weights(weights)
        self.replacement = bool(replacement)
        self.num_samples = _check_num_draws(num_samples, self.weights, self.replacement)
        self.seed = check_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.num_samples_per_rank = num_samples_per_rank(self.num_samples, self.num_replicas,
                                                         self.drop_last)
        self.total_size = self.num_samples_per_rank * self.num_replicas
        if self.num_samples_per_rank == 0:
            warnings.warn(
                f"DistributedWeightedSampler with drop_last=True: num_samples={self.num_samples}"
                f" is smaller than num_replicas R={self.num_replicas}, so every rank gets 0 "
                "indices; use drop_last=False or draw more", UserWarning, stacklevel=2)

    def padded_draw(self) -> list[int]:
        """This epoch's draw, padded or cut to ``total_size``: the same list on every rank."""
        return weighted_padded_draw(self.weights, self.num_samples, self.num_replicas,
                                    self.replacement, self.seed, self.epoch, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self.padded_draw()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        """Indices this rank yields per epoch (``num_samples_per_rank``)."""
        return self.num_samples_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Seed the next draw with ``seed + epoch``: call it on every rank with the same value
        at the start of each epoch, before the DataLoader iterator is created. No sync."""
        self.epoch = check_int("epoch", epoch)


# --------------------------------------------------------------------------- streaming data

def iterable_shard_counts(n: int, num_replicas: int, num_workers: int = 1) -> list[list[int]]:
    """``counts[rank][worker]``: how many of ``n`` streamed items each reader of
    :class:`IterableShard` gets (item ``i`` goes to reader ``i % (R * W)``); they sum to ``n``.
    ValueError for ``n < 0``, ``num_replicas < 1`` or ``num_workers < 1``."""
    n, num_replicas = check_int("n", n, 0), check_int("num_replicas", num_replicas, 1)
    num_workers = check_int("num_workers", num_workers, 1)
    readers = num_replicas * num_workers
    return [[len(range(r * num_workers + w, n, readers)) for w in range(num_workers)]
            for r in range(num_replicas)]


class IterableShard(IterableDataset):
    """Split a stream (an iterable dataset) by rank *and* by DataLoader worker: each item once.

    A sampler cannot split an ``IterableDataset`` (no indices), and each of the W workers of
    ``DataLoader(num_workers=W)`` iterates its own copy of the whole stream unless the dataset
    reads ``get_worker_info()`` (``torch/utils/data/dataset.py``'s example). Reader
    ``k = rank * W + worker_id`` keeps items ``k, k + R*W, ...`` (``itertools.islice``), so
    every item is seen once in the job. The price: readers get ``ceil`` or ``floor`` of
    ``n / (R * W)`` items, so ranks may run different numbers of batches (103 items, R = 2,
    W = 2, batch 5: 12 and 11) and a per-batch collective then hangs: stop all ranks at the
    shortest count (an all_reduce MIN of "I have a batch") or use ``Join``. Never communicates.

    Args: ``dataset``, any iterable yielding the same items in the same order everywhere;
    ``num_replicas``, ``rank``: as :class:`DistributedSampler` (:func:`check_world`).
    """

    def __init__(self, dataset, *, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.num_replicas, self.rank = check_world(num_replicas, rank)
        self.dataset = dataset

    def reader(self) -> tuple[int, int]:
        """``(k, R * W)``: this reader's number and the number of readers (local)."""
        info = get_worker_info()
        num_workers, worker_id = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * num_workers + worker_id, self.num_replicas * num_workers

    def __iter__(self) -> Iterator:
        k, readers = self.reader()
        return itertools.islice(iter(self.dataset), k, None, readers)
