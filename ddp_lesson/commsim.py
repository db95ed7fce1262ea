"""A simulated network and a recorder for data-parallel wrappers: what overlap buys, measured.

On a CPU machine the loopback all-reduce is nearly free, so overlap would show no benefit.
:class:`SimulatedLink` lays an α-β network over the real all-reduce (numbers right, waits
modelled): a bucket issued during backward hides behind computation, one issued after it is
exposed. A :class:`Recorder` given to a wrapper (``ddp_lesson.core``'s ``NaiveDDP`` /
``BucketedDDP``) notes per rank when each gradient was ready and each all-reduce ran
(:class:`StepRecord`, :class:`CommEvent`); :func:`job_exposed_s` and :func:`job_exposed_share`
say how much communication nobody's computation hid; :func:`gather_records` brings every
rank's records to every rank. Instrumentation only: no number the wrappers compute changes.

Source: the α-β model of R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 2005.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .cost_model import ring_allreduce_time

__all__ = ["SimulatedLink", "CommEvent", "StepRecord", "Recorder", "union_length",
           "job_exposed_s", "job_exposed_share", "gather_records"]


class _LinkWork:
    """The handle :class:`SimulatedLink` returns: the real all-reduce plus a modelled finish
    time."""

    def __init__(self, work, start_s: float, done_at_s: float):
        self.work = work
        self.start_s = start_s
        self.done_at_s = done_at_s

    def get_future(self):
        return self.work.get_future()

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.done_at_s

    def wait(self) -> bool:
        self.work.wait()
        remaining = self.done_at_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return True


class SimulatedLink:
    """A network with latency α and bandwidth 1/β, laid over the real (nearly free) all-reduce.

    Each all-reduce takes the ring's modelled time on ``R`` ranks
    (:func:`ddp_lesson.cost_model.ring_allreduce_time`)::

        T(n) = 2 (R-1) α + 2 (R-1)/R · n / bandwidth

    one at a time: a message starts when issued or when the previous one ends, whichever is
    later. The real all-reduce runs as usual; waiting on the handle also sleeps until the
    modelled finish, while backward keeps computing. A wrapper's ``comm_hook``
    (``BucketedDDP(model, comm_hook=link)``), or torch's DDP's
    (``ddp.register_comm_hook(link, SimulatedLink.torch_hook)``).

    Args:
        latency_s: α, seconds per message step (>= 0).
        bandwidth_bytes_per_s: bytes per second of one link direction (> 0).

    Raises:
        ValueError: a negative latency or a non-positive bandwidth.
    """

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float):
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")
        self.latency_s = float(latency_s)
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self._free_at = 0.0

    def __repr__(self) -> str:
        return (f"SimulatedLink(latency_s={self.latency_s:g}, "
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s:g})")

    def cost_s(self, nbytes: float, world_size: int) -> float:
        """Modelled seconds for one ring all-reduce of ``nbytes`` on ``world_size`` ranks."""
        return ring_allreduce_time(nbytes, world_size, self.latency_s,
                                   1.0 / self.bandwidth_bytes_per_s)

    def reserve(self, nbytes: float, world_size: int) -> tuple[float, float]:
        """Book the link for one all-reduce issued now: ``(start_s, done_at_s)``
        (perf_counter clock)."""
        now = time.perf_counter()
        start = max(now, self._free_at)
        self._free_at = start + self.cost_s(nbytes, world_size)
        return start, self._free_at

    def __call__(self, tensor: torch.Tensor, process_group=None) -> _LinkWork:
        """All-reduce (SUM) ``tensor`` asynchronously; ``.wait()`` returns at the modelled finish.

        A collective, like ``dist.all_reduce``: every rank must call it, in the same order.
        """
        world_size = dist.get_world_size(process_group)
        start, done_at = self.reserve(tensor.numel() * tensor.element_size(), world_size)
        return _LinkWork(dist.all_reduce(tensor, group=process_group, async_op=True),
                         start, done_at)

    @staticmethod
    def torch_hook(state, bucket):  # no annotations: torch checks them against its own types
        """torch DDP's comm hook: averages the bucket like ``allreduce_hook`` (divide by R,
        all-reduce SUM, default group); the future completes no earlier than the modelled
        finish (the wait runs in the future's callback, on gloo's thread, not in backward)."""
        tensor = bucket.buffer()
        group = dist.group.WORLD
        world_size = dist.get_world_size(group)
        tensor.div_(world_size)
        _, done_at = state.reserve(tensor.numel() * tensor.element_size(), world_size)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def _arrive(f):
            remaining = done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            return f.value()[0]

        return fut.then(_arrive)


@dataclass
class CommEvent:
    """One all-reduce issued by a wrapper: bucket ``index`` (NaiveDDP: parameter index),
    ``nbytes``, parameter names. Times in seconds since forward returned, this rank's clock:
    ``issued_s``; ``start_s`` (later on a busy :class:`SimulatedLink`); ``end_s`` (the real
    completion, or the link's modelled finish if later)."""

    index: int
    nbytes: int
    params: list[str]
    issued_s: float
    start_s: float
    end_s: float = math.nan


@dataclass
class StepRecord:
    """What one rank did in one synchronised backward pass (``step``: 0-based).

    Attributes:
        grad_ready_s: parameter name -> when its gradient was accumulated.
        comm: the all-reduces, in issue order.
        backward_end_s: when autograd finished (the final callback started).
        sync_end_s: when ``backward()`` was about to return with averaged gradients.
        t0_s: ``time.perf_counter()`` when forward returned, the origin of the other times
            (seconds); ``CLOCK_MONOTONIC`` on Linux, so ranks on one machine align.
    """

    rank: int
    step: int
    t0_s: float = math.nan
    grad_ready_s: dict[str, float] = field(default_factory=dict)
    comm: list[CommEvent] = field(default_factory=list)
    backward_end_s: float = math.nan
    sync_end_s: float = math.nan

    @property
    def comm_s(self) -> float:
        """Seconds during which at least one all-reduce was in flight (union of intervals)."""
        return union_length([(e.start_s, e.end_s) for e in self.comm])

    @property
    def exposed_s(self) -> float:
        """Communication not hidden behind backward: ``sync_end_s - backward_end_s``."""
        return max(0.0, self.sync_end_s - self.backward_end_s)

    @property
    def exposed_share(self) -> float:
        """``exposed_s / comm_s`` (0 when nothing was communicated); 1.0 = nothing overlapped."""
        comm = self.comm_s
        return min(1.0, self.exposed_s / comm) if comm > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)  # plain, JSON-able data

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["comm"] = [CommEvent(**e) for e in d.get("comm", [])]
        return cls(**d)


class Recorder:
    """Collects a :class:`StepRecord` per synchronised backward pass of a wrapper
    (``BucketedDDP(..., recorder=Recorder())``) into ``steps``, oldest first. The wrapper calls
    per step :meth:`begin` (forward), :meth:`grad_ready` (each hook), :meth:`comm_start` /
    :meth:`comm_end` (each message), :meth:`backward_end`, :meth:`finish`."""

    def __init__(self):
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None
        self._t0 = 0.0

    def clear(self) -> None:
        """Forget every record."""
        self.steps.clear()
        self._current = None

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def begin(self, rank: int) -> None:
        self._t0 = time.perf_counter()
        self._current = StepRecord(rank=rank, step=len(self.steps), t0_s=self._t0)

    def grad_ready(self, name: str) -> None:
        if self._current is not None:
            self._current.grad_ready_s[name] = self._now()

    def comm_start(self, index: int, nbytes: int, names: list[str], work) -> CommEvent | None:
        if self._current is None:
            return None
        issued = self._now()
        link_start = getattr(work, "start_s", None)
        event = CommEvent(index, nbytes, names, issued,
                          issued if link_start is None else link_start - self._t0)
        event._real_end = math.nan  # set by the future's callback, on the communication thread
        getter = getattr(work, "get_future", None)
        if getter is not None:
            try:
                getter().add_done_callback(
                    lambda _f, e=event: setattr(e, "_real_end", self._now()))
            except RuntimeError:  # a backend without futures: fall back to the wait time
                pass
        event._done_at = getattr(work, "done_at_s", None)
        self._current.comm.append(event)
        return event

    def comm_end(self, event: CommEvent | None) -> None:
        if event is None:
            return
        end = event._real_end if not math.isnan(event._real_end) else self._now()
        if event._done_at is not None:
            end = max(end, event._done_at - self._t0)
        event.end_s = end
        del event._real_end, event._done_at

    def backward_end(self) -> None:
        if self._current is not None:
            self._current.backward_end_s = self._now()

    def finish(self) -> None:
        if self._current is not None:
            self._current.sync_end_s = self._now()
            self.steps.append(self._current)
            self._current = None

    def exposed_shares(self) -> list[float]:
        """:attr:`StepRecord.exposed_share` of every recorded step."""
        return [s.exposed_share for s in self.steps]


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``[(start, end), ...]`` (overlaps counted once).

    >>> union_length([(0, 2), (1, 3), (5, 6)])
    4
    """
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def job_exposed_s(records: Sequence[StepRecord]) -> float:
    """Exposed communication of one step of the job (one record per rank): from the *last*
    rank's end of backward to the last rank's averaged gradients. Waiting for a straggler is
    not counted (a per-rank ``exposed_s`` counts it). The ranks must share a clock (``t0_s``).
    """
    last_backward = max(r.t0_s + r.backward_end_s for r in records)
    last_sync = max(r.t0_s + r.sync_end_s for r in records)
    return max(0.0, last_sync - last_backward)


def job_exposed_share(records: Sequence[StepRecord]) -> float:
    """:func:`job_exposed_s` over the communication time of the rank that finished backward last."""
    last = max(records, key=lambda r: r.t0_s + r.backward_end_s)
    return min(1.0, job_exposed_s(records) / last.comm_s) if last.comm_s > 0 else 0.0


def gather_records(recorder: Recorder, process_group=None) -> list[list[StepRecord]]:
    """Every rank's records, on every rank: ``result[rank][step]``.

    A collective (``all_gather_object``): every rank of ``process_group`` must call it.
    """
    world_size = dist.get_world_size(process_group)
    mine = [s.to_dict() for s in recorder.steps]
    out: list = [None] * world_size
    dist.all_gather_object(out, mine, group=process_group)
    return [[StepRecord.from_dict(d) for d in rank_steps] for rank_steps in out]
