"""Benchmark: the trainer at 1, 2 and 4 processes, weak and strong scaling, step-time breakdown.

    ddp-lesson bench scaling                      # also: python -m ddp_lesson.bench.scaling
    ddp-lesson bench scaling --nprocs 1,2 --repeats 5 --figure none

How much faster does the main job train on R processes, and where does the time go? For each
R the trainer (:class:`ddp_lesson.train.Trainer`) runs a fixed number of steps under torchrun:

* **weak scaling**: fixed per-rank batch (``--batch-size``), the global batch grows with R;
* **strong scaling**: fixed global batch (``--global-batch``), split over R ranks;

efficiency ``= samples_per_s(R) / (R x samples_per_s(1))`` for both. Each step's phases, on
rank 0 (``time.perf_counter``): **data**, **forward** and **backward** (the same micro-batches
through the bare model: compute alone), **exposed comm** (the wrapped step's forward + backward
beyond the bare compute, plus the pixel-count all_reduce), **optimizer**, **other**. Each
configuration runs ``--repeats`` times; the CSV keeps median, min and max samples/s and the
1-minute load average (other programs on the cores are the main noise). One thread per process
by default: R > cores processes share cores.

Writes ``benchmarks/scaling.csv`` and ``.png`` (:func:`ddp_lesson.viz.training.scaling_figure`).
Timings depend on the machine and its load: they are not tests. One rank's run:
``torchrun --standalone --nproc-per-node 2 -m ddp_lesson.bench.scaling worker '{...}'``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

from .common import (
    add_common_flags,
    at_least,
    check_common,
    load_avg,
    main_or_worker,
    parse_counts,
    read_rows,
    spread,
    write_figure,
    write_rows,
)

#: Columns of ``benchmarks/scaling.csv``, in order.
CSV_COLUMNS = ("mode", "nprocs", "batch_per_rank", "global_batch", "steps", "repeats",
               "samples_per_s", "samples_per_s_min", "samples_per_s_max", "spread_pct",
               "efficiency", "efficiency_best", "step_s", "step_s_min", "step_s_max", "data_s",
               "forward_s", "backward_s", "comm_exposed_s", "comm_exposed_s_min",
               "comm_exposed_s_max", "optimizer_s", "other_s", "load_avg_1min")
#: The phases of a step, in the order they happen.
PHASES = ("data", "forward", "backward", "comm_exposed", "optimizer", "other")
_RESULT_TAG = "BENCH_RESULT "
DEFAULT_OUT = "benchmarks/scaling.csv"
MODULE = "ddp_lesson.bench.scaling"


class StepTimer:
    """Wall-clock seconds per phase of a training step: ``with timer.phase("forward"): ...``.
    On CUDA pass ``sync=torch.cuda.synchronize`` so a phase ends when its kernels do. Local."""

    def __init__(self, sync=None):
        self.sync = sync
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.sync:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
            self.counts[name] = self.counts.get(name, 0) + 1

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``ddp-lesson bench scaling``'s flags: the shared ones and the study's."""
    add_common_flags(p, nprocs="1,2,4", repeats=3, out=DEFAULT_OUT, backend=None,
                     timeout_s=600.0)
    p.add_argument("--modes", nargs="+", default=["weak", "strong"], choices=["weak", "strong"],
                   help="weak: fixed batch per rank; strong: fixed global batch (default both)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="weak scaling: samples per rank per step")
    p.add_argument("--global-batch", type=int, default=16,
                   help="strong scaling: samples per step over all ranks (divisible by each R)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--model", default="deeplab", help="the trainer's --model (default deeplab)")
    p.add_argument("--width", type=int, default=16, help="model width (default 16)")
    p.add_argument("--size", type=int, nargs=2, default=[64, 128], metavar=("H", "W"),
                   help="image size in pixels (default 64 128)")
    p.add_argument("--ddp", default="torch", choices=["torch", "naive", "bucketed"],
                   help="the DDP wrapper (default torch)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddp-lesson bench scaling",
                                description=__doc__.split("\n")[0])
    add_arguments(p)
    return p


# --------------------------------------------------------------------------- worker (per rank)

def run_worker(spec: dict) -> dict:
    """Time ``spec["steps"]`` optimizer steps of the trainer on this rank (every rank calls it).

    ``spec`` holds batch_per_rank, steps, warmup, model, width, size, ddp, timeout_s. Returns
    (on every rank) the per-step mean seconds of each phase and the samples per second, from
    this rank's clock. Synchronises at every step (the training collectives) and at the end.
    """
    import tempfile

    import torch
    import torch.distributed as dist

    from .. import env as dist_env
    from ..config import TrainConfig
    from ..train import Trainer, set_threads_from_env

    set_threads_from_env()
    env = dist_env.init_distributed(timeout=spec.get("timeout_s", 300), announce=False)
    steps, warmup, b = spec["steps"], spec["warmup"], spec["batch_per_rank"]
    cfg = TrainConfig(epochs=1, batch_size=b, num_train=(steps + warmup) * b * env.world_size,
                      num_val=1, size=tuple(spec["size"]), model=spec["model"],
                      width=spec["width"], ddp=spec.get("ddp", "torch"),
                      out=tempfile.gettempdir(), no_resume=True)
    trainer = Trainer(cfg, env)
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    timer = StepTimer(sync)
    bare = StepTimer(sync)
    batches = trainer.batches(0)
    load = load_avg()  # other programs on the cores: the timings' main noise
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            if dist.is_initialized():
                dist.barrier()
            timer.reset()
            bare.reset()
            start = time.perf_counter()
        _, group, data_s = next(batches)
        timer.totals["data"] = timer.totals.get("data", 0.0) + data_s
        trainer.step(group, timer)
        # The same micro-batches through the bare model: compute alone, no communication.
        for images, target in group:
            with bare.phase("forward"):
                loss = torch.nn.functional.cross_entropy(trainer.module(images), target,
                                                         ignore_index=255)
            with bare.phase("backward"):
                loss.backward()
        trainer.module.zero_grad(set_to_none=True)
    # Rank 0's clock, minus the bare passes it also ran: the wrapped steps alone.
    elapsed = time.perf_counter() - start - sum(bare.totals.values())
    t = {k: v / steps for k, v in timer.totals.items()}
    c = {k: v / steps for k, v in bare.totals.items()}
    wrapped = t.get("forward", 0.0) + t.get("backward", 0.0)
    compute = c.get("forward", 0.0) + c.get("backward", 0.0)
    step_s = elapsed / steps
    phases = {
        "data": t.get("data", 0.0),
        "forward": c.get("forward", 0.0),
        "backward": c.get("backward", 0.0),
        "comm_exposed": max(0.0, wrapped - compute) + t.get("comm", 0.0),
        "optimizer": t.get("optimizer", 0.0),
    }
    phases["other"] = max(0.0, step_s - sum(phases.values()))
    result = {"nprocs": env.world_size, "batch_per_rank": b, "load_avg_1min": load,
              "global_batch": b * env.world_size, "steps": steps, "step_s": step_s,
              "samples_per_s": b * env.world_size / step_s, "phases": phases,
              "backend": env.backend, "device": trainer.device.type}
    del trainer, batches
    gc.collect()  # free the DDP wrapper before its process group (see ddp_lesson.train.main)
    dist_env.cleanup()
    return result


# --------------------------------------------------------------------------- aggregation

def efficiency(samples_per_s: float, nprocs: int, samples_per_s_one: float) -> float:
    """Scaling efficiency ``samples_per_s / (nprocs x samples_per_s_one)`` (1.0 = ideal): weak
    scaling's throughput ratio and strong scaling's speed-up over R alike.

    Raises:
        ValueError: ``nprocs < 1`` or a non-positive baseline.
    """
    if nprocs < 1 or samples_per_s_one <= 0:
        raise ValueError(f"need nprocs >= 1 and a positive baseline, got nprocs={nprocs}, "
                         f"samples_per_s_one={samples_per_s_one}")
    return samples_per_s / (nprocs * samples_per_s_one)


def aggregate(runs: list[dict]) -> list[dict]:
    """CSV rows from the runs' results (with ``mode``): per (mode, nprocs) the median, min and
    max samples/s, ``spread_pct`` (``(max - min) / median``), median phase seconds, efficiency
    against the 1-process median, ``efficiency_best`` from each side's fastest repeat."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["mode"], r["nprocs"]), []).append(r)
    rows = []
    for (mode, nprocs), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "weak",
                                                                     kv[0][0], kv[0][1])):
        lo, med, hi = spread(r["samples_per_s"] for r in rs)
        step = spread(r["step_s"] for r in rs)
        comm = spread(r["phases"]["comm_exposed"] for r in rs)
        row = {"mode": mode, "nprocs": nprocs, "batch_per_rank": rs[0]["batch_per_rank"],
               "global_batch": rs[0]["global_batch"], "steps": rs[0]["steps"],
               "repeats": len(rs), "samples_per_s": med, "samples_per_s_min": lo,
               "samples_per_s_max": hi,
               "spread_pct": 100.0 * (hi - lo) / med if med > 0 else 0.0,
               "step_s": step[1], "step_s_min": step[0], "step_s_max": step[2],
               "comm_exposed_s_min": comm[0], "comm_exposed_s_max": comm[2],
               "load_avg_1min": statistics.median(r.get("load_avg_1min", float("nan"))
                                                  for r in rs)}
        for phase in PHASES:
            row[f"{phase}_s"] = statistics.median(r["phases"][phase] for r in rs)
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["mode"] == row["mode"] and r["nprocs"] == 1), None)
        row["efficiency"] = (efficiency(row["samples_per_s"], row["nprocs"],
                                        base["samples_per_s"]) if base else float("nan"))
        # the least disturbed runs, what a quiet machine would approach (timeit's rule)
        row["efficiency_best"] = (efficiency(row["samples_per_s_max"], row["nprocs"],
                                             base["samples_per_s_max"]) if base else float("nan"))
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    """Write ``rows`` with :data:`CSV_COLUMNS` (floats to 4 significant digits)."""
    write_rows(rows, path, CSV_COLUMNS, float_digits=4)


def read_csv(path: str) -> list[dict]:
    """Rows of a scaling CSV, numbers converted back (ints and floats)."""
    ints = {"nprocs", "batch_per_rank", "global_batch", "steps", "repeats"}
    return [{k: (v if k == "mode" or v is None else int(v) if k in ints else float(v))
             for k, v in row.items()} for row in read_rows(path, text=("mode",))]


def plan(args) -> list[tuple[str, int, int]]:
    """The (mode, nprocs, batch_per_rank) runs to make; weak R=2 and strong R=2 may coincide."""
    runs = []
    for mode in args.modes:
        for r in parse_counts(args.nprocs):
            if mode == "weak":
                runs.append((mode, r, args.batch_size))
            else:
                if args.global_batch % r:
                    raise SystemExit(f"--global-batch {args.global_batch} is not divisible by "
                                     f"{r} processes")
                runs.append((mode, r, args.global_batch // r))
    return runs


def _measure(args, todo) -> list[dict]:
    """Every planned run ``--repeats`` times (one torchrun job each); weak R=2 (b=8) and strong
    R=2 (16/2) are the same run and are measured once per repeat."""
    from ..launch import run_torchrun

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    runs, cache = [], {}
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for mode, nprocs, b in todo:
            key = (rep, nprocs, b)
            if key not in cache:
                spec = {"batch_per_rank": b, "steps": args.steps, "warmup": args.warmup,
                        "model": args.model, "width": args.width, "size": args.size,
                        "ddp": args.ddp, "timeout_s": args.timeout}
                res = run_torchrun(MODULE, ["worker", json.dumps(spec)], module=True,
                                   nproc_per_node=nprocs, timeout=args.timeout,
                                   backend=args.backend, env=env, live=False)
                line = next(ln for ln in reversed(res.rank_lines(0))
                            if ln.startswith(_RESULT_TAG))
                cache[key] = json.loads(line[len(_RESULT_TAG):])
                print(f"[{time.perf_counter() - t0:6.0f} s] repeat {rep + 1}/{args.repeats} "
                      f"R={nprocs} batch/rank={b}: {cache[key]['samples_per_s']:.1f} samples/s",
                      flush=True)
            runs.append(dict(cache[key], mode=mode))
    return runs


def summary_line(row: dict) -> str:
    """One printed line per CSV row: median samples/s with min and max, efficiency, phases."""
    return (f"{row['mode']:6s} R={row['nprocs']}  global batch {row['global_batch']:3d}  "
            f"{row['samples_per_s']:7.1f} samples/s (min {row['samples_per_s_min']:.1f}, "
            f"max {row['samples_per_s_max']:.1f}, spread {row['spread_pct']:.0f}%)  "
            f"efficiency {row['efficiency']:.2f} (best {row['efficiency_best']:.2f})  "
            f"step {row['step_s'] * 1e3:.0f} ms = "
            + " + ".join(f"{p} {row[p + '_s'] * 1e3:.0f}" for p in PHASES))


def check(args) -> None:
    """Refuse bad flags before any process starts (ValueError naming the flag and value)."""
    check_common(args)
    counts = parse_counts(args.nprocs)
    if 1 not in counts:
        raise ValueError("--nprocs must include 1 (the baseline of the efficiency)")
    at_least(args, batch_size=1, global_batch=1, steps=1, warmup=0, width=1, threads=1)
    if "strong" in args.modes:
        for r in counts:
            if args.global_batch % r:
                raise ValueError(f"--global-batch {args.global_batch} is not divisible by "
                                 f"{r} processes")


def run(args) -> int:
    """``ddp-lesson bench scaling``: the study, its CSV and its figure."""
    if 1 not in parse_counts(args.nprocs):
        raise SystemExit("--nprocs must include 1 (the baseline of the efficiency)")
    rows = aggregate(_measure(args, plan(args)))
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    for row in rows:
        print(summary_line(row))
    from ..viz.training import scaling_figure

    write_figure(scaling_figure, rows, args)
    return 0


def worker(argv: list[str]) -> None:
    """One timed run on this rank (``worker SPEC``, under torchrun); rank 0 prints the result."""
    result = run_worker(json.loads(argv[0]))
    if int(os.environ.get("RANK", "0")) == 0:
        print(_RESULT_TAG + json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_lesson.bench.scaling worker SPEC`` under torchrun, or the study."""
    return main_or_worker(argv, worker, "ddp-lesson bench scaling", __doc__.split("\n")[0],
                          add_arguments, run, check)


if __name__ == "__main__":
    sys.exit(main())
