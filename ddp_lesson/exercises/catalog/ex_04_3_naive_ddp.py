"""Exercise 04.3: a naive DDP wrapper, checked against one process on the global batch.

Each rank wraps a model built from a seed of its own (only a broadcast at construction makes
the copies equal) that has a frozen parameter and a tied weight, trains it four SGD steps on
its shard of each global batch, and records every parameter after construction and after each
step; the judge replays one process on the global batch and names the step, the rank, the
parameter and the first value that differs.
"""
from __future__ import annotations

from .. import solutions as S
from ..registry import Exercise, register
from ._ddp_shared import SEED, TiedNet, build, train_rank, trajectory_problem

_PLAN = (1, 1, 1, 1)  # four steps of one micro-batch each


def _rank(cls, rank, world_size):
    model = build(TiedNet, SEED + rank)  # a seed of its own: only a broadcast makes them equal
    wrapped = cls(model)
    return train_rank(wrapped, model, TiedNet, _PLAN, rank, world_size)


def _judge(results) -> list[str]:
    problem = trajectory_problem([results[r] for r in range(len(results))], TiedNet, _PLAN)
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
    reference=S.NaiveDDP, kind="distributed", world_size=2,
    run_rank=_rank, judge=_judge,
    checked="2 processes (torchrun, gloo), ranks seeded differently, a 4-layer MLP with a "
            "frozen layer and a tied weight, 4 SGD steps against one process on the global "
            "batch, every parameter after construction and after each step"))
