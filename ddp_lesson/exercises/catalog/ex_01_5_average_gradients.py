"""Exercise 01.5: average every parameter's gradient over the ranks after backward, at 2 and
3 processes on the toy MLP, against one process on the whole batch."""
from __future__ import annotations

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import close, divided_by, fmt_list


def _toy(world_size):
    from ...gradients import make_toy_batch, make_toy_model

    x, y = make_toy_batch(4 * world_size)  # 4 samples per rank at every world size
    return make_toy_model(0), x, y


def _rank(fn, rank, world_size):
    from ...gradients import split_batch

    model, x, y = _toy(world_size)
    xs, ys = split_batch(x, y, world_size)[rank]
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    fn(model)
    return {n: (None if p.grad is None else p.grad.reshape(-1).tolist())
            for n, p in model.named_parameters()}


def _by_name(model, flat) -> dict[str, list[float]]:
    sizes = [p.numel() for p in model.parameters()]
    return {n: g.tolist() for (n, _), g in zip(model.named_parameters(), flat.split(sizes))}


def _judge(results) -> list[str]:
    from ...gradients import batch_gradient, shard_gradients

    R = len(results)
    model, x, y = _toy(R)
    want = _by_name(model, batch_gradient(model, x, y))
    local = [_by_name(model, g) for g in shard_gradients(model, x, y, R)]
    for r in range(R):
        for name, w in want.items():
            got = results[r][name]
            if got is None:
                return [f"rank {r}: {name}.grad is None after your function; keep the gradients"]
            if close(got, w):
                continue
            msg = (f"rank {r}: {name}.grad is {fmt_list(got)}, the global-batch gradient is "
                   f"{fmt_list(w)}")
            if close(got, [R * v for v in w]):
                msg += (f": {R}x too big. all_reduce gives the SUM over the ranks; divide by "
                        f"world_size ({R})")
            elif (k := divided_by(got, w, R)) is not None:
                msg += (f": the sum over the {R} ranks divided by {k}. Divide by "
                        "dist.get_world_size(), not a constant: the checker runs at more than "
                        "one world size")
            elif close(got, local[r][name]):
                bad = [n for n in want if close(results[r][n], local[r][n])]
                msg += (f": still this rank's own gradient. Not averaged here: {', '.join(bad)}; "
                        "every parameter's gradient must be all-reduced, on every rank")
            return [msg + "."]
    return []


register(Exercise(
    "01.5", "average the gradients after backward",
    task="Write average_gradients(model) -> None: after loss.backward() on each rank's shard, "
         "replace every parameter's .grad by its mean over the ranks (in place), so that every "
         "rank holds the global-batch gradient, as DDP does.",
    signature="fn(model: nn.Module) -> None   # a collective",
    reference=S.average_gradients, kind="distributed", world_sizes=(2, 3),
    run_rank=_rank, judge=_judge,
    checked="2 and 3 processes (torchrun, gloo), the 19-parameter toy MLP, 4 samples per rank, "
            "against one process on all 8 (12)"))
