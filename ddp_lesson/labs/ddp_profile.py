"""Profile one step of torch's DDP with ``torch.profiler`` on every rank (deep dive 04 · the
profiler trace).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.ddp_profile --out runs/prof

A stack of ``--layers`` square ``Linear`` layers (``--width``), DDP with ``--bucket-cap-mb``,
two warm-up steps, then one profiled step (forward, backward, optimizer step). Each rank writes
its Chrome trace (Perfetto, chrome://tracing) to ``OUT/trace_rank<r>.json`` and prints one
line of facts that do not depend on timing. :func:`timeline` reads a trace's events back,
:func:`exposed_comm` computes the communication that backward did not hide. ``--ddp core``
profiles the series' ``BucketedDDP`` with a ``commsim.Recorder`` and writes its record of the
step to ``OUT/record_rank<r>.json`` for :func:`compare_with_recorder`.
"""
from __future__ import annotations

import argparse
import json
import os

#: Event-name prefixes in a CPU trace of torch 2.13: backward's compute (on the thread that
#: runs backward; ``autograd::engine::evaluate_function: AddmmBackward0``), a bucket's
#: all-reduce as gloo runs it (on gloo's own worker threads; ``gloo:all_reduce``, the
#: ``profilingTitle`` ProcessGroupGloo gives its work), and its launch by DDP's reducer (on
#: the backward thread, ``c10d::allreduce_``: an enqueue, not the transfer).
BACKWARD = "autograd::engine::evaluate_function: "
ALL_REDUCE = "gloo:all_reduce"
LAUNCH = "c10d::allreduce_"


def merge_spans(spans):
    """The union of ``(start, end)`` intervals (any one time unit), sorted; overlapping spans
    become one. Pure; no process group."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(s) for s in out]


def _length(spans) -> float:
    return sum(end - start for start, end in spans)


def timeline(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """The intervals that matter in one rank's Chrome trace, in microseconds from its first event.

    Args:
        trace: the JSON that ``prof.export_chrome_trace`` wrote (``{"traceEvents": [...]}``).

    Returns:
        ``{"backward": [...], "all_reduce": [...], "launch": [...], "step": [(start, end)]}``:
        each a list of ``(start_us, end_us)`` of complete events (``"ph": "X"``) whose name
        starts with :data:`BACKWARD`, is :data:`ALL_REDUCE`, is :data:`LAUNCH`; ``step`` spans
        every event of those kinds and ``DistributedDataParallel.forward``.

    Raises:
        ValueError: the trace has no all-reduce or no backward event (names what it has).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kinds = {"backward": lambda n: n.startswith(BACKWARD), "all_reduce": ALL_REDUCE.__eq__,
             "launch": LAUNCH.__eq__}
    spans = {k: [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if match(e.get("name", ""))] for k, match in kinds.items()}
    if not spans["backward"] or not spans["all_reduce"]:
        names = sorted({e.get("name", "")[:40] for e in events})[:8]
        raise ValueError(f"no {'backward' if not spans['backward'] else 'all-reduce'} events "
                         f"in this trace ({len(events)} events, e.g. {names})")
    forward = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if e.get("name") == "DistributedDataParallel.forward"]
    every = [s for k in spans.values() for s in k] + forward
    t0 = min(s for s, _ in every)
    out = {k: sorted((s - t0, e - t0) for s, e in v) for k, v in spans.items()}
    out["step"] = [(0.0, max(e for _, e in every) - t0)]
    return out


def exposed_comm(trace: dict) -> dict[str, float]:
    """How much of a rank's all-reduce time backward's compute did not hide.

    The all-reduce intervals of every gloo thread are merged first (two buckets in flight at
    once count once); what remains of them outside the merged backward compute is exposed.

    Returns:
        ``{"comm_us": merged all-reduce time, "exposed_us": the part not overlapped by
        backward compute, "step_us": the step's span, "exposed_share": exposed_us / step_us}``.
        Local, no communication.

    Raises:
        ValueError: see :func:`timeline`.
    """
    t = timeline(trace)
    comm, compute = merge_spans(t["all_reduce"]), merge_spans(t["backward"])
    hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in comm for cs, ce in compute)
    exposed = _length(comm) - hidden
    step = t["step"][0][1]
    return {"comm_us": _length(comm), "exposed_us": exposed, "step_us": step,
            "exposed_share": exposed / step}


def exposed_share(trace: dict) -> float:
    """:func:`exposed_comm`'s ``exposed_share``: the exercise 04.9 reference."""
    return exposed_comm(trace)["exposed_share"]


#: How closely (ms) the recorder must match the trace once the trace has explained their
#: difference: what is left is the microseconds between the marks and the recorder's readings.
AGREE_MS = 1.0
#: The marks ``--ddp core`` puts in the trace where the recorder reads its clock at backward's
#: end and when the averages are in ``.grad`` (``record_function``).
MARKS = ("Recorder.backward_end", "Recorder.finish")


def compare_with_recorder(trace: dict, record) -> dict[str, float]:
    """One step's exposed communication read off one rank's trace (:func:`exposed_comm`) and
    as the series' recorder measured it (``commsim.StepRecord.exposed_s``, or its dict), on the
    thread that ran backward: from autograd's end to the averages in ``.grad``.

    Returns:
        ``{"trace_ms", "recorder_ms", "idle_ms": exposed time before backward's end (the trace
        counts it, the recorder not), "late_ms": from the last all-reduce's (or backward's) end
        to the recorder's finish (waking from ``wait()``, copying into ``.grad``: the recorder
        counts it, the trace not),
        "agree": 1.0 if recorder_ms = trace_ms - idle_ms + late_ms within AGREE_MS, else 0.0}``.
        Backward's end and the finish are the :data:`MARKS` if the trace has them, else its
        last compute and ``Optimizer.step`` (or the thread's last event). Local, no
        communication. Raises ValueError as :func:`timeline`.
    """
    from ddp_lesson.commsim import StepRecord

    rec = record if isinstance(record, StepRecord) else StepRecord.from_dict(record)
    t, events = timeline(trace), [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    trace_us = exposed_comm(trace)["exposed_us"]
    end = {n: max(float(e["ts"]) + float(e["dur"]) for e in events if e["name"].startswith(n))
           for n in (BACKWARD, ALL_REDUCE)}
    shift = end[BACKWARD] - max(e for _, e in t["backward"])  # the trace's time of timeline's 0
    tid = next(e["tid"] for e in events if e["name"].startswith(BACKWARD))
    thread = [e for e in events if e["tid"] == tid]  # backward's thread; its next work: step
    marks = {e["name"]: float(e["ts"]) for e in thread if e["name"] in MARKS}
    begin = marks.get(MARKS[0], end[BACKWARD])
    sync = marks.get(MARKS[1], min([float(e["ts"]) for e in thread if e["name"].startswith(
        "Optimizer.step")], default=max(float(e["ts"]) + float(e["dur"]) for e in thread)))
    idle = trace_us - _length([(max(s, begin - shift), e) for s, e in merge_spans(t["all_reduce"])
                               if e > begin - shift])
    late = max(0.0, sync - max(begin, end[ALL_REDUCE]))
    out = {"trace_ms": trace_us / 1e3, "recorder_ms": rec.exposed_s * 1e3,
           "idle_ms": idle / 1e3, "late_ms": late / 1e3}
    gap = out["recorder_ms"] - (out["trace_ms"] - out["idle_ms"] + out["late_ms"])
    return out | {"agree": float(abs(gap) <= AGREE_MS)}


def plot_timeline(trace: dict, ax=None, title: str = ""):
    """Draw one rank's step from its trace: backward's compute on one row, the all-reduces on
    one row per gloo thread, the exposed stretches in red below. Returns the matplotlib axes."""
    import matplotlib.pyplot as plt

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    t = timeline(trace)
    t0 = min(float(e["ts"]) for e in events if e.get("name") == ALL_REDUCE) - t["all_reduce"][0][0]
    threads = sorted({e["tid"] for e in events if e.get("name") == ALL_REDUCE})
    rows = {"backward": [(s / 1e3, (e - s) / 1e3) for s, e in merge_spans(t["backward"])]}
    for i, tid in enumerate(threads):
        rows[f"gloo thread {i + 1}"] = [((float(e["ts"]) - t0) / 1e3, float(e["dur"]) / 1e3)
                                        for e in events
                                        if e.get("name") == ALL_REDUCE and e["tid"] == tid]
    comm, compute = merge_spans(t["all_reduce"]), merge_spans(t["backward"])
    cuts = sorted({x for span in comm + compute for x in span})
    rows["exposed"] = [(a / 1e3, (b - a) / 1e3) for a, b in zip(cuts, cuts[1:])
                       if any(s <= a and b <= e for s, e in comm)
                       and not any(s <= a and b <= e for s, e in compute)]
    if ax is None:
        ax = plt.subplots(figsize=(8, 2.2))[1]
    colours = {"backward": "tab:blue", "exposed": "tab:red"}
    for y, (name, bars) in enumerate(reversed(list(rows.items()))):
        ax.broken_barh(bars, (y - 0.35, 0.7), color=colours.get(name, "tab:orange"),
                       edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_xlabel("ms from the forward's start")
    ax.set_title(title)
    return ax


def main(argv=None) -> None:
    """Profile one DDP step on each rank; write ``OUT/trace_rank<r>.json``. Synchronises."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, record_function

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--ddp", choices=("torch", "core"), default="torch",
                   help="torch's DDP, or the series' BucketedDDP with a Recorder")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    if args.ddp == "core":
        from ddp_lesson.commsim import Recorder
        from ddp_lesson.core.bucketed_ddp import BucketedDDP

        class Marked(Recorder):  # the recorder's two readings, marked in the trace
            def backward_end(self):
                with record_function(MARKS[0]):
                    super().backward_end()

            def finish(self):
                with record_function(MARKS[1]):
                    super().finish()

        ddp = BucketedDDP(model, bucket_cap_mb=args.bucket_cap_mb, recorder=Marked())
    else:
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def step():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    for _ in range(2):  # warm-up: DDP rebuilds its buckets after the first step
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    path = f"{args.out}/trace_rank{rank}.json"
    prof.export_chrome_trace(path)
    if args.ddp == "core":
        with open(f"{args.out}/record_rank{rank}.json", "w") as fh:
            json.dump(ddp.recorder.steps[-1].to_dict(), fh)
    with open(path) as fh:
        t = timeline(json.load(fh))
    backward_end = max(e for _, e in t["backward"])
    inside = sum(s < backward_end for s, _ in t["launch"])
    print(f"rank {rank}: {len(t['all_reduce'])} bucket all-reduces, {inside} launched during "
          "backward")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
