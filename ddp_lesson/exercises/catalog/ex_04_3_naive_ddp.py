"""Exercise 04.3: a naive DDP wrapper against one process on the global batch.

Each rank wraps a differently seeded :class:`~._ddp_shared.TiedNet` (a frozen parameter, a tied
weight, a buffer) and trains 4 SGD steps; the judge names the first value that differs
(:func:`~._ddp_shared.trajectory_problem`), then counts each backward's all-reduces.
"""
from __future__ import annotations

from .. import solutions as S
from ..registry import Exercise, register
from ._ddp_shared import SEED, TiedNet, build, train_rank, trajectory_problem
from ._shared import dist_patched, spy

_PLAN = (1, 1, 1, 1)  # four steps of one micro-batch each


def _rank(cls, rank, world_size):
    model = build(TiedNet, SEED + rank)  # a seed of its own: only a broadcast makes them equal
    calls, per_backward = [], []

    def on_backward(step, micro, synced):
        per_backward.append(len(calls))
        calls.clear()

    with dist_patched({"all_reduce": spy("all_reduce", lambda *a, **k: calls.append(a))}):
        wrapped = cls(model)
        calls.clear()  # what construction all-reduced is not a backward's
        values = train_rank(wrapped, model, TiedNet, _PLAN, rank, world_size, on_backward)
    return {"values": values, "all_reduces": per_backward}


def _count_problem(results) -> str | None:
    n = sum(p.requires_grad for p in TiedNet().parameters())  # gradients: the tied weight once
    for r in sorted(results):
        counts = results[r]["all_reduces"]
        for step, k in enumerate(counts, 1):
            if k <= n:
                continue
            text = (f"step {step}, rank {r}: the weights are right, but this backward made "
                    f"{k} dist.all_reduce calls for {n} gradients (all-reduces per backward: "
                    f"{counts})")
            if len(counts) > 1 and counts == [counts[0] * s for s in range(1, len(counts) + 1)]:
                text += (": one more set each step, as if the hooks were registered again in "
                         "every forward. Register them once, in __init__")
            return text + ". Average each gradient with one all-reduce per backward."
    return None


def _judge(results) -> list[str]:
    problem = trajectory_problem([results[r]["values"] for r in range(len(results))], TiedNet,
                                 _PLAN) or _count_problem(results)
    return [problem] if problem else []


register(Exercise(
    "04.3", "a naive DDP wrapper",
    task="Write class NaiveDDP(torch.nn.Module) with __init__(self, module) and forward(*inputs) "
         "-> module(*inputs): at construction broadcast rank 0's parameters (every one, frozen "
         "ones too) and buffers to every rank; after each backward, average every trainable "
         "parameter's .grad over the ranks with one all-reduce per gradient (divide by the "
         "world size, SUM), so that loss.backward() returns with averaged gradients (the "
         "checker calls nothing else). A tied weight (one Parameter used twice) is one "
         "gradient; a frozen parameter has none.",
    signature="cls(module: nn.Module) -> nn.Module; then out = wrapped(x); "
              "loss(out).backward(); an SGD step on module.parameters(), 4 times",
    reference=S.NaiveDDP, kind="distributed", world_sizes=(2, 3),
    run_rank=_rank, judge=_judge,
    checked="2 and 3 processes (torchrun, gloo), ranks seeded differently, a 4-layer MLP with "
            "a frozen layer, a tied weight and a buffer, 4 SGD steps against one process on "
            "the global batch, every parameter and buffer after construction and after each "
            "step; the all-reduces of each backward"))
