"""Data-parallel gradient averaging from scratch: NaiveDDP, BucketedDDP, a simulated link,
a recorder.

Run the three-way comparison (torch's DDP, NaiveDDP, BucketedDDP give the same weights)::

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.ddp_three_ways

Both wrappers are drop-in replacements for ``torch.nn.parallel.DistributedDataParallel`` in an
ordinary loop: wrap the model, run ``loss = f(model(x)); loss.backward()``, and when
``backward()`` returns every gradient is already the average over ranks. Nothing else to call.

How the gradients get averaged
------------------------------
* At construction every parameter and buffer is broadcast from rank 0, so every rank starts
  from the same weights whatever it initialised (docs/pitfalls.md B8).
* Before that broadcast, every rank's parameter list (names, shapes, dtypes) is all-gathered
  and compared, so a model that differs between ranks is the same ValueError on every rank.
* A *post-accumulate-grad hook* on each trainable parameter
  (``Tensor.register_post_accumulate_grad_hook``) fires inside ``backward()`` the moment that
  parameter's ``.grad`` is final for this pass. The first hook of a pass also queues a
  callback that autograd runs when the whole pass is done
  (``Variable._execution_engine.queue_callback``): there the wrapper waits for its
  all-reduces and writes the averages into ``.grad``, so ``backward()`` returns with them.
  (One callback per autograd task: a reentrant activation checkpoint runs an inner backward
  whose end is not the end of the pass.)
* Averaging divides each gradient by ``R`` *before* the SUM all-reduce, as torch does: a sum
  over ``R`` ranks of fp16 gradients can overflow, a sum of pre-divided ones cannot.
* :class:`NaiveDDP` does all the work in that final callback: one blocking ``all_reduce`` per
  parameter, one after the other, once backward has finished. Simple, correct, slow: many
  small messages (each pays the link's latency) and no communication while backward computes.
* :class:`BucketedDDP` groups the parameters into buckets of about ``bucket_cap_mb``, in
  *reverse* registration order, because backward produces gradients from the last layer to
  the first. When the last gradient of a bucket arrives, the bucket is copied into one flat
  tensor and all-reduced *asynchronously* (``async_op=True``) while backward goes on with
  the earlier layers: communication overlaps computation. The final callback only waits for
  what is still in flight. Buckets are launched strictly in bucket order on every rank,
  because collectives are matched by the order in which ranks issue them.

The design follows PyTorch's own DDP: S. Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020 (arXiv:2006.15704), sections 3.2-3.3
(gradient bucketing, overlap, ``no_sync``, unused parameters), and
``torch/csrc/distributed/c10d/reducer.cpp``. Differences from torch are named in each
docstring; the main one is a small extra collective per step (a check table) that lets every
rank raise the same clear error where torch hangs or lets the ranks silently diverge: a
parameter that got no gradient, a rank that skipped a backward, a parameter unfrozen or added
after wrapping. Both wrappers are ``Joinable`` (``torch.distributed.algorithms.Join``) for
uneven inputs, take torch's constructor signature, and raise NotImplementedError naming any
torch option they leave out.

Also here: the bucket assignment as a pure function (:func:`assign_buckets`, equal to torch's
``_compute_bucket_assignment_by_size`` applied in reverse order), :class:`SimulatedLink` (an
α-β network on top of the real all-reduce, so the benefit of buckets and overlap shows on a
CPU machine whose loopback is nearly free), :class:`Recorder` (when each gradient was ready and
each all-reduce ran, per rank, and how much communication was exposed). The cost-model
predictions the notebook's bucket-size sweep prints are :mod:`ddp_lesson.cost_model`.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .env import group_active

__all__ = [
    "MB", "assign_buckets", "NaiveDDP", "BucketedDDP", "SimulatedLink", "Recorder",
    "StepRecord", "CommEvent", "gather_records", "job_exposed_s", "job_exposed_share",
    "union_length", "default_all_reduce", "walk_autograd_graph",
]

#: Bytes in one "MB" of ``bucket_cap_mb`` (torch uses 1024 * 1024).
MB = 1024 * 1024


# =========================================================================== bucket assignment


def assign_buckets(nbytes: Sequence[int], bucket_cap_bytes: int,
                   keys: Sequence | None = None) -> list[list[int]]:
    """Group parameters into buckets, filling them in *reverse* registration order.

    Walks the parameters from the last to the first (the order in which backward produces
    their gradients) and appends each to the open bucket of its ``key`` (dtype and device:
    one bucket is one flat tensor, so it holds one dtype). A bucket is closed as soon as it
    holds **at least** ``bucket_cap_bytes``, so a bucket can pass the cap by its last
    parameter, and a parameter larger than the cap gets a bucket of its own. This is torch's
    rule (``torch.distributed._compute_bucket_assignment_by_size``, used by DDP), applied to
    the reversed list.

    Pure function, no process group.

    Args:
        nbytes: bytes of each parameter's gradient, in registration order
            (``p.numel() * p.element_size()``).
        bucket_cap_bytes: the cap, ``>= 0`` (0: every parameter in a bucket of its own).
        keys: one hashable per parameter (e.g. ``(dtype, device)``); parameters with
            different keys never share a bucket. None: all the same.

    Returns:
        Buckets in launch order; each is a list of parameter indices in the order their
        gradients become ready (descending indices). Every index appears exactly once.

    Raises:
        ValueError: a negative cap or size, or ``keys`` of the wrong length.

    >>> assign_buckets([16, 16, 16, 16, 16], 32)
    [[4, 3], [2, 1], [0]]
    """
    if bucket_cap_bytes < 0:
        raise ValueError(f"bucket_cap_bytes must be >= 0, got {bucket_cap_bytes}")
    if keys is None:
        keys = [None] * len(nbytes)
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys for {len(nbytes)} parameters")
    open_buckets: dict = {}  # key -> (indices, bytes so far)
    closed: list[list[int]] = []
    for i in reversed(range(len(nbytes))):
        if nbytes[i] < 0:
            raise ValueError(f"parameter {i} has a negative size {nbytes[i]}")
        indices, size = open_buckets.pop(keys[i], ([], 0))
        indices.append(i)
        size += nbytes[i]
        if size >= bucket_cap_bytes:
            closed.append(indices)
        else:
            open_buckets[keys[i]] = (indices, size)
    closed.extend(indices for indices, _ in open_buckets.values())
    # launch order = the order of each bucket's first-ready (highest-index) parameter
    closed.sort(key=lambda b: -b[0])
    return closed


# =========================================================================== communication


def default_all_reduce(tensor: torch.Tensor, process_group=None):
    """The communication step both wrappers use unless given another: an async SUM all_reduce.

    Returns the ``dist.Work`` handle (``.wait()`` blocks until the sum is in ``tensor``).
    A collective: every rank of ``process_group`` must call it, in the same order.
    """
    return dist.all_reduce(tensor, group=process_group, async_op=True)


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

    Each all-reduce is given the time the α-β model gives a ring all-reduce of ``n`` bytes on
    ``R`` ranks (:func:`ddp_lesson.cost_model.ring_allreduce_time`)::

        T(n) = 2 (R-1) α + 2 (R-1)/R · n / bandwidth

    and the link carries one all-reduce at a time: a message starts when it is issued or
    when the previous one has finished, whichever is later. The real all-reduce runs as
    usual (so the numbers are right); waiting on the returned handle additionally sleeps
    until the modelled finish time. Because the model runs on a clock while backward keeps
    computing, an all-reduce issued early (a bucket) is hidden behind backward, exactly as
    on a real network; one issued after backward (NaiveDDP) is all exposed.

    Use it as a wrapper's ``comm_hook`` (``BucketedDDP(model, comm_hook=link)``), or with
    torch's DDP: ``ddp.register_comm_hook(link, SimulatedLink.torch_hook)``.

    Args:
        latency_s: α, seconds per message step (>= 0).
        bandwidth_bytes_per_s: bytes per second of one link direction (> 0).

    Raises:
        ValueError: a negative latency or a non-positive bandwidth.

    Source: the α-β model of R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of collective
    communication operations in MPICH", IJHPCA 2005.
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
        # cost_model.ring_allreduce_time written out: cost_model imports this module
        # (assign_buckets), so importing it back here would close a circle
        steps = 2 * (world_size - 1)
        beta = 1.0 / self.bandwidth_bytes_per_s
        return steps * self.latency_s + steps / world_size * nbytes * beta

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
        """A DDP communication hook for ``torch.nn.parallel.DistributedDataParallel``.

        ``ddp.register_comm_hook(link, SimulatedLink.torch_hook)``: averages the bucket like
        torch's default hook (divide by R, all-reduce SUM, on the default process group) and
        completes the future no earlier than the link's modelled finish time. The wait runs
        in the callback of the all-reduce's future, on gloo's thread, not in backward.
        """
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


# =========================================================================== recorder


@dataclass
class CommEvent:
    """One all-reduce issued by a wrapper (a bucket, or one parameter for NaiveDDP).

    Times are seconds since the step's forward returned, on this rank's clock.

    Attributes:
        index: bucket index (NaiveDDP: parameter index).
        nbytes: bytes all-reduced.
        params: names of the parameters in it.
        issued_s: when the wrapper issued it.
        start_s: when it started: ``issued_s``, or later on a :class:`SimulatedLink` that was
            still busy with the previous message.
        end_s: when it finished (the real completion, or the simulated link's finish if later).
    """

    index: int
    nbytes: int
    params: list[str]
    issued_s: float
    start_s: float
    end_s: float = math.nan


@dataclass
class StepRecord:
    """What one rank did in one synchronised backward pass.

    Attributes:
        rank: this process's rank.
        step: 0-based count of synchronised steps seen by the recorder.
        grad_ready_s: parameter name -> seconds (since forward returned) when its gradient
            was accumulated.
        comm: the all-reduces, in issue order.
        backward_end_s: when autograd finished computing (the final callback started).
        sync_end_s: when ``backward()`` was about to return with averaged gradients.
        t0_s: ``time.perf_counter()`` when forward returned: the origin of the other times.
            A monotonic clock, comparable between processes of one machine (Linux
            ``CLOCK_MONOTONIC``), which lets a figure align the ranks' timelines.
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
        """Plain data (JSON-able)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["comm"] = [CommEvent(**e) for e in d.get("comm", [])]
        return cls(**d)


class Recorder:
    """Collects a :class:`StepRecord` per synchronised backward pass of a wrapper.

    Attach with ``BucketedDDP(..., recorder=Recorder())`` or ``ddp.recorder = Recorder()``.
    Recording costs a few ``time.perf_counter()`` calls per parameter; it changes no number.

    Attributes:
        steps: the records, oldest first.
    """

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

    def _begin(self, rank: int) -> None:
        self._t0 = time.perf_counter()
        self._current = StepRecord(rank=rank, step=len(self.steps), t0_s=self._t0)

    def _grad(self, name: str) -> None:
        if self._current is not None:
            self._current.grad_ready_s[name] = self._now()

    def _comm_start(self, index: int, nbytes: int, names: list[str], work) -> CommEvent | None:
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

    def _comm_end(self, event: CommEvent | None) -> None:
        if event is None:
            return
        end = event._real_end if not math.isnan(event._real_end) else self._now()
        if event._done_at is not None:
            end = max(end, event._done_at - self._t0)
        event.end_s = end
        del event._real_end, event._done_at

    def _backward_end(self) -> None:
        if self._current is not None:
            self._current.backward_end_s = self._now()

    def _finish(self) -> None:
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
    """Exposed communication of one step of the whole job (one record per rank).

    From the moment the *last* rank finished backward to the moment the last rank had its
    averaged gradients: the communication nobody's computation hid. A rank that finished
    backward early and waits for a slow peer is waiting for the straggler, not for the
    network, and this measure does not count it (a per-rank ``exposed_s`` does). Uses each
    record's ``t0_s``, so the ranks must share a clock (processes of one machine).
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


# =========================================================================== the wrappers


def _find_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside a (nested) tuple/list/dict output."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    return []


def walk_autograd_graph(outputs) -> tuple[int, set[int]]:
    """Walk the autograd graph back from ``outputs``: ``(nodes visited, ids of leaves reached)``.

    Follows ``grad_fn.next_functions`` from every tensor in ``outputs`` (nested
    tuples/lists/dicts are searched); a leaf shows up as an ``AccumulateGrad`` node whose
    ``.variable`` is the parameter, so ``id(p) in leaves`` says whether ``p`` took part in
    computing ``outputs``. This walk, after every forward, is what
    ``find_unused_parameters=True`` costs (torch's DDP does the same in C++). No
    synchronisation.

    Returns:
        ``(number of autograd nodes visited, {id(leaf tensor), ...})``.
    """
    stack = [t.grad_fn for t in _find_tensors(outputs) if t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return len(seen), found


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, process_group) -> None:
    """Overwrite ``tensors`` with ``src``'s copies: one broadcast per (dtype, device).

    A collective (synchronises ranks). Flattening many tensors into one message avoids paying
    the per-message latency once per tensor, the same reason gradients go in buckets.
    """
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=process_group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


#: torch's DDP keyword arguments these wrappers accept only at their default value:
#: ``name -> default``. Any other value raises NotImplementedError naming the feature.
_UNSUPPORTED = {
    "dim": 0, "check_reduction": False, "gradient_as_bucket_view": False,
    "static_graph": False, "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None, "mixed_precision": None, "device_mesh": None,
    "skip_all_reduce_unused_params": False, "bucket_cap_mb_list": None,
    "batched_grad_copy": False, "forward_sync_buffers": None,
}

# Codes in the per-step table every rank all-reduces after a synchronised backward.
_GOT = 1    # the parameter's gradient arrived in this synchronised backward
_USED = 2   # it got a gradient since the last synchronisation (no_sync passes included)
_LATE = 4   # it got a gradient after the graph walk had counted it unused (zeros already sent)
# extra columns after the P parameter columns
_COL_JOINED, _COL_FORWARDS, _COL_UNSYNCED = 0, 1, 2


def _signature(module: nn.Module, with_buffers: bool) -> list[tuple]:
    """What must be equal on every rank for the broadcast and the all-reduces to line up."""
    sig = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in module.named_parameters()]
    if with_buffers:
        sig += [("buffer", n, tuple(b.shape), str(b.dtype), False)
                for n, b in module.named_buffers()]
    return sig


def _first_difference(signatures: list[list[tuple]]) -> str | None:
    """The first way rank ``r``'s signature differs from rank 0's, in words; None if equal."""
    ref = signatures[0]
    for r, sig in enumerate(signatures[1:], start=1):
        for i, (a, b) in enumerate(zip(ref, sig)):
            if a == b:
                continue
            what = f"{a[0]} {i} ({a[1]!r} on rank 0, {b[1]!r} on rank {r})"
            if a[0] != b[0] or a[1] != b[1]:
                return (f"{what}: different names; shapes {a[2]} on rank 0 and {b[2]} on "
                        f"rank {r}")
            if a[2] != b[2]:
                return f"{what}: shape {a[2]} on rank 0 but {b[2]} on rank {r}"
            if a[3] != b[3]:
                return f"{what}: dtype {a[3]} on rank 0 but {b[3]} on rank {r}"
            return (f"{what}: requires_grad={a[4]} on rank 0 but {b[4]} on rank {r}, so the "
                    "ranks would synchronise different parameter lists")
        if len(ref) != len(sig):
            def count(s):
                trainable = sum(1 for e in s if e[0] == "parameter" and e[4])
                return (f"{sum(1 for e in s if e[0] == 'parameter')} parameters "
                        f"({trainable} trainable) and {sum(1 for e in s if e[0] == 'buffer')} "
                        "buffers")
            return f"rank 0 has {count(ref)}, rank {r} has {count(sig)}"
    return None


def _move_to(obj, device: torch.device):
    """``obj`` with every tensor inside (nested tuple/list/dict) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj


class _WrapperJoinHook(JoinHook):
    """What a rank out of inputs does inside ``Join``: shadow the others' collectives.

    ``main_hook`` runs once per iteration of the ranks still training and issues the same
    collectives, in the same order, as their forward and backward: the buffer broadcast, the
    "will this backward synchronise" flag, then zeros in place of each gradient message and a
    row marked "joined" in the check table. ``post_hook`` broadcasts the final parameters
    (and buffers) from the highest rank among the last to join, as torch does.
    """

    def __init__(self, ddp: _GradSyncBase, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._sync_buffers_if_due(joined=True)
        flag = torch.zeros(1, device=ddp._device)
        dist.all_reduce(flag, group=ddp.process_group)
        should_sync = bool(flag.item() != 0)
        ddp._buffers_need_sync = should_sync
        if should_sync:
            ddp._shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = ddp._common_rank(is_last_joiner)
        tensors = [p.detach() for p in ddp.module.parameters()]
        if ddp.broadcast_buffers:
            tensors += list(ddp.module.buffers())
        _broadcast_coalesced(tensors, src, ddp.process_group)


def _refuse_torch_only_options(name: str, torch_kwargs: dict) -> None:
    """Raise for a keyword torch's DDP has and the from-scratch wrappers leave out (TypeError for
    an unknown keyword, NotImplementedError naming torch's DDP for a left-out feature)."""
    for key, value in torch_kwargs.items():
        if key not in _UNSUPPORTED:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
        if value is not _UNSUPPORTED[key] and value != _UNSUPPORTED[key]:
            raise NotImplementedError(
                f"{name} does not support {key}={value!r}; use torch's "
                "DistributedDataParallel")


def _check_same_model_everywhere(name: str, module, broadcast_buffers: bool, world_size: int,
                                 process_group) -> None:
    """Exchange every rank's parameter signature (all_gather_object: synchronises the ranks)
    and raise the same ValueError on every rank naming the first difference."""
    signatures: list = [None] * world_size
    dist.all_gather_object(signatures, _signature(module, broadcast_buffers),
                           group=process_group)
    diff = _first_difference(signatures)
    if diff is not None:
        raise ValueError(f"{name}: the model differs between ranks, so its "
                         f"gradients cannot be averaged: {diff}. Build the same "
                         "model on every rank before wrapping it.")


class _GradSyncBase(nn.Module, Joinable):
    """What NaiveDDP and BucketedDDP share: construction checks and broadcast, hooks,
    ``no_sync``, ``Join`` support, and the per-step check table.

    Subclasses implement ``_grad_ready(index)`` (a gradient arrived during a synchronised
    backward), ``_after_backward()`` (autograd finished; make ``.grad`` the average) and
    ``_shadow_backward()`` (a joined rank's matching collectives with zeros).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, *,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 find_unused_parameters: bool = False, comm_hook: Callable | None = None,
                 recorder: Recorder | None = None, torch_kwargs: dict | None = None):
        super().__init__()
        Joinable.__init__(self)
        name = type(self).__name__
        _refuse_torch_only_options(name, torch_kwargs or {})
        if not group_active():
            raise RuntimeError(f"{name} needs a process group: call "
                               "ddp_lesson.env.init_distributed() (or "
                               "torch.distributed.init_process_group) first")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the process group it was given")
        self.device_ids, self.output_device = self._check_devices(device_ids, output_device)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.comm_hook = comm_hook if comm_hook is not None else default_all_reduce
        self.recorder = recorder
        #: like torch's DDP: False inside ``no_sync()``; read by ``forward``.
        self.require_backward_grad_sync = True
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        # Case 1 of the drop-in checks: exchange every rank's parameter list before any
        # broadcast, so a model that differs between ranks is the same ValueError everywhere
        # (torch raises on the differing rank only; the others see "connection closed").
        if init_sync:
            _check_same_model_everywhere(name, module, broadcast_buffers, self.world_size,
                                         process_group)
        # named_parameters() lists a shared (tied) parameter once: it is reduced once.
        # Frozen parameters get no gradient and are left alone.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{name}: the module has no parameter with "
                             "requires_grad=True, so there is nothing to synchronise")
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._param_ids = {id(p) for p in self._params}
        self._device = self._params[0].device
        # B8: whatever each rank initialised, everyone starts from rank 0's weights (and,
        # unless broadcast_buffers=False, rank 0's buffers: torch's rule, also at init).
        if init_sync:
            tensors = [p.detach() for p in module.parameters()]
            if broadcast_buffers:
                tensors += list(module.buffers())
            _broadcast_coalesced(tensors, self._src, process_group)
        self._init_sync_state()

    def _init_sync_state(self) -> None:
        """The per-parameter bookkeeping of a synchronised backward (local; no communication)."""
        P = len(self._params)
        self._used = [False] * P        # got a gradient since the last sync
        self._got = [False] * P         # got it in this synchronised backward
        self._ready = [False] * P       # counted ready (got it, or unused per the graph walk)
        self._late = [False] * P        # got it after being counted unused
        self._armed = False             # the last forward asked for a sync
        self._backward_begun = False
        self._queued_tasks: set[int] = set()
        self._buffers_need_sync = True
        self._warned_no_unused = False
        self._sync_forwards = 0         # synchronised forwards run so far (skipped backward)
        self._divisor = self.world_size
        self._divide_by_initial_world_size = True
        self._unsynced: list[str] = []  # trainable now, but not when wrapped
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                              for i, p in enumerate(self._params)]

    def _check_devices(self, device_ids, output_device):
        """torch's rule: ``device_ids`` / ``output_device`` only for a single-GPU module."""
        devices = {p.device for p in self.module.parameters()}
        name = type(self).__name__
        if len(devices) > 1 or all(d.type == "cpu" for d in devices):
            if device_ids or output_device is not None:
                raise ValueError(
                    f"{name}: device_ids and output_device only work with a module on one "
                    f"GPU; got device_ids {device_ids}, output_device {output_device}, and "
                    f"module parameters on {sorted(str(d) for d in devices)}. Pass None "
                    "(as torch's DistributedDataParallel requires)")
            return None, None
        (device,) = devices
        if device_ids:
            ids = [torch.device(d if not isinstance(d, int) else f"{device.type}:{d}")
                   for d in device_ids]
            if len(ids) != 1 or ids[0] != device:
                raise ValueError(f"{name}: device_ids {list(device_ids)} must name the one "
                                 f"device the module is on, {device}")
        if output_device is not None:
            out = torch.device(output_device if not isinstance(output_device, int)
                               else f"{device.type}:{output_device}")
            if out != device:
                raise ValueError(f"{name}: output_device {output_device} differs from the "
                                 f"module's device {device}; {name} returns outputs where "
                                 "the module computes them")
        return (None if not device_ids else [device.index]), (
            None if output_device is None else device.index)

    # ------------------------------------------------------------------ user-facing

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; decide here whether the next backward synchronises.

        As in torch's DDP the decision is taken in ``forward``: the backward of a forward run
        inside :meth:`no_sync` (or with grad disabled) only accumulates locally.

        Buffers: with ``broadcast_buffers=True`` (torch's default) the module's buffers, read
        afresh from ``module.buffers()`` each time (a forward may replace a buffer tensor by
        a new one), are broadcast from rank 0 before a forward that follows a synchronised
        one (inside ``Join``: from the highest rank still training, as torch). So a
        collective may run here. ``broadcast_buffers=False``: never, not even at
        construction (torch's rule): each rank keeps its own buffers.

        With ``device_ids`` (one GPU), tensors in the inputs are moved to that device first.
        """
        if self.device_ids:
            inputs, kwargs = _move_to(inputs, self._device), _move_to(kwargs, self._device)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._divisor = self.world_size
        if self._join_config.enable:
            # tell Join this rank is still training; the sum counts the ranks that are
            work = Join.notify_join_context(self)
            if work is not None:
                work.wait()
                active = int(work.get_future().value()[0].item())
                if not self._divide_by_initial_world_size:
                    self._divisor = active
        self._sync_buffers_if_due(joined=False)
        if self._join_config.enable:  # tell the joined ranks whether this backward syncs
            dist.all_reduce(torch.full((1,), float(sync), device=self._device),
                            group=self.process_group)
        self._buffers_need_sync = sync
        output = self.module(*inputs, **kwargs)
        self._armed = sync
        if sync:
            self._sync_forwards += 1
            self._got = [False] * len(self._params)
            self._ready = [False] * len(self._params)
            self._late = [False] * len(self._params)
            self._backward_begun = False
            self._queued_tasks = set()
            self._unsynced = [n for n, p in self.module.named_parameters()
                              if p.requires_grad and id(p) not in self._param_ids]
            if self.recorder is not None:
                self.recorder._begin(self.rank)
            self._prepare_backward(output)
            # The outer backward's own task gets a final callback even when every parameter
            # sits inside a reentrant checkpoint (whose inner backward is a task of its own).
            for t in _find_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._on_output_grad)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes of forwards run inside skip the all-reduce.

        The usual pattern with ``k`` micro-batches: the first ``k-1`` (forward *and* backward)
        inside ``no_sync()``, the last one outside, so its backward all-reduces the
        accumulated ``.grad`` (docs/pitfalls.md B4: local grads 1+3 and 1+6 give 5.5 on both
        ranks; syncing the first micro-batch instead leaves 4.0 and 7.0). Like torch, the
        forward decides: a ``no_sync()`` around ``backward()`` only does nothing.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with ddp.join():`` is ``with Join([ddp], ...)`` (torch's ``DDP.join``)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``torch.distributed.algorithms.Join`` runs on a rank out of inputs.

        Args:
            divide_by_initial_world_size: True (torch's default): a gradient averaged while
                some ranks have joined is still divided by the initial world size (the joined
                ranks count as zeros). False: divided by the number of ranks still training.
        """
        return _WrapperJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group

    def register_comm_hook(self, state, hook):
        raise NotImplementedError(
            f"{type(self).__name__} does not support register_comm_hook(state, hook) (torch's "
            "GradBucket hooks); pass comm_hook=hook(tensor, process_group) -> work when "
            "building it, or use torch's DistributedDataParallel")

    # ------------------------------------------------------------------ hooks

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._used[index] = True
            if not self._armed:
                return  # a no_sync backward: the gradient just accumulates
            self._begin_backward()
            if self.recorder is not None:
                self.recorder._grad(self.param_names[index])
            self._got[index] = True
            if not self._ready[index]:
                self._ready[index] = True
                self._grad_ready(index)
            else:  # counted unused by the graph walk, its zeros may be on the wire already
                self._late[index] = True
        return hook

    def _on_output_grad(self, grad):
        if self._armed:
            self._begin_backward()

    def _begin_backward(self) -> None:
        if not self._backward_begun:
            self._backward_begun = True
            self._backward_started()
        # One final callback per autograd task: a reentrant checkpoint runs an inner
        # backward (a task of its own) whose end is not the end of the outer one.
        task = torch._C._current_graph_task_id()
        if task not in self._queued_tasks:
            self._queued_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        if not self._armed:
            return  # already done in an inner task's callback
        nested = torch._C._current_autograd_node() is not None
        if nested and not all(self._ready):
            return  # an inner (reentrant) backward ended; the outer one goes on
        self._armed = False
        if self.recorder is not None:
            self.recorder._backward_end()
        try:
            self._after_backward()
        finally:
            self._used = [False] * len(self._params)
            if self.recorder is not None:
                self.recorder._finish()

    # ------------------------------------------------------------------ collectives

    def _common_rank(self, candidate: bool) -> int:
        """The highest global rank among those passing ``candidate=True`` (a MAX all-reduce)."""
        me = (self.rank if self.process_group is None
              else dist.get_global_rank(self.process_group, self.rank))
        t = torch.tensor([me if candidate else -1], device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def _sync_buffers_if_due(self, joined: bool) -> None:
        """Broadcast the buffers before a forward that follows a synchronised one."""
        buffers = list(self.module.buffers())  # afresh: forward may have replaced them
        if not (self.broadcast_buffers and self._buffers_need_sync and buffers):
            return
        src = self._common_rank(not joined) if self._join_config.enable else self._src
        _broadcast_coalesced(buffers, src, self.process_group)

    # ------------------------------------------------------------------ for subclasses

    def _prepare_backward(self, output) -> None:
        """Called after a synchronised forward."""

    def _backward_started(self) -> None:
        """Called at the first gradient of a synchronised backward."""

    def _grad_ready(self, index: int) -> None:
        raise NotImplementedError

    def _after_backward(self) -> None:
        raise NotImplementedError

    def _shadow_backward(self) -> None:
        raise NotImplementedError

    def _table(self, joined: bool = False) -> torch.Tensor:
        """Row ``rank`` of an ``(R, P + 3)`` int32 table; all-reduced, every rank sees every row.

        Parameter columns hold :data:`_GOT` | :data:`_USED` | :data:`_LATE` bits; then
        "joined", "synchronised forwards so far" and "unsynchronised trainable parameters".
        """
        P = len(self._params)
        table = torch.zeros(self.world_size, P + 3, dtype=torch.int32, device=self._device)
        if joined:
            table[self.rank, P + _COL_JOINED] = 1
            self._unsynced = []
            return table
        row = [(_GOT if g else 0) | (_USED if u else 0) | (_LATE if late else 0)
               for g, u, late in zip(self._got, self._used, self._late)]
        unsynced = [n for n in self._unsynced
                    if dict(self.module.named_parameters())[n].grad is not None]
        self._unsynced = unsynced
        row += [0, self._sync_forwards, len(unsynced)]
        table[self.rank] = torch.tensor(row, dtype=torch.int32, device=self._device)
        return table

    def _check_table(self, table: torch.Tensor) -> list[bool]:
        """After the table's all-reduce: which parameters to write (used on some rank).

        Raises the same error on every rank (they all hold the same table, and the gather of
        names below is entered by all of them):
            RuntimeError: a trainable parameter the wrapper does not know got a gradient;
                the ranks' synchronised-forward counts differ (a rank ran a forward whose
                backward it skipped); a parameter got a gradient after the graph walk counted
                it unused; without ``find_unused_parameters``, a parameter got no gradient on
                some rank.
        """
        name = type(self).__name__
        P = len(self._params)
        table = table.cpu()
        active = [r for r in range(self.world_size) if not table[r, P + _COL_JOINED]]
        if any(table[r, P + _COL_UNSYNCED] for r in active):
            names: list = [None] * self.world_size
            dist.all_gather_object(names, self._unsynced, group=self.process_group)
            where = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(names) if n)
            raise RuntimeError(
                f"{name}: parameters that were frozen or absent when the wrapper was built "
                f"now get gradients that it does not average, so the ranks would silently "
                f"diverge — {where}. Wrap the model again after changing requires_grad or "
                "adding parameters (torch's DDP does not notice this).")
        counts = {r: int(table[r, P + _COL_FORWARDS]) for r in active}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {r}: {c}" for r, c in counts.items())
            raise RuntimeError(
                f"{name}: the ranks have run different numbers of synchronised forwards "
                f"({said}), so this backward would average gradients of different steps. A "
                "rank ran a forward with gradients enabled and skipped its backward: run "
                "evaluation under torch.no_grad() or on ddp.module, and every training "
                "forward with a backward on every rank.")
        late = [i for i in range(P) if any(int(table[r, i]) & _LATE for r in active)]
        if late:
            raise RuntimeError(
                f"{name}: {', '.join(self.param_names[i] for i in late)} got a gradient "
                "although the graph walk after forward found it unused (a reentrant "
                "checkpoint hides parameters from the walk), and zeros were already sent for "
                f"it. {name} does not support find_unused_parameters=True with "
                "torch.utils.checkpoint(use_reentrant=True); use use_reentrant=False, or "
                "torch's DistributedDataParallel")
        bit = _USED if self.find_unused_parameters else _GOT
        if not self.find_unused_parameters:
            lines = []
            for r in active:
                missing = []
                for i in range(P):
                    code = int(table[r, i])
                    if not code & _GOT:
                        note = ("; it got its gradient only inside no_sync(), so "
                                "find_unused_parameters=True is needed" if code & _USED else "")
                        missing.append(f"{self.param_names[i]} (index {i}{note})")
                if missing:
                    lines.append(f"rank {r}: {', '.join(missing)}")
            if lines:
                raise RuntimeError(
                    f"{name}: these parameters received no gradient in this "
                    f"backward pass, so their all-reduce could never complete — "
                    f"{'; '.join(lines)}. torch's DDP would hang here or fail in the next "
                    "iteration with 'Expected to have finished reduction in the prior "
                    "iteration'. Make every parameter take part in the loss on every rank, "
                    "freeze it (requires_grad=False), or pass "
                    "find_unused_parameters=True.")
        used = [any(int(table[r, i]) & bit for r in active) for i in range(P)]
        if self.find_unused_parameters and not self._warned_no_unused and self.rank in active:
            self._warned_no_unused = True
            if all(self._got):
                warnings.warn(
                    f"{name}(find_unused_parameters=True): every parameter got a gradient "
                    "in the first synchronised backward on this rank. The flag costs a walk "
                    "of the autograd graph after every forward (and makes buckets wait for "
                    "the end of backward when something is unused); if no step ever leaves "
                    "a parameter out (none skipped by a branch or used only inside "
                    "no_sync()), leave it False.", UserWarning, stacklevel=2)
        return used

    def _agree_on_used(self, joined: bool = False) -> list[bool]:
        """All-reduce the check table (blocking), then check it."""
        table = self._table(joined)
        dist.all_reduce(table, group=self.process_group)
        return self._check_table(table)

    def _all_reduce(self, tensor: torch.Tensor, index: int, names: list[str]):
        """Issue the SUM all-reduce of ``tensor`` through ``comm_hook``; returns a handle for
        :meth:`_wait`."""
        work = self.comm_hook(tensor, self.process_group)
        event = None
        if self.recorder is not None:
            event = self.recorder._comm_start(index, tensor.numel() * tensor.element_size(),
                                              names, work)
        return work, event

    def _wait(self, handle) -> None:
        """Block until the all-reduce behind ``handle`` has finished."""
        work, event = handle
        work.wait()
        if self.recorder is not None:
            self.recorder._comm_end(event)

    def _write_grad(self, index: int, value: torch.Tensor) -> None:
        p = self._params[index]
        if p.grad is None:
            p.grad = value.view(p.shape).clone()
        else:
            p.grad.copy_(value.view(p.shape))


class NaiveDDP(_GradSyncBase):
    """Data parallelism the simplest way: after backward, one all-reduce per parameter.

    A drop-in replacement for ``torch.nn.parallel.DistributedDataParallel(module, ...)``,
    with torch's signature: when ``loss.backward()`` returns, every ``p.grad`` is the mean
    over ranks. It is slow on purpose: every parameter is its own message (each pays the link
    latency α), and nothing is sent until backward has finished (no overlap).
    :class:`BucketedDDP` fixes both.

    Averaging: each gradient is divided by ``R`` *before* the SUM all-reduce, as torch's DDP
    does (``_allreduce_fut`` in ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``:
    "Apply the division first to avoid overflow, especially for FP16"): a sum over ``R`` ranks
    of fp16 values near 65504 would overflow to inf, the mean of the pre-divided values
    cannot.

    Construction checks (a collective): every rank's parameter list (names, shapes, dtypes,
    requires_grad; and buffers with ``broadcast_buffers``) is all-gathered and compared, so a
    model that differs between ranks raises the same ValueError on every rank, naming the
    first difference and both shapes; then parameters (and buffers with
    ``broadcast_buffers``) are broadcast from rank 0.

    Each synchronised backward also all-reduces a small ``(R, P + 3)`` int32 table (who
    produced which gradient, how many synchronised forwards each rank ran, whether a
    parameter the wrapper does not know got a gradient) and raises the same RuntimeError on
    every rank when: a parameter got no gradient on some rank (without
    ``find_unused_parameters``; torch hangs or fails an iteration later); a rank skipped a
    backward (torch silently averages different steps); a parameter unfrozen or added after
    wrapping got a gradient (torch lets the ranks diverge silently: wrap again).

    Uneven inputs: a ``torch.distributed.algorithms.Join`` joinable like torch's DDP (``with
    Join([ddp]):`` or ``with ddp.join():``); a rank out of inputs shadows the others'
    all-reduces with zeros. Reentrant activation checkpointing works (the averaging waits for
    the outer backward, not the checkpoint's inner one).

    Args:
        module: the model (already on this rank's device).
        device_ids: None on CPU (a list raises ValueError, as torch); on one GPU, None or
            ``[that GPU]``: inputs are then moved to it in ``forward``.
        output_device: None, or the module's GPU.
        dim: only 0 (torch uses it to scatter inputs over several GPUs per process).
        broadcast_buffers: broadcast rank 0's buffers at construction and before forwards
            that follow a synchronised one (torch's default); False: never.
        init_sync: False skips the construction checks and broadcast (torch's flag).
        process_group: group to average over (None: the default group).
        bucket_cap_mb: only None (NaiveDDP has no buckets; use :class:`BucketedDDP`).
        find_unused_parameters: False (default): a parameter that gets no gradient on some
            rank raises RuntimeError on every rank, naming it (and saying when it got its
            gradient only inside ``no_sync()``). True: its local gradient (accumulated since
            the last sync, ``no_sync`` passes included) counts in the average, zeros for a
            rank that has none (torch's behaviour); one unused on every rank keeps ``.grad``
            unchanged (``None``).
        comm_hook: ``hook(tensor, process_group) -> work`` that SUM-all-reduces ``tensor``
            (default :func:`default_all_reduce`; a :class:`SimulatedLink` fits).
        recorder: a :class:`Recorder` to fill, or None.

    Attributes:
        module: the wrapped model (save ``ddp.module.state_dict()``).
        param_names: names of the synchronised (trainable) parameters, registration order.

    Raises:
        RuntimeError: no process group.
        ValueError: no trainable parameter, a model that differs between ranks, or bad
            ``device_ids`` / ``output_device``.
        NotImplementedError: a left-out torch feature (below).

    Synchronisation: construction (gather and broadcast), forwards that broadcast buffers,
    and every synchronised backward are collectives: all ranks must do them together.

    Left out, compared with torch's DDP (each raises NotImplementedError saying so when asked
    for): ``gradient_as_bucket_view=True``, ``static_graph=True``, ``mixed_precision``,
    ``device_mesh``, ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
    ``skip_all_reduce_unused_params``, ``bucket_cap_mb_list``, ``batched_grad_copy``,
    ``forward_sync_buffers``, ``dim != 0``, ``check_reduction=True`` and
    ``register_comm_hook`` (use ``comm_hook=``); multi-device modules (``device_ids`` must
    be None or the one GPU the module is on); sparse gradients; buffer communication hooks.
    ``find_unused_parameters=True`` with a reentrant checkpoint raises when it would send
    zeros for a parameter that then gets a gradient.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, comm_hook: Callable | None = None,
                 recorder: Recorder | None = None, **torch_kwargs):
        if bucket_cap_mb is not None:
            raise NotImplementedError(
                f"NaiveDDP does not support bucket_cap_mb={bucket_cap_mb!r} (it sends one "
                "message per parameter); use BucketedDDP or torch's DistributedDataParallel")
        torch_kwargs.update(dim=dim, check_reduction=check_reduction,
                            gradient_as_bucket_view=gradient_as_bucket_view,
                            static_graph=static_graph)
        super().__init__(module, device_ids, output_device, broadcast_buffers=broadcast_buffers,
                         init_sync=init_sync, process_group=process_group,
                         find_unused_parameters=find_unused_parameters, comm_hook=comm_hook,
                         recorder=recorder, torch_kwargs=torch_kwargs)

    def _grad_ready(self, index: int) -> None:
        pass  # nothing to do until backward has finished

    def _after_backward(self) -> None:
        used = self._agree_on_used()  # a tiny all-reduce: which rank produced which gradient
        for i, p in enumerate(self._params):
            if not used[i]:
                continue  # unused on every rank: .grad stays as it is (None), like torch
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused here, used elsewhere: contributes 0
            p.grad.div_(self._divisor)        # pre-divide (torch's order: no fp16 overflow)
            handle = self._all_reduce(p.grad, i, [self.param_names[i]])  # SUM over ranks
            self._wait(handle)                # one message at a time, after backward

    def _shadow_backward(self) -> None:
        used = self._agree_on_used(joined=True)
        for i, p in enumerate(self._params):
            if used[i]:
                self._wait(self._all_reduce(torch.zeros_like(p), i, [self.param_names[i]]))


@dataclass
class _Bucket:
    index: int
    params: list[int]                  # parameter indices, in gradient-ready order
    offsets: list[tuple[int, int]]     # their [start, stop) in ``flat``
    flat: torch.Tensor                 # the message: every gradient of the bucket, flattened
    pending: int = 0                   # gradients still missing in this backward
    handle: object = None              # the all-reduce in flight

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class BucketedDDP(_GradSyncBase):
    """Data parallelism with gradient buckets all-reduced while backward is still running.

    A drop-in replacement for ``torch.nn.parallel.DistributedDataParallel(module,
    bucket_cap_mb=..., find_unused_parameters=...)``: when ``loss.backward()`` returns, every
    ``p.grad`` is the mean over ranks.

    Parameters are grouped by :func:`assign_buckets` (reverse registration order, a bucket
    closed once it holds ``bucket_cap_mb``). During a synchronised backward, when the last
    gradient of a bucket has been accumulated, the bucket's gradients are copied into its flat
    tensor, multiplied by ``1/R`` (torch pre-divides too) and SUM-all-reduced asynchronously;
    buckets are issued in bucket order on every rank (a bucket that is complete early waits
    for the ones before it). When autograd has finished, the final callback issues whatever
    is left, waits for every bucket and copies the averages back into ``.grad``.

    Unused parameters: with ``find_unused_parameters=True`` the autograd graph is walked
    after each forward (as torch does); parameters it does not reach are marked ready at
    the start of backward, contributing their current ``.grad`` or zeros, so their bucket is
    not held back. A parameter that nobody used keeps its ``.grad`` (``None``); one used on
    some ranks only gets the average with zeros for the others (B1: g on rank 0 -> g/2 on
    both). Without the flag, a missing gradient raises RuntimeError on every rank, naming
    the parameter, at the end of that backward (torch hangs or fails an iteration later).

    Averaging: each bucket is multiplied by ``1/R`` *before* the SUM all-reduce, as torch's
    DDP does (``_allreduce_fut`` in ``torch/distributed/algorithms/ddp_comm_hooks/
    default_hooks.py``: "Apply the division first to avoid overflow, especially for FP16"): a
    sum over ``R`` ranks of fp16 values near 65504 would overflow to inf.

    Construction checks, the per-step table and its errors (a rank skipped a backward, a
    parameter unfrozen or added after wrapping got a gradient), ``Join`` for uneven inputs,
    reentrant checkpointing and buffer broadcasts: as :class:`NaiveDDP`.

    Differences from torch's DDP: buckets are fixed (torch rebuilds them after the first
    iteration in the order gradients actually arrived, and makes its first bucket 1 MB);
    gradients are copied into the bucket (``gradient_as_bucket_view=False``); one extra
    small all-reduce per step carries the check table.

    Args:
        module: the model (already on this rank's device).
        device_ids, output_device, dim, init_sync: as :class:`NaiveDDP` (torch's rules).
        broadcast_buffers: broadcast rank 0's buffers at construction and before forwards
            that follow a synchronised one (torch's default); False: never.
        process_group: group to average over (None: the default group).
        bucket_cap_mb: bucket size in MiB (1 MiB = 1024**2 bytes), as in torch (None: 25).
        find_unused_parameters: see above (default False, as in torch).
        overlap: True (default) issues a bucket as soon as it is ready; False waits for the
            end of backward (to measure what overlap buys).
        comm_hook: ``hook(tensor, process_group) -> work`` that SUM-all-reduces ``tensor``
            (default :func:`default_all_reduce`; a :class:`SimulatedLink` fits).
        recorder: a :class:`Recorder` to fill, or None.

    Attributes:
        module: the wrapped model (save ``ddp.module.state_dict()``).
        bucket_indices: the buckets as lists of parameter indices (into ``param_names``).
        param_names: names of the synchronised (trainable) parameters.

    Raises:
        RuntimeError: no process group.
        ValueError: no trainable parameter, a negative ``bucket_cap_mb``, a model that
            differs between ranks, or bad ``device_ids`` / ``output_device``.
        NotImplementedError: a left-out torch feature (below).

    Synchronisation: construction, buffer broadcasts before forwards and every synchronised
    backward are collectives (all ranks together).

    Left out, compared with torch's DDP: the same features as :class:`NaiveDDP` (listed in
    its docstring), each raising NotImplementedError saying so when asked for.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, overlap: bool = True,
                 comm_hook: Callable | None = None, recorder: Recorder | None = None,
                 **torch_kwargs):
        if bucket_cap_mb is None:
            bucket_cap_mb = 25  # torch's default
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        torch_kwargs.update(dim=dim, check_reduction=check_reduction,
                            gradient_as_bucket_view=gradient_as_bucket_view,
                            static_graph=static_graph)
        super().__init__(module, device_ids, output_device, broadcast_buffers=broadcast_buffers,
                         init_sync=init_sync, process_group=process_group,
                         find_unused_parameters=find_unused_parameters, comm_hook=comm_hook,
                         recorder=recorder, torch_kwargs=torch_kwargs)
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = overlap
        self.bucket_indices = assign_buckets(
            [p.numel() * p.element_size() for p in self._params], int(bucket_cap_mb * MB),
            [(p.dtype, p.device) for p in self._params])
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        for b, indices in enumerate(self.bucket_indices):
            offsets, start = [], 0
            for i in indices:
                offsets.append((start, start + self._params[i].numel()))
                start += self._params[i].numel()
                self._bucket_of[i] = b
            first = self._params[indices[0]]
            flat = torch.empty(start, dtype=first.dtype, device=first.device)
            self._buckets.append(_Bucket(b, list(indices), offsets, flat))
        self._next_bucket = 0
        self._unused_in_forward: list[int] = []

    # ------------------------------------------------------------------ backward machinery

    def _prepare_backward(self, output) -> None:
        for bucket in self._buckets:
            bucket.pending, bucket.handle = len(bucket.params), None
        self._next_bucket = 0
        if self.find_unused_parameters:
            _, reached = walk_autograd_graph(output)
            self._unused_in_forward = [i for i, p in enumerate(self._params)
                                       if id(p) not in reached]

    def _backward_started(self) -> None:
        # Parameters the forward did not reach will get no gradient: count them as ready
        # now, so that their buckets are not held back until the end (torch does the same).
        for i in self._unused_in_forward:
            if not self._ready[i]:
                self._ready[i] = True
                self._grad_ready(i)

    def _grad_ready(self, index: int) -> None:
        bucket = self._buckets[self._bucket_of[index]]
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order: every rank must issue its collectives in the same order,
        # or rank 0's bucket 3 would be summed with rank 1's bucket 2.
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].pending == 0):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        scale = 1.0 / self._divisor  # pre-divide (torch's order: no fp16 overflow in the sum)
        with torch.no_grad():
            for i, (start, stop) in zip(bucket.params, bucket.offsets):
                grad = self._params[i].grad
                if grad is None:  # no gradient here (unused): contributes zeros
                    bucket.flat[start:stop].zero_()
                else:
                    torch.mul(grad.reshape(-1), scale, out=bucket.flat[start:stop])
        bucket.handle = self._all_reduce(bucket.flat, bucket.index,
                                         [self.param_names[i] for i in bucket.params])

    def _after_backward(self) -> None:
        # Issue what is left (everything, without overlap; buckets whose gradients never
        # came, with zeros), then the flags table, then wait: same order on every rank.
        while self._next_bucket < len(self._buckets):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1
        table = self._table()
        table_work = dist.all_reduce(table, group=self.process_group, async_op=True)
        for bucket in self._buckets:
            self._wait(bucket.handle)
        table_work.wait()
        used = self._check_table(table)
        with torch.no_grad():
            for bucket in self._buckets:
                for i, (start, stop) in zip(bucket.params, bucket.offsets):
                    if used[i]:
                        self._write_grad(i, bucket.flat[start:stop])
                bucket.handle = None

    def _shadow_backward(self) -> None:
        # a joined rank: zeros for every bucket, in bucket order, then a "joined" table row
        handles = []
        for bucket in self._buckets:
            bucket.flat.zero_()
            handles.append(self._all_reduce(bucket.flat, bucket.index, []))
        table = self._table(joined=True)
        table_work = dist.all_reduce(table, group=self.process_group, async_op=True)
        for handle in handles:
            self._wait(handle)
        table_work.wait()
        self._check_table(table)
