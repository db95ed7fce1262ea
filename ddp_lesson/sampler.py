"""Which samples does each rank see? A DistributedSampler written from scratch.

In data-parallel training every rank runs the same program on a different slice of the
data. The slice is chosen by a *sampler*: an iterable of dataset indices handed to the
``DataLoader``. :class:`DistributedSampler` rebuilds ``torch.utils.data.DistributedSampler``
(source: ``torch/utils/data/distributed.py``) line by line in idea, and yields the same
indices, index for index, for every dataset length, world size, rank, seed, epoch,
``shuffle`` and ``drop_last`` (``tests/sampler/test_sampler.py`` checks this against torch's own).

The recipe, for a dataset of ``N`` samples and ``R = num_replicas`` ranks:

1. **Global order.** ``range(N)``, or a permutation drawn from a generator seeded with
   ``seed + epoch``. Every rank computes the *same* permutation on its own: there is no
   communication at all, so every rank must be given the same ``seed`` and ``epoch``.
2. **Make it divisible by R.** Either pad by wrapping round to the start of the list
   (``drop_last=False``: some samples are seen twice) or cut the tail
   (``drop_last=True``: some samples are not seen this epoch).
3. **Deal it out.** Rank ``r`` takes every R-th entry starting at ``r``:
   ``indices[r:total_size:R]``.

The algorithm itself, short enough to print whole, is :mod:`ddp_lesson.core.sampler`; this
module is the hardened layer on top: arguments checked, with errors that name the numbers.
The pure functions (:func:`global_order`, :func:`padded_order`, :func:`shard_indices`,
:func:`num_samples_per_rank`, :func:`padding_count`, :func:`contiguous_shard_indices`)
need no process group, so notebooks and tests can show every rank's shard from one
process. :class:`DistributedEvalSampler` is the unpadded variant for exact evaluation.

Two more situations a plain ``DistributedSampler`` does not cover:
:class:`DistributedWeightedSampler` applies the same recipe to a weighted draw (class
imbalance: one ``torch.multinomial`` draw shared by every rank, padded and dealt out), and
:class:`IterableShard` splits a stream (an ``IterableDataset``, which has no indices) by rank
and by DataLoader worker.
"""
from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info

from .core import sampler as core
from .env import group_active

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


# --------------------------------------------------------------------------- validation

def _as_int(name: str, value) -> int:
    """``value`` as an int; TypeError for floats, strings and the like."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _check_n(n) -> int:
    n = _as_int("n", n)
    if n < 0:
        raise ValueError(f"n (the dataset length) must be >= 0, got {n}")
    return n


def _check_num_replicas(num_replicas) -> int:
    num_replicas = _as_int("num_replicas", num_replicas)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return num_replicas


def _check_rank(rank, num_replicas: int) -> int:
    rank = _as_int("rank", rank)
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"rank {rank} is outside [0, {num_replicas - 1}] (num_replicas={num_replicas})"
        )
    return rank


def _resolve_world(num_replicas, rank) -> tuple[int, int]:
    """Fill in ``num_replicas``/``rank`` from the default process group when None, then check.

    Reading the world size and rank is local: it is not a collective and does not wait for
    the other ranks.
    """
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        if not group_active():
            missing = " and ".join(
                name for name, v in (("num_replicas", num_replicas), ("rank", rank)) if v is None
            )
            raise RuntimeError(
                f"{missing} not given and no default process group is initialised: pass "
                "num_replicas= and rank= explicitly, or call "
                "torch.distributed.init_process_group() first (under torchrun)"
            )
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
    num_replicas = _check_num_replicas(num_replicas)
    return num_replicas, _check_rank(rank, num_replicas)


# --------------------------------------------------------------------------- pure index math

def num_samples_per_rank(n: int, num_replicas: int, drop_last: bool = False) -> int:
    """Number of indices each rank gets per epoch: ``len(DistributedSampler)``.

    Follows ``torch/utils/data/distributed.py``: ``ceil(N / R)`` normally; with
    ``drop_last=True`` and ``N % R != 0`` it is ``ceil((N - R) / R)`` (equal to ``N // R``
    for ``N >= R``, and 0 for ``N < R``). Every rank gets the same number, which is what
    keeps ranks in lock-step: a rank with fewer batches would stop calling the gradient
    all_reduce while the others wait for it.

    Args:
        n: dataset length ``N`` (samples), ``>= 0``.
        num_replicas: world size ``R``, ``>= 1``.
        drop_last: the sampler's ``drop_last`` (cut the tail instead of padding).

    Returns:
        Indices per rank (samples, not batches).

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    return core.num_samples_per_rank(_check_n(n), _check_num_replicas(num_replicas), drop_last)


def padding_count(n: int, num_replicas: int) -> int:
    """How many duplicate indices ``drop_last=False`` adds so the total divides by R.

    Equals ``total_size - N = R * ceil(N / R) - N = (R - N % R) % R``. It is 0 when R
    divides N, and 0 for an empty dataset (torch gives ``num_samples = total_size = 0``
    for ``N = 0`` and pads nothing: every rank gets an empty list). It can exceed N when
    ``N < R`` (N=3, R=8 pads 5), which is why padding wraps round the list several times.

    Args:
        n: dataset length ``N`` (samples), ``>= 0``.
        num_replicas: world size ``R``, ``>= 1``.

    Returns:
        Number of padded (duplicated) entries across all ranks together.

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    n = _check_n(n)
    num_replicas = _check_num_replicas(num_replicas)
    return num_replicas * core.num_samples_per_rank(n, num_replicas) - n


def global_order(n: int, shuffle: bool = False, seed: int = 0, epoch: int = 0) -> list[int]:
    """The order of the whole dataset for one epoch, before padding and dealing out.

    With ``shuffle=True`` this is ``torch.randperm(n)`` from a CPU ``torch.Generator``
    seeded with ``seed + epoch``. Why ``seed + epoch``: every rank must draw the *same*
    permutation (otherwise shards overlap, case A2) without talking to the others, so the
    generator is seeded from values all ranks share; adding the epoch gives a new order
    each epoch, but only if the training loop calls ``set_epoch`` (case A1). A side effect
    of adding: ``(seed=0, epoch=1)`` and ``(seed=1, epoch=0)`` give the same order.
    A private generator is used, so the global RNG (dropout, augmentation) is untouched.

    Args:
        n: dataset length ``N``, ``>= 0``.
        shuffle: permute (True) or keep ``0..N-1`` (False).
        seed: shared base seed (must be equal on every rank).
        epoch: epoch number (must be equal on every rank).

    Returns:
        A list of length ``N`` holding each of ``0..N-1`` once.

    Raises:
        ValueError: ``n < 0``.
    """
    return core.global_order(_check_n(n), shuffle, seed, epoch)


def padded_order(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                 epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The global order made divisible by ``num_replicas``: the list the ranks share out.

    ``drop_last=False``: the order is extended by wrapping round to its start until its
    length is ``total_size = R * ceil(N / R)``. Why pad at all: every rank must get the
    same number of samples, hence the same number of batches, because each training step
    ends in a collective (the gradient all_reduce) that all ranks must join. Wrapping
    round *repeatedly* matters when ``N < R``: a single ``indices += indices[:pad]``
    (old torch) is too short then (case A7).

    ``drop_last=True``: the tail is cut to ``total_size = R * num_samples``.

    Args:
        n: dataset length ``N``, ``>= 0``.
        num_replicas: world size ``R``, ``>= 1``.
        shuffle, seed, epoch: as in :func:`global_order`.
        drop_last: cut the tail instead of padding.

    Returns:
        A list of length ``R * num_samples_per_rank(n, R, drop_last)``.

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    num_replicas = _check_num_replicas(num_replicas)
    return core.pad_or_cut(global_order(n, shuffle, seed, epoch), num_replicas, drop_last)


def shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = False,
                  seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The indices rank ``rank`` gets in one epoch: what :class:`DistributedSampler` yields.

    Interleaved ("strided") assignment, ``padded_order(...)[rank:total_size:num_replicas]``,
    as in current torch. Why interleave rather than give each rank one contiguous block:
    the padding duplicates sit at the end of the list, and striding spreads them one per
    rank at most (case A3: ranks 1 and 2 get one duplicate each, rank 0 none) instead of
    piling them into the last rank's block (or, when N < R, the last few ranks'); and with
    ``shuffle=False`` each rank still sees samples from the whole dataset, not just one region
    of it. Both schemes are valid partitions; what matters is that every rank uses the same
    one (case A9, and :func:`contiguous_shard_indices` for the old scheme).

    No synchronisation: pure index arithmetic, the same on every rank given the same
    arguments.

    Args:
        n: dataset length ``N``, ``>= 0``.
        num_replicas: world size ``R``, ``>= 1``.
        rank: this rank, in ``[0, R - 1]``.
        shuffle, seed, epoch: as in :func:`global_order`.
        drop_last: cut the tail instead of padding (see :func:`padded_order`).

    Returns:
        A list of ``num_samples_per_rank(n, R, drop_last)`` dataset indices.

    Raises:
        ValueError: ``n < 0``, ``num_replicas < 1`` or ``rank`` outside ``[0, R - 1]``.
    """
    num_replicas = _check_num_replicas(num_replicas)
    rank = _check_rank(rank, num_replicas)
    indices = padded_order(n, num_replicas, shuffle, seed, epoch, drop_last)
    return indices[rank:len(indices):num_replicas]


def contiguous_shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool = False,
                             seed: int = 0, epoch: int = 0,
                             drop_last: bool = False) -> list[int]:
    """The PyTorch 0.3 scheme: rank ``r`` takes one contiguous block of the padded list.

    ``padded_order(...)[offset:offset + num_samples]`` with ``offset = num_samples * rank``
    (source: PyTorch 0.3.0 ``torch/utils/data/distributed.py``, which always shuffled,
    seeded with the epoch alone, and had no ``drop_last``; here the order and padding are
    today's, so only the dealing differs). Kept for teaching case A9: it is a valid
    partition of the same padded list, but it is *not* what torch does today, so mixing it
    with :func:`shard_indices` across ranks or across a resume breaks the partition.

    Args, Returns, Raises: as :func:`shard_indices`.
    """
    num_replicas = _check_num_replicas(num_replicas)
    rank = _check_rank(rank, num_replicas)
    num_samples = num_samples_per_rank(n, num_replicas, drop_last)
    indices = padded_order(n, num_replicas, shuffle, seed, epoch, drop_last)
    offset = num_samples * rank
    return indices[offset:offset + num_samples]


# --------------------------------------------------------------------------- samplers

class DistributedSampler(core.DistributedSampler):
    """Give each rank its own equal-sized shard of a map-style dataset; same as torch's.

    A from-scratch rebuild of ``torch.utils.data.DistributedSampler`` (source:
    ``torch/utils/data/distributed.py``) with the same signature, attributes and output,
    index for index. Each epoch: a global order (a ``seed + epoch`` permutation when
    ``shuffle``), padded by wrapping round or cut to a multiple of ``num_replicas``, then
    dealt out interleaved: rank ``r`` gets ``indices[r::num_replicas]``: the algorithm is
    :class:`ddp_lesson.core.sampler.DistributedSampler`, which this class extends with checks
    that name the numbers (world size and rank resolved from the process group, a warning for
    an empty epoch, an error if the dataset's length changed).

    Call :meth:`set_epoch` at the start of every epoch, before iterating the DataLoader,
    or every epoch repeats the same "shuffled" order (case A1). Give every rank the same
    ``seed`` and ``epoch``, or the shards overlap (case A2); nothing checks this for you.

    Padding means some samples are seen twice per epoch; for exact validation metrics use
    :class:`DistributedEvalSampler` instead (case A3).

    Edge cases (as upstream):

    * ``N = 0``: every rank gets an empty list, whatever ``drop_last`` is.
    * ``drop_last=True`` and ``0 < N < num_replicas``: ``num_samples`` is 0 and every rank
      gets an **empty** list, so training silently runs zero steps. This class matches
      torch here but emits a ``UserWarning`` naming N and R at construction.
    * ``drop_last=False`` and ``N < num_replicas``: the list wraps round several times, so
      every rank still gets one index (case A7).

    No synchronisation: the sampler never communicates. With ``num_replicas``/``rank`` left
    as None it reads them once from the default process group (a local query, not a
    collective).

    Args:
        dataset: a sized dataset; only ``len(dataset)`` is used.
        num_replicas: world size R, ``>= 1``. Default: ``torch.distributed.get_world_size()``.
        rank: this process's rank in ``[0, R - 1]``. Default: ``torch.distributed.get_rank()``.
        shuffle: permute the global order each epoch. Default True.
        seed: base seed of the permutation; must be the same on every rank. Default 0.
        drop_last: cut the tail so the data splits evenly (some samples unseen this epoch)
            instead of padding with duplicates. Default False. Not the DataLoader's
            ``drop_last``, which drops each rank's last short *batch* (case A6).

    Attributes:
        num_replicas, rank, shuffle, seed, drop_last: as given (resolved).
        epoch: the epoch set by :meth:`set_epoch`, 0 at first.
        num_samples: indices per rank per epoch (``len(self)``).
        total_size: ``num_samples * num_replicas``, the padded/cut global length.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas - 1]``.
        RuntimeError: ``num_replicas`` or ``rank`` is None and no process group exists.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        num_replicas, rank = _resolve_world(num_replicas, rank)
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        n = len(dataset)
        if self.num_samples == 0 and n > 0:
            warnings.warn(
                f"DistributedSampler with drop_last=True: dataset length N={n} is smaller "
                f"than num_replicas R={self.num_replicas}, so every rank gets 0 samples "
                "and an epoch runs zero steps (as torch's DistributedSampler does); use "
                "drop_last=False or fewer ranks",
                UserWarning,
                stacklevel=2,
            )

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if num_samples_per_rank(n, self.num_replicas, self.drop_last) != self.num_samples:
            # num_samples was fixed at construction; a dataset that changed length since
            # would give this rank a different number of batches than its peers.
            raise RuntimeError(
                f"dataset length changed to {n} after the sampler was built "
                f"(num_samples={self.num_samples}, num_replicas={self.num_replicas})"
            )
        return super().__iter__()

    def __len__(self) -> int:
        """Indices this rank yields per epoch (``num_samples``), not the dataset length."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch that, added to ``seed``, seeds the next pass's permutation.

        Call it on every rank with the same value at the start of each epoch, before the
        DataLoader iterator is created: ``iter(loader)`` calls ``iter(sampler)`` at once,
        and the epoch's index list is fixed then. Without it, ``shuffle=True`` gives the
        same order every epoch. No synchronisation.

        Args:
            epoch: epoch number, the same on every rank.
        """
        self.epoch = epoch


class DistributedEvalSampler(Sampler[int]):
    """Unpadded interleaved shards for exact evaluation: each sample counted exactly once.

    Rank ``r`` gets ``range(r, N, num_replicas)``, in order, with no shuffling, padding or
    dropping, so the shards of all ranks are disjoint and their union is exactly
    ``range(N)``. Metrics summed over ranks then equal single-process metrics, unlike
    :class:`DistributedSampler`, whose padded duplicates are counted twice (case A3).

    The price: shard lengths differ by up to one (N=10, R=3 gives 4, 3, 3), so ranks may
    run different numbers of batches. The evaluation loop must not run a collective per
    batch (a DDP forward that broadcasts buffers, SyncBatchNorm, a per-batch all_reduce of
    the loss) or the ranks with more batches wait forever (case A10). Accumulate local sums
    and reduce ``(correct, count)`` once at the end.

    The interleaved dealing is the same as :class:`DistributedSampler` with
    ``shuffle=False``, so each rank's list is a prefix of what that sampler would yield.
    No synchronisation: the sampler never communicates.

    Args:
        dataset: a sized dataset; only ``len(dataset)`` is used.
        num_replicas: world size R, ``>= 1``. Default: ``torch.distributed.get_world_size()``.
        rank: this process's rank in ``[0, R - 1]``. Default: ``torch.distributed.get_rank()``.

    Attributes:
        num_replicas, rank: as given (resolved).
        num_samples: this rank's shard length, ``len(range(rank, N, R))``.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas - 1]``.
        RuntimeError: ``num_replicas`` or ``rank`` is None and no process group exists.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
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
    num_samples = _as_int("num_samples", num_samples)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
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
    num_replicas = _check_num_replicas(num_replicas)
    draw = weighted_draw(weights, num_samples, replacement, seed, epoch)
    return core.pad_or_cut(draw, num_replicas, drop_last)


class DistributedWeightedSampler(Sampler[int]):
    """Weighted sampling (class imbalance) split across ranks: one draw, dealt out like torch's.

    ``torch.utils.data.WeightedRandomSampler`` has no distributed form, and wrapping it does
    not work: ``DistributedSampler(WeightedRandomSampler(w, n))`` uses only ``len()`` of what
    it is given, so it yields *positions* ``0..n-1`` (rank 0 of 8 gets 0, 8, ..., 96), never a
    weighted index: the weights are silently ignored. A hand-made wrapper that calls
    ``torch.multinomial`` with the global random state draws a different list on each rank
    (overlaps and gaps), and one that does not pad gives ranks different lengths (a hang at the
    next collective).

    Each epoch every rank draws the *same* list, :func:`weighted_draw` (``torch.multinomial``
    on the weights as doubles, generator seeded ``seed + epoch``, exactly as
    ``WeightedRandomSampler`` draws with such a generator), pads it with its own first
    elements to a multiple of R (or, with ``drop_last``, cuts the tail), and rank ``r`` takes
    ``padded[r::R]``, as :class:`DistributedSampler` deals a permutation. Interleaving the R
    shards gives back the padded draw. :meth:`set_epoch` changes the draw on all ranks
    together; without it every epoch repeats the same draw.

    No synchronisation: the sampler never communicates. With ``num_replicas``/``rank`` left as
    None it reads them once from the default process group (a local query).

    Args:
        weights: one weight per dataset index, ``>= 0``, finite, not all zero (a sequence or a
            1-D tensor; copied as float64). Typical: ``1 / count[class_of(i)]``.
        num_samples: indices drawn per epoch across all ranks together (before padding),
            ``>= 1``.
        num_replicas: world size R, ``>= 1``. Default: ``torch.distributed.get_world_size()``.
        rank: this rank in ``[0, R - 1]``. Default: ``torch.distributed.get_rank()``.
        replacement: draw with replacement (default; needed to oversample a rare class).
        seed: base seed; must be the same on every rank. Default 0.
        drop_last: cut the draw to ``R * (num_samples // R)`` instead of padding.

    Attributes:
        weights (float64 tensor), num_replicas, rank, replacement, seed, drop_last, epoch.
        num_samples: indices drawn per epoch (all ranks together), as given.
        num_samples_per_rank: ``len(self)``: ``ceil(num_samples / R)``, or
            ``num_samples // R`` with ``drop_last``.
        total_size: ``num_samples_per_rank * R``.

    Raises:
        ValueError: ``rank`` outside ``[0, R - 1]``, ``num_replicas < 1``,
            ``num_samples < 1``, a negative or non-finite weight, all weights zero,
            ``replacement=False`` with ``num_samples`` above the number of nonzero weights.
        RuntimeError: ``num_replicas`` or ``rank`` is None and no process group exists.

    Example: weights 2.0 for items 0..49 and 1.0 for 50..99, ``num_samples=100``, R = 8:
    ``len(sampler) == 13`` on every rank, 104 entries in all (the draw's first 4 dealt again).
    """

    def __init__(self, weights, num_samples: int, *, num_replicas: int | None = None,
                 rank: int | None = None, replacement: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
        self.weights = _check_weights(weights)
        self.replacement = bool(replacement)
        self.num_samples = _check_num_draws(num_samples, self.weights, self.replacement)
        self.seed = _as_int("seed", seed)
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
        draw = torch.multinomial(self.weights, self.num_samples, self.replacement,
                                 generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return core.pad_or_cut(draw.tolist(), self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self.padded_draw()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        """Indices this rank yields per epoch (``num_samples_per_rank``)."""
        return self.num_samples_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Seed the next draw with ``seed + epoch``: call it on every rank with the same value
        at the start of each epoch, before the DataLoader iterator is created. No sync."""
        self.epoch = _as_int("epoch", epoch)


# --------------------------------------------------------------------------- streaming data

def iterable_shard_counts(n: int, num_replicas: int, num_workers: int = 1) -> list[list[int]]:
    """How many of ``n`` streamed items each (rank, worker) of :class:`IterableShard` gets.

    Item ``i`` goes to reader ``i % (R * W)``, and reader ``rank * W + worker`` is
    ``counts[rank][worker]``. Pure arithmetic, no process group.

    Returns:
        ``counts[rank][worker]`` (items), summing to ``n``.

    Raises:
        ValueError: ``n < 0``, ``num_replicas < 1`` or ``num_workers < 1``.
    """
    n = _check_n(n)
    num_replicas = _check_num_replicas(num_replicas)
    num_workers = _as_int("num_workers", num_workers)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    readers = num_replicas * num_workers
    return [[len(range(r * num_workers + w, n, readers)) for w in range(num_workers)]
            for r in range(num_replicas)]


class IterableShard(IterableDataset):
    """Split a stream (an iterable dataset) by rank *and* by DataLoader worker: each item once.

    A sampler cannot split an ``IterableDataset``: there are no indices, and
    ``DataLoader(sampler=...)`` refuses one. Worse, each of the W worker processes of a
    ``DataLoader(num_workers=W)`` gets its own copy of the dataset and, unless the dataset
    looks at ``torch.utils.data.get_worker_info()``, iterates the *whole* stream: every item
    comes W times on every rank (R * W times in the job). ``IterableShard`` makes reader
    ``k = rank * W + worker_id`` (of ``R * W`` readers) keep items ``k, k + R*W, k + 2*R*W,
    ...`` of the stream (``itertools.islice``), so across R ranks x W workers every item is
    seen exactly once. Outside a DataLoader worker (``num_workers=0``) W is 1.

    The price of a stream: the readers get ``ceil`` or ``floor`` of ``n / (R * W)`` items, so
    ranks can run **different numbers of batches** (103 items, R = 2, W = 2, batch 5: 12
    batches on rank 0, 11 on rank 1), and a per-batch collective (the DDP gradient
    all_reduce) then waits forever on the rank that has one more. Stop every rank at the
    shortest rank's count (an all_reduce of "I still have a batch" with MIN, each step), or
    use ``torch.distributed.algorithms.Join``. Each reader also reads and skips the items
    that are not its own: a real corpus is split by *file* or *shard*, this by item.

    No synchronisation. Source: the ``IterableDataset`` docs (``torch/utils/data/dataset.py``,
    ``get_worker_info`` example).

    Args:
        dataset: any iterable (an ``IterableDataset``, a generator factory with ``__iter__``,
            a list, ...); it must yield the same items in the same order on every rank and in
            every worker.
        num_replicas: world size R, ``>= 1``. Default: ``torch.distributed.get_world_size()``.
        rank: this rank in ``[0, R - 1]``. Default: ``torch.distributed.get_rank()``.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas - 1]``.
        RuntimeError: ``num_replicas`` or ``rank`` is None and no process group exists.
    """

    def __init__(self, dataset, *, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
        self.dataset = dataset

    def reader(self) -> tuple[int, int]:
        """``(k, R * W)``: this reader's number and the number of readers (local)."""
        info = get_worker_info()
        num_workers, worker_id = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * num_workers + worker_id, self.num_replicas * num_workers

    def __iter__(self) -> Iterator:
        k, readers = self.reader()
        return itertools.islice(iter(self.dataset), k, None, readers)
