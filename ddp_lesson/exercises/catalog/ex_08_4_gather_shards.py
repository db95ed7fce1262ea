"""Exercise 08.4: all-gather uneven flat shards with one collective, at 3 and 2 processes.

int64, float32 and bfloat16 shards (a pad buffer of another dtype changes or rounds what is
returned); every ``torch.distributed`` call is recorded, so the judge checks one all-gather did it.
"""
from __future__ import annotations

from collections import Counter

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import fmt_list, returned
from ._shared import dist_patched

#: (elements, dtype); bfloat16 holds the integers up to 256 exactly, so its values compare
#: exactly too
_CASES = [(10, "int64"), (9, "int64"), (2, "int64"), (1, "int64"), (17, "int64"),
          (10, "float32"), (7, "bfloat16")]

#: What torch.distributed offers to move data; a call of any of them is recorded (the outermost
#: only: all_gather_object calls all_gather itself) while a candidate runs.
_CALLS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
          "broadcast_object_list", "all_reduce", "reduce", "gather", "gather_object",
          "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor",
          "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
          "batch_isend_irecv")
_ONE_GATHER = ("all_gather", "all_gather_into_tensor")


def _call_recording(fn, args, names):
    """``fn(*args)`` with every call of ``torch.distributed.<name>`` recorded by name;
    returns (what fn returned, [names in call order])."""
    import torch.distributed.distributed_c10d as c10d

    calls, depth = [], [0]

    def record(name, f):
        def recorded(*a, **k):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
        return recorded

    patches = {name: record(name, getattr(c10d, name)) for name in names if hasattr(c10d, name)}
    with dist_patched(patches):
        return fn(*args), calls


def _full(total, dtype="int64"):
    """The flat tensor the shards come from: 7, 14, 21, ... (whole numbers in every dtype;
    float32 and bfloat16 hold them exactly)."""
    return ((torch.arange(total, dtype=torch.int64) + 1) * 7).to(getattr(torch, dtype))


def _rank(fn, rank, world_size):
    out = []
    for total, dtype in _CASES:
        shard = torch.tensor_split(_full(total, dtype), world_size)[rank].clone()
        got, calls = _call_recording(fn, (shard, total), _CALLS)
        values = returned(got, f"a tensor of {total} elements",
                          lambda v: torch.as_tensor(v).double().reshape(-1).tolist())
        out.append({"got": values, "calls": calls,
                    "dtype": (str(got.dtype).replace("torch.", "")
                              if isinstance(got, torch.Tensor) else type(got).__name__),
                    "shape": list(got.shape) if isinstance(got, torch.Tensor) else None})
    return out


def _judge(results) -> list[str]:
    R = len(results)
    for i, (total, dtype) in enumerate(_CASES):
        want = _full(total).tolist()
        sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), R)]
        case = f"{total} {dtype} elements in shards of {', '.join(map(str, sizes))}"
        for r in range(R):
            got = [int(v) if v == v and abs(v) != float("inf") and v == int(v) else v
                   for v in results[r][i]["got"]]
            if got == want:
                kind, shape = results[r][i]["dtype"], results[r][i]["shape"]
                if kind != dtype or shape != [total]:
                    return [f"{case}: rank {r} returned the right values as {kind} of shape "
                            f"{shape}; the shards are {dtype}, so the whole is a {dtype} tensor "
                            f"of shape [{total}]: make the pad buffer like the shard "
                            "(torch.zeros(n, dtype=shard.dtype), or shard.new_zeros(n))."]
                continue
            msg = (f"{case}: rank {r} got "
                   f"{fmt_list(got, limit=12)}, expected {fmt_list(want, limit=12)}")
            if len(got) != len(want):
                msg += (f" ({len(got)} elements instead of {total}). all_gather needs equal "
                        "sizes: pad every shard to the longest, gather, then trim each piece to "
                        "its rank's size")
            elif sorted(got) == sorted(want):
                msg += (": the right elements in the wrong order; concatenate the pieces in "
                        "rank order")
            return [msg + "."]
    return _judge_method(results)


def _judge_method(results) -> list[str]:
    """The values are right; was it one all-gather, as asked?"""
    R = len(results)
    for i, (total, _) in enumerate(_CASES):
        for r in range(R):
            calls = results[r][i]["calls"]
            counts = Counter(calls)
            gathers = sum(counts[n] for n in _ONE_GATHER)
            others = [n for n in counts if n not in _ONE_GATHER]
            if gathers == 1 and not others:
                continue
            made = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items()) or "none"
            msg = (f"{total} elements over {R} ranks: the values are right, but rank {r} made "
                   f"these calls: {made}. The task asks for one all-gather (dist.all_gather or "
                   "all_gather_into_tensor), one message round in which every rank receives "
                   "every piece")
            if counts["broadcast"] >= 2:
                msg += (f"; {counts['broadcast']} broadcasts are {counts['broadcast']} rounds, "
                        "each waiting for the one before")
            return [msg + "."]
    return []


register(Exercise(
    "08.4", "all_gather uneven flat shards",
    task="Write gather_flat(shard, total_numel) -> Tensor: the ranks hold the pieces of a flat "
         "tensor of total_numel elements split by torch.tensor_split (the first ranks one "
         "element longer); return the whole tensor, of the shard's dtype, on every rank with "
         "one all-gather (dist.all_gather, or all_gather_into_tensor).",
    signature="fn(shard: Tensor (n_r,), total_numel: int) -> Tensor (total_numel,)"
              "   # a collective",
    reference=S.gather_flat, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 and 2 processes (torchrun, gloo), 10, 9, 2, 1 and 17 int64 elements, 10 "
            "float32 and 7 bfloat16; the values, dtype and shape returned; one all-gather "
            "per call"))
