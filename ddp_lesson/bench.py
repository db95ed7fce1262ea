"""Benchmarks: all-reduce bandwidth of gloo, the ring built here, and the raw link.

    ddp-lesson bench allreduce                      # 2 and 4 processes, 64 KiB - 64 MiB
    ddp-lesson bench allreduce --nprocs 2 --sizes-kib 256,4096 --out runs/bench/allreduce.csv
    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.bench worker --sizes-kib 1024
    ddp-lesson bench ddp                            # DDP wrappers: ddp_lesson.bench_ddp
    ddp-lesson bench scaling                        # the trainer at 1/2/4 processes: ddp_lesson.bench_scaling

``ddp-lesson bench allreduce`` launches one torchrun job per process count. In each job every
size is timed for:

* ``gloo``       — ``dist.all_reduce`` (the library: a C++ ring with segmented pipelining);
* ``ring``       — :func:`ddp_lesson.collectives.ring_all_reduce` (whole chunks per step);
* ``pipelined``  — :func:`ddp_lesson.collectives.pipelined_ring_all_reduce`;
* ``naive``      — :func:`ddp_lesson.collectives.naive_all_reduce` (only with ``--methods``);
* ``sendrecv``   — ranks 0 and 1 exchange a message of that size in both directions at once
  (``isend`` + ``irecv``); the other ranks wait. Its bandwidth (bytes per direction per
  second) is the link's limit that bus bandwidth is compared with;
* ``shift``      — every rank sends that size to its right neighbour while receiving from its
  left one, all at once: one ring step's traffic without the arithmetic. With more
  processes than cores it is lower than ``sendrecv``, because all links share the CPUs.

Timing: float32 tensors of zeros (no overflow, no denormals), SUM, one warm-up call, then
``repeats`` rounds; in each round every method runs one timed loop of ``iters`` calls
(enough calls to move ``budget`` bytes), started after a barrier and timed on the slowest
rank. Methods are interleaved so load from other programs hits them alike, and the best
round is kept (noise on a shared machine only ever adds time). algbw = bytes / time, busbw = algbw ·
2(R-1)/R (nccl-tests doc/PERFORMANCE.md). Results go to a CSV (one row per job, method,
size) and a figure (:func:`ddp_lesson.viz.allreduce_bandwidth_figure`).

On a 2-core machine 4 processes are oversubscribed (two processes per core): that run shows
what the algorithms do when compute and communication compete for the CPU, not a network.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

#: Default sweep: 64 KiB .. 64 MiB by factors of 4.
DEFAULT_SIZES_KIB = (64, 256, 1024, 4096, 16384, 65536)
#: Extra small sizes for the send/recv latency fit (α).
LATENCY_SIZES_KIB = (1, 8)
DEFAULT_METHODS = ("gloo", "ring", "pipelined", "sendrecv", "shift")
METHODS = ("gloo", "ring", "pipelined", "naive", "sendrecv", "shift")
#: Methods that time a plain message exchange (bandwidth per direction), not an all-reduce.
LINK_METHODS = ("sendrecv", "shift")
DEFAULT_REPEATS = 15
DEFAULT_BUDGET_MIB = 8.0
FIELDS = ("nprocs", "method", "size_bytes", "seconds", "algbw_GBps", "busbw_GBps", "iters", "cpus")
DEFAULT_OUT = "benchmarks/allreduce.csv"


# ----------------------------------------------------------------------------- worker side


def _iters_for(nbytes: int, budget_bytes: int, lo: int = 1, hi: int = 50) -> int:
    """Calls per timed loop: enough that a loop moves about ``budget_bytes`` (timer resolution)."""
    return max(lo, min(hi, math.ceil(budget_bytes / max(1, nbytes))))


def _timed(fn, iters: int) -> float:
    """Seconds per call of one loop of ``iters`` calls, as seen by the slowest rank."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _exchange_fn(numel: int, rank: int, world_size: int, pattern: str):
    """One message of ``numel`` float32 per direction: ``pair`` (ranks 0 and 1 swap, the others
    wait) or ``shift`` (every rank sends right and receives from the left, all at once)."""
    import torch
    import torch.distributed as dist

    out, into = torch.zeros(numel), torch.zeros(numel)
    if pattern == "pair":
        src = dst = (1 - rank) if rank < 2 else None
    else:
        src, dst = (rank - 1) % world_size, (rank + 1) % world_size

    def exchange():
        if src is None:
            return
        reqs = [dist.irecv(into, src=src), dist.isend(out, dst=dst)]
        for req in reqs:
            req.wait()
    return exchange


def worker(argv: list[str]) -> None:
    """The torchrun side: time every (method, size) and print rows on rank 0 (``ROW,...``).

    Methods are interleaved within each repeat, so a burst of load from other programs hits
    them all alike; the best repeat of each is kept.
    """
    import torch
    import torch.distributed as dist

    from .collectives import (bus_factor, naive_all_reduce, pipelined_ring_all_reduce,
                              ring_all_reduce)
    from .env import cleanup, init_distributed

    p = argparse.ArgumentParser(prog="python -m ddp_lesson.bench worker")
    p.add_argument("--sizes-kib", default=",".join(map(str, DEFAULT_SIZES_KIB)))
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    p.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB,
                   help="bytes reduced per timed loop, which sets the iteration count")
    p.add_argument("--piece-kib", type=int, default=None,
                   help="pipelined ring piece size (default: the package's)")
    opts = p.parse_args(argv)
    env = init_distributed(timeout=300, announce=False)
    rank, R = env.rank, env.world_size
    sizes = [int(s) * 1024 for s in opts.sizes_kib.split(",") if s.strip()]
    methods = [m for m in opts.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if R < 2:
        methods = [m for m in methods if m not in LINK_METHODS]
    piece = {} if opts.piece_kib is None else {"piece_numel": opts.piece_kib * 256}
    reducers = {
        "gloo": lambda t: dist.all_reduce(t),
        "ring": lambda t: ring_all_reduce(t),
        "pipelined": lambda t: pipelined_ring_all_reduce(t, **piece),
        "naive": lambda t: naive_all_reduce(t),
    }
    link_sizes = {k * 1024 for k in LATENCY_SIZES_KIB} if any(m in LINK_METHODS for m in methods) else set()
    budget = int(opts.budget_mib * 2**20)
    cpus = os.cpu_count() or 1
    for nbytes in sorted(set(sizes) | link_sizes):
        here = [m for m in methods if nbytes in sizes or m in LINK_METHODS]
        numel = nbytes // 4
        t = torch.zeros(numel)  # zeros stay zeros under SUM: no overflow, no denormals
        calls = {}
        for m in here:
            if m in LINK_METHODS:
                calls[m] = _exchange_fn(numel, rank, R, "pair" if m == "sendrecv" else "shift")
            else:
                calls[m] = (lambda fn=reducers[m]: fn(t))
            calls[m]()  # warm-up: connections, buffers
        iters = _iters_for(nbytes, budget)
        best = {m: math.inf for m in here}
        for _ in range(opts.repeats):
            for m in here:
                best[m] = min(best[m], _timed(calls[m], iters))
        for m in here:
            alg = nbytes / best[m]
            bus = alg if m in LINK_METHODS else alg * bus_factor(R)
            if rank == 0:
                print("ROW," + ",".join(str(v) for v in (
                    R, m, nbytes, f"{best[m]:.6e}", f"{alg / 1e9:.6g}", f"{bus / 1e9:.6g}",
                    iters, cpus)), flush=True)
        del calls, t
    cleanup()


# ----------------------------------------------------------------------------- results


def read_results(path=DEFAULT_OUT) -> list[dict]:
    """Rows of a results CSV with numbers converted (``nprocs``, ``size_bytes`` ... as int/float)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append({
                "nprocs": int(row["nprocs"]), "method": row["method"],
                "size_bytes": int(row["size_bytes"]), "seconds": float(row["seconds"]),
                "algbw_GBps": float(row["algbw_GBps"]), "busbw_GBps": float(row["busbw_GBps"]),
                "iters": int(row["iters"]), "cpus": int(row["cpus"]),
            })
    return rows


def write_rows(rows: list[dict], path, fields, float_digits: int | None = None) -> None:
    """Write ``rows`` as CSV with the columns ``fields``, creating the folder.

    The benchmarks' one CSV writer. ``float_digits``: round floats to that many significant
    digits (None: write them as they are).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{row[k]:.{float_digits}g}"
                            if float_digits is not None and isinstance(row[k], float) else row[k])
                        for k in fields})


def write_results(rows: list[dict], path) -> None:
    """Write rows (dicts with :data:`FIELDS`) as CSV, creating the folder."""
    write_rows(rows, path, FIELDS)


def _parse_rows(lines) -> list[dict]:
    rows = []
    for line in lines:
        if not line.startswith("ROW,"):
            continue
        v = line[4:].split(",")
        rows.append({"nprocs": int(v[0]), "method": v[1], "size_bytes": int(v[2]),
                     "seconds": float(v[3]), "algbw_GBps": float(v[4]),
                     "busbw_GBps": float(v[5]), "iters": int(v[6]), "cpus": int(v[7])})
    return rows


def ratios(rows: list[dict], lo_bytes: int = 16 * 2**20, hi_bytes: int = 64 * 2**20) -> dict:
    """The benchmark's headline ratios per process count, over sizes in ``[lo_bytes, hi_bytes]``.

    Returns ``{nprocs: {"pipelined_vs_gloo": min over sizes of algbw(pipelined)/algbw(gloo),
    "ring_vs_gloo", "pipelined_vs_ring": likewise, "busbw_vs_sendrecv": min of busbw(pipelined)
    / sendrecv bandwidth at the same size, "busbw_vs_shift": the same against the all-ranks
    shift, "gloo_busbw_vs_sendrecv": gloo's busbw / sendrecv}}``; a key is missing when its
    methods were not measured.
    """
    out: dict[int, dict] = {}
    by = {(r["nprocs"], r["method"], r["size_bytes"]): r for r in rows}
    for R in sorted({r["nprocs"] for r in rows}):
        sizes = sorted({r["size_bytes"] for r in rows if r["nprocs"] == R and lo_bytes <= r["size_bytes"] <= hi_bytes})
        res = {}
        for key, num, den, col_n, col_d in (
                ("pipelined_vs_gloo", "pipelined", "gloo", "algbw_GBps", "algbw_GBps"),
                ("ring_vs_gloo", "ring", "gloo", "algbw_GBps", "algbw_GBps"),
                ("pipelined_vs_ring", "pipelined", "ring", "algbw_GBps", "algbw_GBps"),
                ("busbw_vs_sendrecv", "pipelined", "sendrecv", "busbw_GBps", "busbw_GBps"),
                ("busbw_vs_shift", "pipelined", "shift", "busbw_GBps", "busbw_GBps"),
                ("gloo_busbw_vs_sendrecv", "gloo", "sendrecv", "busbw_GBps", "busbw_GBps")):
            vals = [by[(R, num, s)][col_n] / by[(R, den, s)][col_d] for s in sizes
                    if (R, num, s) in by and (R, den, s) in by and by[(R, den, s)][col_d] > 0]
            if vals:
                res[key] = min(vals)
        out[R] = res
    return out


def run_allreduce(argv: list[str]) -> int:
    """``ddp-lesson bench allreduce``: the sweep, the CSV, the figure and a summary."""
    from .launch import run_torchrun

    p = argparse.ArgumentParser(prog="ddp-lesson bench allreduce",
                                description="All-reduce bandwidth: gloo vs the ring built from send/recv.")
    p.add_argument("--nprocs", default="2,4", help="comma-separated process counts (default 2,4)")
    p.add_argument("--sizes-kib", default=",".join(map(str, DEFAULT_SIZES_KIB)),
                   help="tensor sizes in KiB (default 64 KiB .. 64 MiB)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"any of {', '.join(METHODS)}")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timed loops per point; the best is kept (default {DEFAULT_REPEATS})")
    p.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB,
                   help=f"MiB reduced per timed loop (default {DEFAULT_BUDGET_MIB:g})")
    p.add_argument("--piece-kib", type=int, default=None, help="pipelined ring piece size")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV to write (default {DEFAULT_OUT})")
    p.add_argument("--figure", default=None,
                   help="PNG to write (default: the CSV's name with .png; 'none' to skip)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    opts = p.parse_args(argv)
    nprocs = [int(n) for n in opts.nprocs.split(",") if n.strip()]
    worker_args = ["worker", "--sizes-kib", opts.sizes_kib, "--methods", opts.methods,
                   "--repeats", str(opts.repeats), "--budget-mib", str(opts.budget_mib)]
    if opts.piece_kib is not None:
        worker_args += ["--piece-kib", str(opts.piece_kib)]
    cpus = os.cpu_count() or 1
    rows = []
    for n in nprocs:
        note = " (oversubscribed: more processes than cores)" if n > cpus else ""
        print(f"torchrun --standalone --nproc-per-node {n} -m ddp_lesson.bench "
              + " ".join(worker_args) + note, flush=True)
        result = run_torchrun("ddp_lesson.bench", worker_args, module=True, nproc_per_node=n,
                              timeout=opts.timeout, live=False, backend="gloo")
        got = _parse_rows(result.rank_lines(0))
        for r in got:
            print(f"  R={r['nprocs']} {r['method']:<9} {r['size_bytes'] / 2**10:>8.0f} KiB "
                  f"{r['seconds'] * 1e3:9.3f} ms  algbw {r['algbw_GBps']:7.3f} GB/s  "
                  f"busbw {r['busbw_GBps']:7.3f} GB/s", flush=True)
        rows += got
    write_results(rows, opts.out)
    print(f"wrote {opts.out}")
    fig_path = opts.figure or str(Path(opts.out).with_suffix(".png"))
    if fig_path.lower() != "none":
        import matplotlib

        matplotlib.use("Agg")
        from .viz import allreduce_bandwidth_figure

        fig = allreduce_bandwidth_figure(rows)
        fig.savefig(fig_path, dpi=80)
        print(f"wrote {fig_path}")
    for R, res in ratios(rows).items():
        parts = [f"{k} {v:.2f}x" for k, v in res.items()]
        if parts:
            print(f"R={R}, 16-64 MiB (min over sizes): " + ", ".join(parts))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``ddp-lesson bench allreduce [...]`` (and ``worker`` under torchrun)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "allreduce":
        return run_allreduce(rest)
    if cmd == "ddp":
        from .bench_ddp import main as ddp_main

        return ddp_main(rest)
    if cmd == "scaling":
        from .bench_scaling import main as scaling_main

        return scaling_main(rest)
    if cmd == "worker":
        worker(rest)
        return 0
    print(f"unknown benchmark {cmd!r}; available: allreduce, ddp, scaling", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
