"""Benchmark: all-reduce bandwidth of gloo, the ring built here, and the raw link.

    ddp-lesson bench allreduce                      # 2 and 4 processes, 64 KiB - 64 MiB
    ddp-lesson bench allreduce --nprocs 2 --sizes-kib 256,4096 --out runs/bench/allreduce.csv
    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.bench.allreduce worker --sizes-kib 1024

One torchrun job per process count; in each, every size is timed for:

* ``gloo``       — ``dist.all_reduce`` (a C++ ring with segmented pipelining);
* ``ring``, ``pipelined``, ``naive`` (only with ``--methods``) — :mod:`ddp_lesson.collectives`'
  ``ring_all_reduce``, ``pipelined_ring_all_reduce``, ``naive_all_reduce``;
* ``nccl``       — ``dist.all_reduce`` on ``cuda:LOCAL_RANK`` tensors, alone in a ``--backend
  nccl`` job (NCCL refuses the others' CPU tensors; ``python tools/gpucheck.py`` uses it);
* ``sendrecv``   — ranks 0 and 1 swap a message of that size at once (``isend`` + ``irecv``),
  the others wait: the link's bandwidth per direction, which bus bandwidth is compared with;
* ``shift``      — every rank sends right while receiving from the left: one ring step without
  the arithmetic (below ``sendrecv`` with more processes than cores: links share the CPUs).

Timing: float32 zeros (no overflow, no denormals), SUM, one warm-up call, then ``--repeats``
rounds, methods interleaved (load hits them alike); each a loop of ``iters`` calls moving
``--budget-mib``, after a barrier, timed on the slowest rank (after ``torch.cuda.synchronize()``
on a GPU). Rows keep min, median (``seconds``) and max per call and of algbw = bytes / time and
busbw = algbw · 2(R-1)/R (nccl-tests doc/PERFORMANCE.md). Figure:
:func:`ddp_lesson.viz.collectives.allreduce_bandwidth_figure`. 4 processes on 2 cores show
compute and communication competing for the CPU, not a network.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from ..env import reduce_device
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

#: Default sweep: 64 KiB .. 64 MiB by factors of 4.
DEFAULT_SIZES_KIB = (64, 256, 1024, 4096, 16384, 65536)
#: Extra small sizes for the send/recv latency fit (α).
LATENCY_SIZES_KIB = (1, 8)
DEFAULT_METHODS = ("gloo", "ring", "pipelined", "sendrecv", "shift")
METHODS = ("gloo", "ring", "pipelined", "naive", "sendrecv", "shift", "nccl")
#: Methods that time a plain message exchange (bandwidth per direction), not an all-reduce.
LINK_METHODS = ("sendrecv", "shift")
DEFAULT_REPEATS = 7
DEFAULT_BUDGET_MIB = 8.0
FIELDS = ("nprocs", "method", "size_bytes", "repeats", "iters",
          "seconds", "seconds_min", "seconds_max",
          "algbw_GBps", "algbw_GBps_min", "algbw_GBps_max",
          "busbw_GBps", "busbw_GBps_min", "busbw_GBps_max", "cpus", "load_avg_1min")
DEFAULT_OUT = "benchmarks/allreduce.csv"
MODULE = "ddp_lesson.bench.allreduce"
_ROW_TAG = "BENCH_ROW "


# ----------------------------------------------------------------------------- worker side


def _iters_for(nbytes: int, budget_bytes: int, lo: int = 1, hi: int = 50) -> int:
    """Calls per timed loop: enough that a loop moves about ``budget_bytes`` (timer resolution)."""
    return max(lo, min(hi, math.ceil(budget_bytes / max(1, nbytes))))


def _timed(fn, iters: int, device=None) -> float:
    """Seconds per call of one loop of ``iters`` calls, as seen by the slowest rank.

    On a CUDA ``device`` the clock is read after ``torch.cuda.synchronize()`` (a CUDA
    collective may return before it ran: torch's docs/source/distributed.rst, "Synchronous and
    asynchronous collective operations"); the time is all-reduced on that device (NCCL refuses
    CPU tensors: "Tensors must be CUDA and dense", ProcessGroupNCCL).
    """
    import torch
    import torch.distributed as dist

    cuda = device is not None and torch.device(device).type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                           device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _exchange_fn(numel: int, rank: int, world_size: int, pattern: str):
    """One message of ``numel`` float32 per direction: ``pair`` (ranks 0 and 1 swap, the others
    wait) or ``shift`` (every rank sends right and receives from the left, all at once)."""
    import torch
    import torch.distributed as dist

    out, into = (torch.zeros(numel, device=reduce_device()) for _ in range(2))
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


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE} worker")
    _add_sweep_flags(p)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    return p


def _add_sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-kib", default=",".join(map(str, DEFAULT_SIZES_KIB)),
                   help="tensor sizes in KiB (default 64 KiB .. 64 MiB)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"any of {', '.join(METHODS)}")
    p.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB,
                   help=f"MiB reduced per timed loop, which sets the iteration count "
                        f"(default {DEFAULT_BUDGET_MIB:g})")
    p.add_argument("--piece-kib", type=int, default=None,
                   help="pipelined ring piece size (default: the package's)")


def _methods(text: str) -> list[str]:
    methods = [m for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    return methods


def check_methods(methods: list[str], backend: str) -> list[str]:
    """``methods`` if the job's ``backend`` can run them all; ValueError naming the misfit:
    ``nccl`` needs an NCCL job, and an NCCL job runs ``nccl`` only (CPU tensors elsewhere)."""
    if backend == "nccl" and set(methods) - {"nccl"}:
        other = ", ".join(m for m in methods if m != "nccl")
        raise ValueError(f"a job on nccl runs the method nccl only, not {other} (CPU tensors)")
    if backend != "nccl" and "nccl" in methods:
        raise ValueError(f"the method nccl needs --backend nccl; this job runs {backend}")
    return methods


def _calls(methods, nbytes, rank, R, piece, device="cpu"):
    """The zero-argument callables to time for one size, each warmed up once."""
    import torch
    import torch.distributed as dist

    from ..collectives import naive_all_reduce, pipelined_ring_all_reduce, ring_all_reduce

    # zeros stay zeros under SUM: no overflow, no denormals
    t = torch.zeros(nbytes // 4, device=device if "nccl" in methods else "cpu")
    reducers = {"gloo": dist.all_reduce, "nccl": dist.all_reduce, "ring": ring_all_reduce,
                "naive": naive_all_reduce,
                "pipelined": lambda x: pipelined_ring_all_reduce(x, **piece)}
    calls = {}
    for m in methods:
        if m in LINK_METHODS:
            calls[m] = _exchange_fn(nbytes // 4, rank, R, "pair" if m == "sendrecv" else "shift")
        else:
            calls[m] = (lambda fn=reducers[m]: fn(t))
        calls[m]()  # warm-up: connections, buffers
    return calls


def summarise(R: int, method: str, nbytes: int, seconds: list[float], iters: int) -> dict:
    """One CSV row from the per-round seconds per call: min/median/max of time and bandwidth."""
    from ..cost_model import bus_factor

    lo, med, hi = spread(seconds)
    factor = 1.0 if method in LINK_METHODS else bus_factor(R)
    row = {"nprocs": R, "method": method, "size_bytes": nbytes, "repeats": len(seconds),
           "iters": iters, "seconds": med, "seconds_min": lo, "seconds_max": hi,
           "cpus": os.cpu_count() or 1, "load_avg_1min": load_avg()}
    for name, s in (("", med), ("_min", hi), ("_max", lo)):  # the slowest round: least bandwidth
        row[f"algbw_GBps{name}"] = nbytes / s / 1e9
        row[f"busbw_GBps{name}"] = nbytes / s * factor / 1e9
    return row


def worker(argv: list[str]) -> None:
    """The torchrun side: time every (method, size); rank 0 prints one JSON line per row."""
    from ..env import cleanup, init_distributed

    opts = _worker_parser().parse_args(argv)
    env = init_distributed(timeout=300, announce=False)
    rank, R = env.rank, env.world_size
    sizes = [int(s) * 1024 for s in opts.sizes_kib.split(",") if s.strip()]
    methods = check_methods(_methods(opts.methods), env.backend)
    if R < 2:
        methods = [m for m in methods if m not in LINK_METHODS]
    piece = {} if opts.piece_kib is None else {"piece_numel": opts.piece_kib * 256}
    link_sizes = ({k * 1024 for k in LATENCY_SIZES_KIB}
                  if any(m in LINK_METHODS for m in methods) else set())
    budget = int(opts.budget_mib * 2**20)
    for nbytes in sorted(set(sizes) | link_sizes):
        here = [m for m in methods if nbytes in sizes or m in LINK_METHODS]
        calls = _calls(here, nbytes, rank, R, piece, env.device)
        iters = _iters_for(nbytes, budget)
        seconds = {m: [] for m in here}
        for _ in range(opts.repeats):  # interleaved: a burst of load hits every method alike
            for m in here:
                seconds[m].append(_timed(calls[m], iters, env.device))
        for m in here:
            if rank == 0:
                print(_ROW_TAG + json.dumps(summarise(R, m, nbytes, seconds[m], iters)),
                      flush=True)
        del calls
    cleanup()


# ----------------------------------------------------------------------------- results


def read_results(path=DEFAULT_OUT) -> list[dict]:
    """Rows of a results CSV, numbers converted (``nprocs``, ``size_bytes`` ... int/float)."""
    return read_rows(path, text=("method",))


def write_results(rows: list[dict], path) -> None:
    """Write rows (dicts with :data:`FIELDS`) as CSV, creating the folder."""
    write_rows(rows, path, FIELDS, float_digits=6)


def parse_rows(lines) -> list[dict]:
    """The rows a worker printed (its ``BENCH_ROW {json}`` lines; other lines are ignored)."""
    return [json.loads(line[len(_ROW_TAG):]) for line in lines if line.startswith(_ROW_TAG)]


_RATIOS = (("pipelined_vs_gloo", "pipelined", "gloo", "algbw_GBps"),
           ("ring_vs_gloo", "ring", "gloo", "algbw_GBps"),
           ("pipelined_vs_ring", "pipelined", "ring", "algbw_GBps"),
           ("busbw_vs_sendrecv", "pipelined", "sendrecv", "busbw_GBps"),
           ("busbw_vs_shift", "pipelined", "shift", "busbw_GBps"),
           ("gloo_busbw_vs_sendrecv", "gloo", "sendrecv", "busbw_GBps"))


def ratios(rows: list[dict], lo_bytes: int = 16 * 2**20, hi_bytes: int = 64 * 2**20) -> dict:
    """Ratios of median bandwidths per process count, over sizes in ``[lo_bytes, hi_bytes]``.

    Returns ``{nprocs: {key: min over sizes of num / den}}`` for :data:`_RATIOS`' keys (e.g.
    ``"pipelined_vs_gloo"``: algbw(pipelined) / algbw(gloo); ``"busbw_vs_sendrecv"``:
    busbw(pipelined) / the sendrecv bandwidth), a key missing when its methods were not
    measured. Whether a ratio beats the noise: :func:`ddp_lesson.bench.claims.compare`.
    """
    out: dict[int, dict] = {}
    by = {(r["nprocs"], r["method"], r["size_bytes"]): r for r in rows}
    for R in sorted({r["nprocs"] for r in rows}):
        sizes = sorted({r["size_bytes"] for r in rows
                        if r["nprocs"] == R and lo_bytes <= r["size_bytes"] <= hi_bytes})
        res = {}
        for key, num, den, col in _RATIOS:
            vals = [by[(R, num, s)][col] / by[(R, den, s)][col] for s in sizes
                    if (R, num, s) in by and (R, den, s) in by and by[(R, den, s)][col] > 0]
            if vals:
                res[key] = min(vals)
        out[R] = res
    return out


# ----------------------------------------------------------------------------- launcher side


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``ddp-lesson bench allreduce``'s flags: the shared ones and the sweep's."""
    add_common_flags(p, nprocs="2,4", repeats=DEFAULT_REPEATS, out=DEFAULT_OUT)
    _add_sweep_flags(p)


def check(opts) -> None:
    """Refuse bad flags before any process starts (ValueError naming the flag and value)."""
    check_common(opts)
    unknown = [m for m in opts.methods.split(",") if m.strip() and m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method {unknown[0]!r}; choose from "
                         f"{', '.join(METHODS)}")
    sizes = [s for s in opts.sizes_kib.split(",") if s.strip()]
    if not sizes or not all(s.strip().isdigit() and int(s) >= 1 for s in sizes):
        raise ValueError(f"--sizes-kib needs whole sizes >= 1 KiB, got {opts.sizes_kib!r}")
    at_least(opts, budget_mib=1e-3, piece_kib=1)


def run(opts) -> int:
    """``ddp-lesson bench allreduce``: the sweep, the CSV, the figure and a summary."""
    from ..env import choose_backend
    from ..launch import run_torchrun

    worker_args = ["worker", "--sizes-kib", opts.sizes_kib, "--methods", opts.methods,
                   "--repeats", str(opts.repeats), "--budget-mib", str(opts.budget_mib)]
    if opts.piece_kib is not None:
        worker_args += ["--piece-kib", str(opts.piece_kib)]
    cpus = os.cpu_count() or 1
    rows = []
    for n in parse_counts(opts.nprocs):
        try:  # before any process starts: the backend this job will get, and its methods
            check_methods(_methods(opts.methods), choose_backend(n, opts.backend)[0])
        except ValueError as exc:
            print(f"ddp-lesson bench allreduce: error: {exc}", file=sys.stderr)
            return 2
        note = " (oversubscribed: more processes than cores)" if n > cpus else ""
        print(f"torchrun --standalone --nproc-per-node {n} -m {MODULE} "
              + " ".join(worker_args) + note, flush=True)
        result = run_torchrun(MODULE, worker_args, module=True, nproc_per_node=n,
                              timeout=opts.timeout, live=False, backend=opts.backend)
        got = parse_rows(result.rank_lines(0))
        for r in got:
            print(f"  R={r['nprocs']} {r['method']:<9} {r['size_bytes'] / 2**10:>8.0f} KiB "
                  f"{r['seconds'] * 1e3:9.3f} ms (min {r['seconds_min'] * 1e3:.3f}, max "
                  f"{r['seconds_max'] * 1e3:.3f})  busbw {r['busbw_GBps']:7.3f} GB/s", flush=True)
        rows += got
    write_results(rows, opts.out)
    print(f"wrote {opts.out}")
    from ..viz.collectives import allreduce_bandwidth_figure

    write_figure(allreduce_bandwidth_figure, rows, opts)
    for R, res in ratios(rows).items():
        parts = [f"{k} {v:.2f}x" for k, v in res.items()]
        if parts:
            print(f"R={R}, 16-64 MiB (min over sizes, medians): " + ", ".join(parts))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_lesson.bench.allreduce worker [...]`` under torchrun, or the benchmark."""
    return main_or_worker(argv, worker, "ddp-lesson bench allreduce",
                          __doc__.split("\n\n")[1], add_arguments, run, check)


if __name__ == "__main__":
    sys.exit(main())
