"""Persistent ranks against one-shot torchrun cells: start, round trip and CPU seconds.

    python -m ddp_lesson.bench.cluster [--repeats 30] [--starts 3] [--out benchmarks/cluster.csv]

Times :class:`ddp_lesson.cluster.Cluster` (2 gloo ranks) and a one-shot ``run_torchrun``, its
agent forked from the fork server and started fresh (``DDP_LESSON_FORKSERVER=0``);
writes min/median/max per row through the one CSV writer (:func:`ddp_lesson.bench.common.
write_rows`). Not a test: timings on a shared machine vary; the load average is recorded.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

from ..cluster import Cluster
from ..launch import run_torchrun
from ..launch.forkserver import agents_cpu_s
from .common import write_rows


def _cpu_s() -> float:
    """CPU seconds of this process and all its (waited-for) children, user + system, and of
    the torchrun agents forked for it (:mod:`ddp_lesson.launch.forkserver`), with their ranks."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN))
               ) + agents_cpu_s()


def _row(what, samples, cpu_samples=()) -> dict:
    return {"what": what, "repeats": len(samples), "median_s": statistics.median(samples),
            "min_s": min(samples), "max_s": max(samples),
            "cpu_s": statistics.median(cpu_samples) if cpu_samples else "",
            "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2)}


def _cluster_samples(repeats: int, starts: int):
    """Start/stop ``starts`` clusters; the first one also times ``repeats`` round trips."""
    start_s, start_cpu, trip_s, phases = [], [], [], {}
    for _ in range(starts):
        c0, t0 = _cpu_s(), time.perf_counter()
        c = Cluster(nproc_per_node=2, backend="gloo").start()
        start_s.append(time.perf_counter() - t0)
        for k, v in c.timings.items():
            phases.setdefault(k, []).append(v)
        try:
            if not trip_s:
                c.run("x = torch.ones(1)\ndist.all_reduce(x)")  # warm-up
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    c.run("print(rank)")
                    trip_s.append(time.perf_counter() - t0)
        finally:
            c.stop()
        if len(start_s) > 1:  # the first cycle also ran the round trips
            start_cpu.append(_cpu_s() - c0)
    return start_s, start_cpu, trip_s, phases


def bench(repeats: int = 30, starts: int = 3, out="benchmarks/cluster.csv") -> list[dict]:
    """Cluster start at 2 ranks (and its phases), a trivial ``%%ranks`` round trip, and a
    one-shot torchrun cell. ``cpu_s``: the median CPU time of every process involved, which the
    load does not inflate as it does wall time (a start row: a start and its stop)."""
    start_s, start_cpu, trip_s, phases = _cluster_samples(repeats, starts)
    rows = [_row("cluster_start_2_ranks", start_s, start_cpu)]
    rows += [_row(f"start_phase_{k}", v) for k, v in phases.items()]
    rows += [_row("ranks_cell_round_trip", trip_s)]
    # the first launch started the fork server (the cluster's own agent is not forked): this
    # one makes sure, and is not timed
    run_torchrun(code="print(1)\n", nproc_per_node=2, backend="gloo", live=False, timeout=120)
    for what, switch in (("torchrun_cell_one_shot", "1"),
                         ("torchrun_cell_one_shot_fresh_agent", "0")):
        oneshot_s, oneshot_cpu = [], []
        for _ in range(starts):
            c0, t0 = _cpu_s(), time.perf_counter()
            run_torchrun(code="print(1)\n", nproc_per_node=2, backend="gloo", live=False,
                         timeout=120, env=dict(os.environ, DDP_LESSON_FORKSERVER=switch))
            oneshot_s.append(time.perf_counter() - t0)
            oneshot_cpu.append(_cpu_s() - c0)
        rows.append(_row(what, oneshot_s, oneshot_cpu))
    write_rows(rows, out, list(rows[0]), float_digits=4)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddp_lesson.bench.cluster", description=__doc__)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--out", default="benchmarks/cluster.csv")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for r in bench(args.repeats, args.starts, args.out):
        cpu = f", cpu {r['cpu_s']:.1f} s" if r["cpu_s"] != "" else ""
        print(f"{r['what']}: median {r['median_s'] * 1e3:.1f} ms, min {r['min_s'] * 1e3:.1f} ms, "
              f"max {r['max_s'] * 1e3:.1f} ms over {r['repeats']}{cpu} "
              f"(load {r['load_avg_1min']:.1f})")


if __name__ == "__main__":
    main()
