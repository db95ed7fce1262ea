"""Exercise 04.9: the exposed share of communication, read off one rank's profiler trace.

The candidate gets a Chrome trace dict (as :func:`ddp_lesson.labs.ddp_profile.timeline` reads
it) and returns the share of the step during which a ``gloo:all_reduce`` runs while no backward
op does. Hand-built traces, each with a trap a plausible shortcut falls into, then
:data:`DRAWN` drawn from a fixed seed; a verdict names the shortcut an answer matches.
"""
from __future__ import annotations

import random

from ...labs.ddp_profile import ALL_REDUCE, BACKWARD, LAUNCH, exposed_share, merge_spans, timeline
from ..registry import Exercise, register
from ..values import as_number, call_case, close, fmt_num, returned

DRAWN = 6


def _trace(backward, comm, forward=(0, 10)):
    """A trace: backward ops on thread 1 (each with its all-reduce launch), all-reduces on
    gloo threads 2 and 3 in turn, the forward first."""
    ev = [{"ph": "X", "name": "DistributedDataParallel.forward", "ts": forward[0],
           "dur": forward[1] - forward[0], "tid": 1}]
    ev += [{"ph": "X", "name": BACKWARD + "AddmmBackward0", "ts": s, "dur": e - s, "tid": 1}
           for s, e in backward]
    for i, (s, e) in enumerate(comm):
        ev.append({"ph": "X", "name": LAUNCH, "ts": s - 1, "dur": 1, "tid": 1})
        ev.append({"ph": "X", "name": ALL_REDUCE, "ts": s, "dur": e - s, "tid": 2 + i % 2})
    return {"traceEvents": ev}


#: (what it shows, backward intervals, all-reduce intervals): each separates one shortcut.
CASES = [
    ("one bucket, after backward", [(10, 60)], [(60, 90)]),
    ("hidden, then a tail", [(10, 40), (40, 80)], [(30, 70), (80, 100)]),
    ("two buckets in flight at once", [(10, 50)], [(40, 90), (45, 95)]),
    ("a gap inside backward", [(10, 30), (50, 80)], [(25, 45), (80, 85)]),
]


def _drawn(seed: int = 49):
    rng = random.Random(seed)
    out = []
    for k in range(DRAWN):
        t, back, comm = 10.0, [], []
        for _ in range(rng.randint(2, 5)):
            d = rng.uniform(5, 30)
            back.append((t, t + d))
            comm.append((t + d * rng.uniform(0.3, 1.0), t + d + rng.uniform(5, 40)))
            t += d + (rng.uniform(0, 10) if rng.random() < 0.4 else 0)
        out.append((f"drawn {k + 1} of seed {seed}", back, comm))
    return out


def _outside(span, compute) -> float:
    """The length of ``span`` that no interval of ``compute`` covers (``compute`` merged)."""
    s, e = span
    return (e - s) - sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in compute)


def _shortcuts(trace) -> dict[str, float]:
    """What plausible wrong answers return for ``trace``, each with why it is wrong."""
    t = timeline(trace)
    step = t["step"][0][1]
    compute = merge_spans(t["backward"])
    comm = merge_spans(t["all_reduce"])
    total = sum(e - s for s, e in comm)
    exposed = sum(_outside(c, compute) for c in comm)
    return {
        "you counted all of the all-reduce time: backward hid part of it": total / step,
        "you added the exposed time of each all-reduce: two buckets in flight at once "
        "count once": sum(_outside(c, compute) for c in t["all_reduce"]) / step,
        "you used c10d::allreduce_, the launch on backward's thread, not gloo:all_reduce":
            sum(_outside(c, compute) for c in merge_spans(t["launch"])) / step,
        "you counted only the tail after backward: an all-reduce can also be exposed in a "
        "gap between backward's ops":
            max(0.0, max(e for _, e in comm) - max(e for _, e in compute)) / step,
        "you divided by the all-reduce time: the share is of the step's span": exposed / total,
    }


def _run(fn) -> list[str]:
    for name, back, comm in CASES + _drawn():
        trace = _trace(back, comm)
        want = exposed_share(trace)
        raw = call_case(fn, (trace,), f"(trace: {name})")
        got = returned(raw, "a number between 0 and 1 (the exposed share)", as_number)
        if close(got, want, rtol=1e-6, atol=1e-9):
            continue
        msg = f"trace '{name}': you returned {fmt_num(got)}, the exposed share is {fmt_num(want)}"
        for why, value in _shortcuts(trace).items():
            if close(got, value, rtol=1e-6, atol=1e-9):
                return [f"{msg}: {why}."]
        return [msg + "."]
    return []


register(Exercise(
    "04.9", "the exposed share of a DDP step, from its profiler trace",
    task="Write exposed_share(trace) -> float: trace is one rank's Chrome trace as a dict "
         "({'traceEvents': [...]}). Return the time during which some gloo:all_reduce runs "
         "and no 'autograd::engine::evaluate_function: ...' event does, divided by the step's "
         "span (first to last event among those, c10d::allreduce_ and "
         "DistributedDataParallel.forward).",
    signature="fn(trace: dict) -> float",
    reference=exposed_share, run_local=_run,
    checked=f"{len(CASES)} traces built to separate the shortcuts, {DRAWN} drawn from seed 49"))
