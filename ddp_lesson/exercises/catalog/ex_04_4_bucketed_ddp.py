"""Exercise 04.4: overlapped, bucketed DDP with ``no_sync()``: the weights and the overlap.

Each rank trains a :class:`~._ddp_shared.ChainNet` at four bucket caps, 3 steps (the last with
a micro-batch inside ``no_sync()``), every ``dist.all_reduce`` recorded (size, async, its
``wait()``) in one timeline with the moment each gradient became final. The judge checks the
weights, the messages against torch's buckets, then the overlap.
"""
from __future__ import annotations

from ...core.bucketed_ddp import MB, assign_buckets, ddp_buckets
from .. import solutions as S
from ..registry import Exercise, register
from ..values import fmt_list
from ._ddp_shared import SEED, ChainNet, build, train_rank, trajectory_problem
from ._shared import dist_patched, spy

_PLAN = (1, 1, 2)                 # the last step: two micro-batches, the first in no_sync()
_CAPS = (0, 40, 100, 1 << 20)     # bytes: a bucket per parameter, three, two, one
_NUMELS = (15, 5, 20, 4, 8, 2)    # ChainNet's parameters, registration order


def _context(step):
    return " (two micro-batches, the first inside no_sync())" if _PLAN[step - 1] > 1 else ""


class _Work:
    """A recorded all-reduce's handle: notes when it is waited for."""

    def __init__(self, work, events, k):
        self._work, self._events, self._k = work, events, k

    def wait(self, *args, **kwargs):
        self._events.append(("wait", self._k))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _recorded_all_reduce(events):
    def launch(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        k = sum(e[0] == "launch" for e in events)
        events.append(("launch", tensor.numel(), bool(async_op)))
        return lambda work: _Work(work, events, k) if async_op and work is not None else work

    return spy("all_reduce", launch)


def _run_cap(cls, cap, rank, world_size):
    model = build(ChainNet, SEED + rank)
    wrapped = cls(model, bucket_cap_mb=cap / MB)
    events, backwards = [], []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: events.append(("ready", i)))

    def on_backward(step, micro, synced):
        backwards.append({"step": step + 1, "synced": synced, "events": list(events)})
        events.clear()

    with dist_patched({"all_reduce": _recorded_all_reduce(events)}):
        vals = train_rank(wrapped, model, ChainNet, _PLAN, rank, world_size, on_backward)
    return {"values": vals, "backwards": backwards}


def _rank(cls, rank, world_size):
    return [_run_cap(cls, cap, rank, world_size) for cap in _CAPS]


def _bucket_sizes(cap) -> tuple[list, list, list]:
    """Elements per message, in launch order: torch's buckets after its rebuild (filled from
    the last parameter); filled and launched in forward order (a learner's slip); filled in
    forward order, launched reversed (torch's at construction, kept only with
    find_unused_parameters=True)."""
    nbytes = [4 * n for n in _NUMELS]
    orders = (ddp_buckets(nbytes, cap / MB), assign_buckets(nbytes, cap),
              assign_buckets(nbytes, cap)[::-1])
    return tuple([sum(_NUMELS[i] for i in b) for b in buckets] for buckets in orders)


def _messages_problem(cap, r, bw) -> str | None:
    sizes = [e[1] for e in bw["events"] if e[0] == "launch"]
    where = f"bucket_cap_mb = {cap}/2**20 ({cap} bytes), step {bw['step']}, rank {r}"
    if not bw["synced"]:
        if sizes:
            return (f"{where}: the backward of a forward inside no_sync() all-reduced "
                    f"{len(sizes)} message(s); no_sync() must skip communication (.grad only "
                    "accumulates, the next synchronised backward averages the sum).")
        return None
    want, forward, construction = _bucket_sizes(cap)
    if not sizes:
        return (f"{where}: the weights are right, but the checker saw no dist.all_reduce call "
                "in this backward. Call it as dist.all_reduce (import torch.distributed as "
                "dist), asynchronously, once per bucket, so that it can be recorded.")
    if sizes == forward and sizes != want:
        return (f"{where}: all-reduced messages of {fmt_list(sizes)} elements: buckets sent "
                f"in forward order; sent in reverse order (backward makes the last layer's "
                f"gradients first), they are {fmt_list(want)}.")
    if sizes == construction and sizes != want:
        return (f"{where}: all-reduced messages of {fmt_list(sizes)} elements: buckets filled "
                f"in registration order, sent last first: torch's buckets at construction, "
                f"kept only with find_unused_parameters=True; by default torch rebuilds them "
                f"in the order gradients become ready (the last parameter first), each closed "
                f"once it holds at least the cap, sent in that order: {fmt_list(want)}.")
    if sorted(sizes) == sorted(want) and sizes != want:
        return (f"{where}: messages of {fmt_list(sizes)} elements, in that order; the buckets "
                f"go out as {fmt_list(want)}: launch them strictly in bucket order, the same on "
                "every rank (all-reduces are matched by the order the ranks issue them).")
    if sizes != want:
        text = (f"{where}: all-reduced messages of {fmt_list(sizes)} elements; the parameters "
                f"{fmt_list(_NUMELS)} in buckets filled from the last one, each closed once "
                f"it holds at least the cap, launched in that order, give {fmt_list(want)}")
        if len(sizes) != len(want):
            text += f": {len(sizes)} bucket(s) instead of {len(want)}; does the cap decide?"
        return text + "."
    return None


def _overlap_problem(cap, r, bw) -> str | None:
    events = bw["events"]
    ready = [k for k, e in enumerate(events) if e[0] == "ready"]
    launches = [k for k, e in enumerate(events) if e[0] == "launch"]
    if len(launches) < 2 or not ready:
        return None  # one bucket: nothing can overlap
    last_ready = ready[-1]
    where = f"bucket_cap_mb = {cap}/2**20 ({cap} bytes), step {bw['step']}, rank {r}"
    first = events[launches[0]]
    if launches[0] > last_ready:
        return (f"{where}: the first bucket's all-reduce was issued after the last gradient "
                "was ready: nothing overlapped backward. Launch each bucket from the gradient "
                "hook that completes it (register_post_accumulate_grad_hook), with "
                "async_op=True, and wait at the end of backward.")
    if not first[2]:
        return (f"{where}: the first bucket's all-reduce was blocking (async_op=False) in a "
                "gradient hook, so backward waited for it there. Pass async_op=True and wait "
                "for the handles at the end of backward (a queued autograd callback).")
    waits = [k for k, e in enumerate(events) if e[0] == "wait"]
    if waits and waits[0] < last_ready:
        return (f"{where}: a bucket's handle was waited for before backward had produced every "
                "gradient (inside a hook), so backward stalled there. Wait for the handles "
                "only once backward has finished (a queued autograd callback).")
    return None


def _judge(results) -> list[str]:
    R = len(results)
    for c, cap in enumerate(_CAPS):
        problem = trajectory_problem([results[r][c]["values"] for r in range(R)], ChainNet,
                                     _PLAN, _context)
        if problem:
            return [f"bucket_cap_mb = {cap}/2**20 ({cap} bytes): {problem}"]
    for check in (_messages_problem, _overlap_problem):
        for c, cap in enumerate(_CAPS):
            for r in range(R):
                for bw in results[r][c]["backwards"]:
                    problem = check(cap, r, bw)
                    if problem:
                        return [problem]
    return []


register(Exercise(
    "04.4", "overlapped, bucketed DDP with no_sync()",
    task="Write class BucketedDDP(torch.nn.Module) with __init__(self, module, bucket_cap_mb) "
         "and forward: broadcast rank 0's parameters and buffers at construction; group the "
         "trainable parameters into buckets as torch's DDP does after its first iteration: "
         "filled from the last parameter to the first (the order backward makes gradients "
         "ready), each closed once it holds at least bucket_cap_mb * 2**20 bytes, launched in "
         "that order (the last parameters' bucket first); in "
         "backward, as soon as a "
         "bucket's gradients are all final (register_post_accumulate_grad_hook), copy them "
         "into one flat tensor and all-reduce it asynchronously (async_op=True; divide by the "
         "world size), buckets strictly in order; wait for the handles and copy the averages "
         "back into .grad at the end of backward (a queued autograd callback), before "
         "backward() returns. no_sync(): a context manager; the backward of a forward run "
         "inside it communicates nothing, and the next synchronised backward averages the "
         "accumulated .grad.",
    signature="cls(module: nn.Module, bucket_cap_mb: float) -> nn.Module with no_sync(); "
              "then out = wrapped(x); loss(out).backward(); an SGD step, 3 times (the last "
              "with 2 micro-batches, the first inside wrapped.no_sync())",
    reference=S.BucketedDDP, kind="distributed", world_sizes=(2, 3),
    run_rank=_rank, judge=_judge,
    checked="2 and 3 processes (torchrun, gloo), ranks seeded differently, a 3-layer MLP at bucket "
            "caps of 0, 40, 100 and 2**20 bytes, 3 SGD steps against one process on the "
            "global batch; every all_reduce recorded with the moment each gradient was ready"))
