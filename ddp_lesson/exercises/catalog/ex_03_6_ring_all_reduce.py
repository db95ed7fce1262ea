"""Exercise 03.6: a ring all-reduce built from isend/irecv, at 4 and 3 processes.

torch's collectives are refused and every point-to-point message recorded, so the method
(neighbours only, 2(R-1) chunks) is judged as well as the values; each rank's integer input
carries a digit of its own, so a wrong element says which ranks it summed.
"""
from __future__ import annotations

import math

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import close, fmt_list, ranks_text
from ._shared import dist_patched, spy

# (dtype, shape): an integer tensor has a digit per rank, so a wrong element says which
# ranks it summed; sizes below, at and above the world size.
_CASES = [("int64", (10,)), ("int64", (1,)), ("int64", (3,)), ("int64", (4,)),
          ("int64", (3, 7)), ("int64", (1001,)), ("float32", (1000,))]


def _input(dtype, shape, rank):
    numel = math.prod(shape)
    if dtype == "int64":
        return ((torch.arange(numel, dtype=torch.int64) + 1) * 10 ** rank).reshape(shape)
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g).reshape(shape)


#: torch's own collectives, off limits while a learner's ring runs: the exercise is to build
#: the all-reduce from point-to-point messages.
_BUILT_IN = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
             "all_gather_into_tensor", "all_gather_object", "reduce", "broadcast",
             "all_to_all", "all_to_all_single", "gather", "scatter")


class BuiltInCollectiveUsed(RuntimeError):
    pass


def _peer(args, kwargs, which: str):
    """The peer rank of an isend/irecv/send/recv call, however it was passed."""
    if len(args) > 1:
        return args[1]
    for key in (which, f"group_{which}"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def _call_recording_p2p(fn, tensor):
    """``fn(tensor)`` with torch's collectives refused and every point-to-point message
    recorded: returns (what fn returned, [("send"|"recv", peer, numel), ...])."""
    import torch.distributed as dist

    messages = []

    def refuse(name):
        def refused(*args, **kwargs):
            raise BuiltInCollectiveUsed(
                f"your ring called dist.{name}; build it from dist.isend / dist.irecv "
                "(or send / recv) only: that is the exercise")
        return refused

    def record(name):
        kind, which = ("send", "dst") if "send" in name else ("recv", "src")

        def check(*args, **kwargs):
            t = args[0] if args else kwargs.get("tensor")
            peer, world = _peer(args, kwargs, which), dist.get_world_size()
            me = dist.get_rank()
            if peer is None and kind == "recv":
                # torch receives from any rank then (distributed_c10d.irecv: "src: Source
                # rank. Will receive from any process if unspecified"): not a ring's message
                raise ValueError(f"dist.{name} without src on rank {me}: it receives from any "
                                 "rank, so the ring's order is left to chance. Name the "
                                 f"previous rank, src=(rank - 1) % R ({(me - 1) % world} here)")
            if peer == me:
                # distributed_c10d.isend allows src == dst, but on gloo it raises "Pair is not
                # connected" (torch 2.13, a run of isend(t, rank).wait()): not a ring's message
                raise ValueError(f"dist.{name} on rank {me} with {which}={me}, its own rank: a "
                                 f"rank cannot {kind} to itself. A ring's neighbours are "
                                 f"(rank + 1) % R and (rank - 1) % R ({(me + 1) % world} and "
                                 f"{(me - 1) % world} here)")
            if isinstance(peer, int) and not 0 <= peer < world:
                # gloo would wait for a rank that does not exist until the timeout
                raise ValueError(f"dist.{name} with rank {peer}, but there are {world} ranks "
                                 f"(0 to {world - 1}): a ring's neighbours are (rank + 1) % R "
                                 "and (rank - 1) % R, with R = dist.get_world_size()")
            messages.append((kind, peer, int(t.numel()) if hasattr(t, "numel") else -1))

        return spy(name, check)

    patches = {name: refuse(name) for name in _BUILT_IN if hasattr(dist, name)}
    patches.update({name: record(name) for name in ("isend", "irecv", "send", "recv")})
    with dist_patched(patches):
        return fn(tensor), messages


def _rank(fn, rank, world_size):
    out = []
    for dtype, shape in _CASES:
        t = _input(dtype, shape, rank)
        back, messages = _call_recording_p2p(fn, t)
        ret = back.reshape(-1).tolist() if isinstance(back, torch.Tensor) else None
        out.append({"tensor": t.reshape(-1).tolist(), "returned": ret, "shape": list(t.shape),
                    "messages": messages})
    return out


def _judge_method(results) -> list[str]:
    """The values are right; is it a ring? Neighbours only, at most 2(R-1) messages to each,
    and at most 2(R-1) chunks of ceil(n/R) elements sent in all."""
    R = len(results)
    for i, (dtype, shape) in enumerate(_CASES):
        n = math.prod(shape)
        case = f"an {dtype} tensor of shape {tuple(shape)}"
        for r in range(R):
            messages = results[r][i]["messages"]
            neighbours = {(r + 1) % R, (r - 1) % R}
            far = sorted({peer for _, peer, _ in messages if peer not in neighbours},
                         key=lambda p: (p is None, p if p is not None else 0))
            if far:
                return [f"{case}: the values are right, but rank {r} exchanged messages with "
                        f"rank(s) {', '.join(map(str, far))}, which are not its neighbours "
                        f"{(r - 1) % R} and {(r + 1) % R}. A ring talks only to (rank + 1) % R "
                        "and (rank - 1) % R, in 2(R-1) steps; sending to every rank is an "
                        "all-to-all, what the ring avoids."]
            for peer in sorted(neighbours):
                sends = sum(1 for kind, p, _ in messages if kind == "send" and p == peer)
                if sends > 2 * (R - 1):
                    return [f"{case}: the values are right, but rank {r} sent {sends} messages "
                            f"to rank {peer}; a ring all-reduce takes 2(R-1) = {2 * (R - 1)} "
                            "steps, one chunk to the next rank per step."]
            sent = sum(k for kind, _, k in messages if kind == "send")
            bound = 2 * (R - 1) * math.ceil(n / R)
            if sent > bound:
                return [f"{case}: the values are right, but rank {r} sent {sent} elements for a "
                        f"tensor of {n}; a ring all-reduce sends 2(R-1) chunks of about n/R "
                        f"elements (at most {bound} here). Pass chunks round the ring, not "
                        "whole tensors."]
            if not any(kind == "send" for kind, _, _ in messages) and n >= R:
                return [f"{case}: the values are right, but rank {r} sent no message with "
                        "isend/send: build the ring from point-to-point messages."]
    return []


def _contributors(value: int, element: int, world_size: int) -> list[int]:
    q, rem = divmod(int(value), element + 1)
    digits = [(q // 10 ** r) % 10 for r in range(world_size)]
    if rem or q >= 10 ** world_size:
        return []
    return [r for r, d in enumerate(digits) if d == 1] if all(d in (0, 1) for d in digits) else []


def _judge(results) -> list[str]:
    R = len(results)
    for i, (dtype, shape) in enumerate(_CASES):
        ins = [_input(dtype, shape, r) for r in range(R)]
        want = sum(t.double() for t in ins).reshape(-1).tolist()
        case = f"an {dtype} tensor of shape {tuple(shape)}"
        for r in range(R):
            rec = results[r][i]
            got = rec["tensor"]
            if (got == [int(v) for v in want] if dtype == "int64"
                    else close(got, want, 1e-5, 1e-5)):
                continue
            if rec["returned"] is not None and close(rec["returned"], want, 1e-5, 1e-5):
                return [f"{case}: the returned tensor holds the sum but rank {r}'s input tensor "
                        "does not: like dist.all_reduce, work in place (write into tensor)."]
            if close(got, ins[r].reshape(-1).tolist(), 0, 0):
                return [f"{case}: rank {r}'s tensor is unchanged after your call."]
            if (close(got, [v / R for v in want], 1e-5, 1e-5)
                    or (dtype == "int64" and got == [int(v) // R for v in want])):
                return [f"{case}: rank {r} holds the sum divided by {R} (the mean); "
                        "all_reduce's default op is SUM."]
            msg = f"{case}: rank {r} got {fmt_list(got)}, dist.all_reduce gives {fmt_list(want)}"
            if dtype == "int64":
                full = [e for e in range(len(got)) if got[e] == want[e]]
                partial = [e for e in range(len(got)) if got[e] != want[e]]
                e = partial[0]
                who = _contributors(got[e], e, R)
                if who:
                    msg += (f". Element {e} holds the values of rank(s) {ranks_text(who)} only "
                            f"(each rank's input carries its own digit: rank k adds "
                            f"(i+1)*10**k)")
                if full and who and len(full) <= math.ceil(len(got) / R) + 1:
                    msg += (f"; the full sum is only in elements {full[0]}-{full[-1]}. That is "
                            "what a reduce-scatter leaves: the all-gather phase (R-1 more steps "
                            "passing the finished chunks round the ring) is missing")
            return [msg + "."]
    return _judge_method(results)


register(Exercise(
    "03.6", "ring all-reduce from isend/irecv",
    task="Write ring_all_reduce(tensor) -> tensor: an in-place SUM all-reduce on a ring, "
         "reduce-scatter then all-gather, built from dist.isend / dist.irecv to the neighbours "
         "(rank + 1) % R and (rank - 1) % R. It must work for any shape, for fewer elements "
         "than ranks, and give exactly dist.all_reduce's result on integers.",
    signature="fn(tensor: Tensor) -> Tensor   # in place; a collective",
    reference=S.ring_all_reduce, kind="distributed", world_sizes=(4, 3),
    run_rank=_rank, judge=_judge,
    checked="4 and 3 processes (torchrun, gloo), int64 sizes 1, 3, 4, 10, 21 (3x7), 1001 "
            "exactly, float32 1000 within 1e-5; messages to neighbours only, 2(R-1) chunks"))
