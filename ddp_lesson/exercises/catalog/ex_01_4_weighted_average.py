"""Exercise 01.4: the gradient average weighted by unequal shard sizes, at 3 and 2 processes,
against :func:`ddp_lesson.gradients.weighted_average`; the usual wrong answers (the plain mean,
the sum, a constant total) are named when the values show one."""
from __future__ import annotations

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import close, fmt_list, ranks_text, returned

#: Shard sizes per rank (at 2 processes, the first two of each). At 3 processes the first
#: three total 8, so a constant 8 could stand in for the total count; the last two total 11 and
#: 13.
_COUNTS = ([4, 2, 2], [5, 2, 1], [1, 1, 6], [3, 6, 2], [7, 5, 1])


def _grad(rank: int) -> torch.Tensor:
    return torch.tensor([rank + 1.0, -0.5 * (rank + 1), rank * rank + 0.25])


def _rank(fn, rank, world_size):
    out = []
    for counts in _COUNTS:
        got = fn(_grad(rank), counts[rank])
        values = returned(got, "a tensor of 3 numbers",
                          lambda v: [float(x) for x in torch.as_tensor(v).reshape(-1)])
        kind = (list(got.shape), str(got.dtype).replace("torch.", "")) \
            if isinstance(got, torch.Tensor) else (None, type(got).__name__)
        out.append({"values": values, "shape": kind[0], "type": kind[1]})
    return out


def _judge(results) -> list[str]:
    from ...gradients import average, weighted_average

    R = len(results)
    grads = [_grad(r) for r in range(R)]
    totals = [sum(c[:R]) for c in _COUNTS]
    for i, counts in enumerate(_COUNTS):
        counts = counts[:R]
        want = weighted_average(grads, counts).tolist()
        for r in range(R):
            got = results[r][i]["values"]
            if close(got, want):
                shape, kind = results[r][i]["shape"], results[r][i]["type"]
                if shape != [3] or kind != "float32":
                    return [f"with shards of {', '.join(map(str, counts))} samples, rank {r} "
                            f"returned the right values as {kind} of shape {shape}; the "
                            "gradient is a float32 tensor of shape [3]: return it shaped and "
                            "typed like grad."]
                continue
            shards = ", ".join(map(str, counts))
            msg = (f"with shards of {shards} samples, rank {r} returned {fmt_list(got)}; the "
                   f"global-batch gradient is {fmt_list(want)}")
            if close(got, average(grads).tolist()):
                msg += (f": yours is the plain mean of the {R} gradients, right only for equal "
                        "shards. Weight each rank's gradient by its count: sum n_r * g_r and "
                        "n_r over the ranks (two all-reduces, or one), then divide")
            elif close(got, sum(grads).tolist()):
                msg += ": yours is the plain sum. Weight by the counts and divide by their total"
            elif close(got, sum(g * n for g, n in zip(grads, counts)).tolist()):
                msg += f": yours is sum n_r * g_r; divide it by the total count {sum(counts)}"
            elif close(got, grads[r].tolist()):
                msg += ": yours is this rank's own gradient; nothing was all-reduced"
            else:
                k = next((t for t in totals if t != sum(counts) and close(
                    got, (weighted_average(grads, counts) * sum(counts) / t).tolist())), None)
                if k is not None:
                    msg += (f": yours divides by {k}, the total of another case; here it is "
                            f"{sum(counts)}. All-reduce the counts too")
            others = [s for s in range(R) if s != r
                      and not close(results[s][i]["values"], got)]
            if others:
                msg += f". Ranks {ranks_text([r] + others)} also disagree with each other"
            return [msg + "."]
    return []


register(Exercise(
    "01.4", "weighted gradient average over unequal shards",
    task="Write weighted_average_gradient(grad, count) -> Tensor, called on every rank with "
         "its mean-loss gradient and its shard's sample count; return sum_r n_r g_r / sum_r n_r "
         "(the same on every rank) using all_reduce.",
    signature="fn(grad: Tensor (3,), count: int) -> Tensor (3,)   # a collective",
    reference=S.weighted_average_gradient, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 and 2 processes (torchrun, gloo), shards 4/2/2, 5/2/1, 1/1/6, 3/6/2 and 7/5/1 "
            "(at 2, the first two of each); the value, shape and dtype returned"))
