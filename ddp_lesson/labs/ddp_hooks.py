"""Notebook 04's cell-by-cell look at the wrappers' hooks, on ranks kept up by ``%dist_start``.

Run from ``%%ranks`` cells (persistent ranks, :mod:`ddp_lesson.cluster`); on its own::

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.ddp_hooks

A :class:`~ddp_lesson.commsim.Recorder` attached to a wrapper notes, for one synchronised backward,
when each gradient's hook fired, when each all-reduce was issued and when autograd finished;
:func:`hook_trace` puts those events in the order they happened, without their times, so the
printed lines are the same on every machine.
"""
from __future__ import annotations

import torch
from torch import nn

from ddp_lesson.commsim import StepRecord

__all__ = ["hook_trace", "small_mlp"]


def small_mlp(seed: int) -> nn.Sequential:
    """``Linear(4, 8) -> ReLU -> Linear(8, 8) -> ReLU -> Linear(8, 1)``, initialised from ``seed``.

    Six parameter tensors of 128, 32, 256, 32, 32 and 4 bytes (float32); ``(B, 4) -> (B, 1)``.
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def hook_trace(record: StepRecord) -> list[str]:
    """One line per event of ``record``, in the order they happened on this rank.

    Events: ``ready <name>`` (the parameter's post-accumulate-grad hook fired), ``backward
    done`` (autograd's final callback started) and ``all_reduce <index>: <names>`` (an
    all-reduce issued: a bucket for BucketedDDP, one parameter for NaiveDDP). Ties in time
    (a clock's resolution) keep the order in which the wrapper records them: a gradient's hook,
    then the bucket it completes, then the end of backward, then what is issued after it.
    """
    end = record.backward_end_s
    events = [(t, 0, f"ready {name}") for name, t in record.grad_ready_s.items()]
    events.append((end, 2, "backward done"))
    for e in record.comm:
        events.append((e.issued_s, 1 if e.issued_s <= end else 3,
                       f"all_reduce {e.index}: {', '.join(e.params)}"))
    return [text for _, _, text in sorted(events, key=lambda ev: (ev[0], ev[1]))]


def main() -> None:
    from ddp_lesson.commsim import Recorder
    from ddp_lesson.core.naive_ddp import NaiveDDP
    from ddp_lesson.env import cleanup, init_distributed

    env = init_distributed()
    rec = Recorder()
    model = NaiveDDP(small_mlp(seed=env.rank).to(env.device), recorder=rec)
    x = torch.full((2, 4), float(env.rank + 1), device=env.device)
    model(x).sum().backward()
    if env.rank == 0:
        print("\n".join(hook_trace(rec.steps[-1])))
    cleanup()


if __name__ == "__main__":
    main()
