"""Resuming at another world size: a run's micro-batches, dealt to any number of ranks.

A run at world size ``R`` with ``K`` accumulation steps of micro-batches of ``B`` samples per
rank (a :class:`~ddp_lesson.sampler.DistributedSampler` and a ``DataLoader``) reads each
epoch's padded permutation ``order`` in order: rank ``r``'s micro-batch ``m`` is
``order[r::R][m·B:(m+1)·B]``, so the micro-batches ``m`` of all ranks are the entries
``[m·B·R, (m+1)·B·R)``, and optimizer step ``s`` (micro-batches ``s·K … s·K + K - 1``) the
entries ``[s·G, (s+1)·G)``, ``G = B·R·K`` the global batch. After ``s`` steps the epoch's
**cursor** is ``s·G`` samples.

Number a step's micro-batches ``g = k·R + r``. At ``R'`` ranks the step is dealt as
``K' = K·R / R'`` micro-batches per rank, rank ``r'`` taking ``g = k'·R' + r'``: at ``R' = R``
the sampler and loader exactly; at any ``R'`` the same groups of samples (BatchNorm normalises
the same batches), the same gradient sum and global batch. What changes is the order of that
sum and BatchNorm's running statistics, which each rank updates with its own micro-batches.

:class:`DataLayout` is ``(N, R, K, B, drop_last, seed)`` of the run's first start, which a
resumed run keeps (the checkpoint carries it); :class:`LayoutBatchSampler` gives one rank its
micro-batches. Nothing here communicates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.utils.data import Sampler

from .sampler import num_samples_per_rank, padded_order

__all__ = ["DataLayout", "LayoutBatchSampler", "processes", "regroup_problem"]


def regroup_problem(world_size: int, grad_accum_steps: int, new_world_size: int) -> str | None:
    """Why a step of ``K`` micro-batches on ``R`` ranks cannot be dealt to ``R'`` ranks, or None.

    A step holds ``K·R`` micro-batches; each of the ``R'`` ranks must take the same number,
    ``K' = K·R / R'``, so ``R'`` must divide ``K·R``. The reason names R, K and R' and ends
    with the world sizes that would do.
    """
    r, k, r2 = world_size, grad_accum_steps, new_world_size
    if (k * r) % r2 == 0:
        return None
    return (f"a step holds K x R = {k} x {r} = {_count(k * r, 'micro-batch', 'es')} "
            f"(R={_count(r, 'process', 'es')}, K={_count(k, 'accumulation step')}), which "
            f"R'={r2} processes cannot share: K' = K x R / R' = {k * r}/{r2} is not a whole "
            f"number; use {processes(k * r)}")


def _count(n: int, word: str, plural: str = "s") -> str:
    return f"{n} {word}" + ("" if n == 1 else plural)


def processes(n: int) -> str:
    """The world sizes that divide ``n``, as words: ``"1 process"``, ``"1, 2 or 4 processes"``."""
    words = [str(d) for d in range(1, n + 1) if n % d == 0]
    if len(words) == 1:
        return "1 process"
    return ", ".join(words[:-1]) + " or " + words[-1] + " processes"


@dataclass(frozen=True)
class DataLayout:
    """The micro-batches of a run: ``N`` samples, ``R`` ranks, ``K`` accumulation steps, ``B``.

    Args:
        num_samples: dataset length N.
        world_size: the world size R whose sampler defines the micro-batches.
        grad_accum_steps: K, micro-batches per rank and step at world size R.
        batch_size: B, samples per micro-batch.
        drop_last: the sampler's and the loader's ``drop_last``.
        seed: the sampler's seed (each epoch's order is ``randperm`` seeded ``seed + epoch``).
        shuffle: permute each epoch (the trainer always does).
    """

    num_samples: int
    world_size: int
    grad_accum_steps: int
    batch_size: int
    drop_last: bool = False
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self):
        for name in ("world_size", "grad_accum_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    # ---- sizes (the same every epoch)
    @property
    def samples_per_rank(self) -> int:
        """Samples each of the R ranks reads per epoch (``len(DistributedSampler)``)."""
        return num_samples_per_rank(self.num_samples, self.world_size, self.drop_last)

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches per rank and epoch at world size R (``len(DataLoader)``)."""
        per, b = self.samples_per_rank, self.batch_size
        return per // b if self.drop_last else math.ceil(per / b)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_rank / self.grad_accum_steps)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum_steps

    def micro_batch_size(self, m: int) -> int:
        """Samples in micro-batch ``m`` of a rank (B, or fewer for the last without drop_last)."""
        return min(self.batch_size, self.samples_per_rank - m * self.batch_size)

    def micro_batches_in_step(self, step: int) -> int:
        """Micro-batches of all ranks together in ``step``: ``R·K``, fewer in a short last step."""
        k = self.grad_accum_steps
        return self.world_size * min(k, self.micro_batches_per_rank - step * k)

    def cursor(self, steps_done: int) -> int:
        """Samples of the epoch's padded permutation that its first ``steps_done`` steps read."""
        m = min(steps_done * self.grad_accum_steps, self.micro_batches_per_rank)
        return self.world_size * min(m * self.batch_size, self.samples_per_rank)

    # ---- another world size
    def accumulation_at(self, world_size: int) -> int:
        """K' = K·R / R': micro-batches per rank and full step at ``world_size`` ranks.

        Raises:
            ValueError: R' does not divide K·R, or a short last step (names the numbers).
        """
        problem = self.problem_at(world_size)
        if problem:
            raise ValueError(problem)
        return self.grad_accum_steps * self.world_size // world_size

    def problem_at(self, world_size: int) -> str | None:
        """Why ``world_size`` ranks cannot take this layout's steps, or None when they can."""
        if world_size < 1:
            return f"world_size must be >= 1, got {world_size}"
        problem = regroup_problem(self.world_size, self.grad_accum_steps, world_size)
        if problem:
            return problem
        last = self.micro_batches_in_step(self.steps_per_epoch - 1)
        if last % world_size:
            fits = math.gcd(last, self.grad_accum_steps * self.world_size)
            return (f"the epoch's last step holds {_count(last, 'micro-batch', 'es')} "
                    f"({self.micro_batches_per_rank} per rank and epoch at R={self.world_size},"
                    f" K={self.grad_accum_steps}), which R'={world_size} processes cannot "
                    f"share; use {processes(fits)}")
        return None

    # ---- the micro-batches
    def epoch_shards(self, epoch: int) -> list[list[int]]:
        """Each of the R ranks' shard of the epoch: ``order[r::R]`` of the padded permutation
        (seeded ``seed + epoch``), what the R ranks' samplers yield."""
        order = padded_order(self.num_samples, self.world_size, self.shuffle, self.seed, epoch,
                             self.drop_last)
        return [order[r::self.world_size] for r in range(self.world_size)]

    def step_groups(self, shards: list[list[int]], step: int) -> list[list[int]]:
        """The micro-batches of ``step``, numbered ``g = k·R + r``: lists of dataset indices.

        ``shards`` is the epoch's :meth:`epoch_shards`.
        """
        b, k = self.batch_size, self.grad_accum_steps
        first = step * k
        count = self.micro_batches_in_step(step) // self.world_size
        return [shard[m * b:m * b + self.micro_batch_size(m)]
                for m in range(first, first + count) for shard in shards]


class LayoutBatchSampler(Sampler[list[int]]):
    """One rank's micro-batches of a :class:`DataLayout` at ``world_size`` ranks (a batch sampler).

    Give it to a ``DataLoader`` as ``batch_sampler``. Call :meth:`set_epoch` every epoch and
    set :attr:`start_step` (the steps of the epoch already taken) before iterating: it yields
    this rank's micro-batches of the steps from there to the epoch's end, each a list of
    dataset indices. At ``world_size == layout.world_size`` these are the batches of a
    ``DataLoader(batch_size=B, sampler=DistributedSampler(...))``, index for index.

    Raises:
        ValueError: ``world_size`` cannot take the layout's steps (:meth:`DataLayout.problem_at`),
            or ``rank`` outside ``[0, world_size - 1]``.
    """

    def __init__(self, layout: DataLayout, world_size: int, rank: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size - 1}]")
        self.layout, self.world_size, self.rank = layout, world_size, rank
        self.accumulation = layout.accumulation_at(world_size)
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def micro_batches_in_step(self, step: int) -> int:
        """This rank's micro-batches in ``step`` (K', fewer in a short last step)."""
        return self.layout.micro_batches_in_step(step) // self.world_size

    def __iter__(self):
        shards = self.layout.epoch_shards(self.epoch)
        for step in range(self.start_step, self.layout.steps_per_epoch):
            # rank r' of R' takes the micro-batches g = k'·R' + r'
            yield from self.layout.step_groups(shards, step)[self.rank::self.world_size]

    def __len__(self) -> int:
        return sum(self.micro_batches_in_step(s)
                   for s in range(self.start_step, self.layout.steps_per_epoch))
