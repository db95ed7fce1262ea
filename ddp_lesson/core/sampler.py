"""The DistributedSampler: which dataset indices each rank reads, index for index as torch's.

Every rank runs the same program on a different slice of the data, and no rank tells the others
which slice it took: each works it out alone from values they all share (the dataset length
``N``, the world size ``R``, ``seed`` and ``epoch``). One epoch, three steps:

1. **One global order.** ``range(N)``, or ``torch.randperm(N)`` from a private generator seeded
   with ``seed + epoch``: the same permutation on every rank, a new one each epoch (if the loop
   calls :meth:`DistributedSampler.set_epoch`), and the global RNG left alone.
2. **Make it divisible by R** (:func:`pad_or_cut`, the one padding rule). Every rank must get
   the same number of samples, hence of batches, because every training step ends in a
   collective that all ranks must join. ``drop_last=False`` repeats indices from the start of
   the list (several times over when ``N < R``); ``drop_last=True`` cuts the tail.
3. **Deal it out, strided.** Rank ``r`` takes ``indices[r::R]``: the padding duplicates at the
   end land on different ranks, one each at most.

Source: ``torch/utils/data/distributed.py`` (``DistributedSampler``), whose signature,
attributes and output this module reproduces, and whose ``__init__`` checks its arguments as
:func:`check_world` does here. No function here communicates.
"""
from __future__ import annotations

import math
import operator
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DistributedSampler", "global_order", "pad_or_cut", "num_samples_per_rank",
           "check_world", "check_int"]


class DistributedSampler(Sampler[int]):
    """Rank ``rank``'s equal share of ``range(len(dataset))``, index for index torch's.

    Arguments as torch's: ``num_replicas`` (R) and ``rank`` default to the process group's;
    ``shuffle`` permutes with the seed ``seed + epoch``; ``drop_last`` cuts to a multiple of R
    instead of padding. ``len(self)`` is ``num_samples``, per rank. Bad arguments raise errors
    naming the numbers (:func:`check_world`); a ``drop_last`` that empties every rank warns.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        num_replicas, rank = check_world(num_replicas, rank)
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = num_samples_per_rank(len(dataset), num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas
        if self.num_samples == 0 and len(dataset) > 0:
            warnings.warn(f"DistributedSampler with drop_last=True: N={len(dataset)} < R="
                          f"{num_replicas}, so every rank gets 0 samples (as torch's)",
                          UserWarning, stacklevel=2)

    def __iter__(self):
        # 1. the same order on every rank, computed alone from shared values
        indices = global_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        # 2. pad (repeat from the start) or cut, to total_size = R * num_samples
        indices = pad_or_cut(indices, self.num_replicas, self.drop_last)
        if len(indices) != self.total_size:      # len(dataset) changed since __init__
            raise RuntimeError(f"dataset length changed to {len(self.dataset)} after the sampler"
                               f" was built (num_samples={self.num_samples}, "
                               f"num_replicas={self.num_replicas})")
        # 3. deal out strided: rank r takes r, r + R, r + 2R, ...
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        """Call on every rank, same value, before iterating the DataLoader: a new order."""
        self.epoch = epoch


def global_order(n, shuffle=False, seed=0, epoch=0):
    """One epoch's order, the same on every rank: ``randperm(n)`` seeded ``seed + epoch`` on a
    private generator (the global RNG untouched), or ``0..n-1``."""
    n = check_int("n (the dataset length)", n, 0)
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def num_samples_per_rank(n, num_replicas, drop_last=False):
    """Indices per rank per epoch: ``ceil(N / R)``, or with ``drop_last`` and ``R ∤ N``,
    ``ceil((N - R) / R)`` (= ``N // R``), written as torch writes it."""
    n, num_replicas = check_int("n", n, 0), check_int("num_replicas", num_replicas, 1)
    if drop_last and n % num_replicas != 0:
        return math.ceil((n - num_replicas) / num_replicas)
    return math.ceil(n / num_replicas)


def pad_or_cut(indices, num_replicas, drop_last=False):
    """A new list, ``R * num_samples_per_rank(len(indices), R, drop_last)`` long: repeats from
    the start, wrapping round as often as needed (``N = 3, R = 8`` pads 5), or the tail cut."""
    total_size = num_replicas * num_samples_per_rank(len(indices), num_replicas, drop_last)
    if drop_last:
        return list(indices[:total_size])
    pad = total_size - len(indices)
    if pad <= 0:            # already divisible (or empty: N = 0 gives every rank nothing)
        return list(indices)
    return list(indices) + (list(indices) * math.ceil(pad / len(indices)))[:pad]


def check_int(name, value, low=None):
    """``value`` as an int (TypeError for 2.0, "2", ...), at least ``low`` (ValueError)."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_world(num_replicas=None, rank=None):
    """``(num_replicas, rank)`` checked; a None is read from the default process group (a local
    query, not a collective). RuntimeError names what is missing when there is no group."""
    if (num_replicas is None or rank is None) and not dist.is_initialized():
        missing = " and ".join(k for k, v in (("num_replicas", num_replicas), ("rank", rank))
                               if v is None)
        raise RuntimeError(f"{missing} not given and no default process group is initialised: "
                           "pass num_replicas= and rank= explicitly, or call "
                           "torch.distributed.init_process_group() first (under torchrun)")
    R = check_int("num_replicas", dist.get_world_size() if num_replicas is None else num_replicas,
                  1)
    rank = check_int("rank", dist.get_rank() if rank is None else rank)
    if not 0 <= rank < R:
        raise ValueError(f"rank {rank} is outside [0, {R - 1}] (num_replicas={R})")
    return R, rank
