"""Benchmark: training steps/s of torch's DDP, NaiveDDP and BucketedDDP, and exposed communication.

    ddp-lesson bench ddp                           # 2 processes, gloo
    ddp-lesson bench ddp --repeats 9 --steps 8 --out runs/bench/ddp.csv --figure none
    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.bench.ddp worker --repeats 3

One torchrun job per process count (2 by default, gloo unless told otherwise) trains the
DeepLab-style model (``ddp_lesson.models.build_model("deeplab", width=W)``) on the same fixed
batch with every variant, from the same seed:

* without a link: ``torch`` (``DistributedDataParallel`` with its defaults), ``naive``
  (:class:`~ddp_lesson.core.naive_ddp.NaiveDDP`), ``bucketed``
  (:class:`~ddp_lesson.core.bucketed_ddp.BucketedDDP`, torch's default buckets unless
  ``--bucket-cap-mb``: a 1 MiB first bucket, then 25 MiB; the stored ``benchmarks/ddp.csv`` was
  measured with ``--bucket-cap-mb 25``, one bucket, as its ``bucket_cap_mb`` column says);
* under a :class:`~ddp_lesson.commsim.SimulatedLink` (default α = 0.5 ms, 100 MB/s): ``torch``
  (the link as a DDP communication hook), ``naive``, ``bucketed`` with overlap and
  ``bucketed`` without overlap (both with ``--link-bucket-cap-mb``, several buckets);
  ``--no-link`` leaves these out (``python tools/gpucheck.py`` times the three without).

On CUDA (``--backend nccl``) each timed block ends with ``torch.cuda.synchronize()`` and the
slowest rank's time is reduced as a tensor on the rank's GPU: NCCL refuses a CPU tensor ("Tensors
must be CUDA and dense", ProcessGroupNCCL in torch's C++ library, libtorch_cuda).

Timing: ``--repeats`` rounds; in each round every variant runs ``--steps`` steps, in an order
rotated from round to round, variants that are compared running next to each other (so a burst
of load from other programs hits them alike). Each timed block starts after a barrier and
counts the slowest rank's time. A variant's steps/s is kept as min, median and max over rounds;
``ratio_to_torch`` (with its min and max) is this variant's rate divided by torch's rate in the
same round (same link setting), the number least disturbed by a machine shared with other work.
For the wrappers under the link, a :class:`~ddp_lesson.commsim.Recorder` measures the exposed
communication per step (:func:`~ddp_lesson.commsim.job_exposed_s`: from the last rank's end of
backward to the last rank's averaged gradients; min, median and max over steps) and its share of
that rank's communication time, next to the cost model's prediction from the measured
gradient-ready times (:func:`~ddp_lesson.cost_model.predict_overlap`).

Writes one CSV row per variant (``--out``, default ``benchmarks/ddp.csv``) and a figure
(``--figure``, default next to the CSV, ``.png``; ``none`` skips it); prints the ratios.
"""
from __future__ import annotations

import argparse
import gc
import json
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

DEFAULT_OUT = "benchmarks/ddp.csv"
DEFAULT_REPEATS = 7
MODULE = "ddp_lesson.bench.ddp"
FIELDS = ("variant", "link", "bucket_cap_mb", "buckets", "steps_per_s", "steps_per_s_min",
          "steps_per_s_max", "ratio_to_torch", "ratio_to_torch_min", "ratio_to_torch_max",
          "rounds", "steps", "exposed_ms", "exposed_ms_min", "exposed_ms_max", "exposed_share",
          "predicted_exposed_ms", "nprocs", "width", "batch_per_rank", "height", "width_px",
          "latency_ms", "bandwidth_MBps", "load_avg_1min")
#: (variant, under the link?) in the order they run in round 0; variants compared with each
#: other run next to each other, so a burst of load from other programs hits both alike.
VARIANTS = (
    ("torch", False), ("bucketed", False), ("naive", False),
    ("torch", True), ("bucketed", True), ("bucketed-no-overlap", True), ("naive", True),
)
_RESULT_TAG = "RESULT "


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=16, help="DeepLab base width (default 16)")
    p.add_argument("--batch", type=int, default=4, help="images per rank per step (default 4)")
    p.add_argument("--size", type=int, nargs=2, default=(64, 128), metavar=("H", "W"),
                   help="image size (default 64 128)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per block (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="BucketedDDP's cap without the link, for every bucket (unset: torch's "
                        "default, 1 MB for the first layers' bucket and 25 MB for the others)")
    p.add_argument("--link-bucket-cap-mb", type=float, default=0.25,
                   help="BucketedDDP's cap under the link (default 0.25)")
    p.add_argument("--latency-ms", type=float, default=0.5, help="link latency α (default 0.5)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0,
                   help="link bandwidth in MB/s, 1 MB = 1e6 bytes (default 100)")
    p.add_argument("--no-link", action="store_true",
                   help="only the variants without the simulated link")


_MODEL_FLAGS = ("width", "batch", "size", "steps", "warmup", "bucket_cap_mb",
                "link_bucket_cap_mb", "latency_ms", "bandwidth_mbps")


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE} worker")
    _add_model_flags(p)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="rounds of every variant")
    return p


def worker_argv(opts) -> list[str]:
    """The worker's arguments for the launcher's ``opts`` (only the flags the worker knows)."""
    out = ["worker", "--repeats", str(opts.repeats)]
    for name in _MODEL_FLAGS:
        value = getattr(opts, name)
        if value is None:
            continue  # unset: the worker's default is None too
        flag = "--" + name.replace("_", "-")
        out += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    return out + (["--no-link"] if getattr(opts, "no_link", False) else [])


def variants(no_link: bool = False) -> tuple:
    """The (variant, under the link?) pairs to run: :data:`VARIANTS`, or those without the
    link."""
    return tuple(v for v in VARIANTS if not (no_link and v[1]))


# ----------------------------------------------------------------------------- worker side


def _make_variant(variant: str, link: bool, opts, env, device) -> dict:
    """A fresh model (same seed) wrapped as ``variant``, with its optimizer and recorder."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ..commsim import Recorder, SimulatedLink
    from ..core.bucketed_ddp import BucketedDDP
    from ..core.naive_ddp import NaiveDDP
    from ..models import build_model

    torch.manual_seed(0)
    model = build_model("deeplab", width=opts.width).to(device)
    hook = SimulatedLink(opts.latency_ms / 1e3, opts.bandwidth_mbps * 1e6) if link else None
    rec = Recorder() if link and variant != "torch" else None
    cap = opts.link_bucket_cap_mb if link else opts.bucket_cap_mb
    if variant == "torch":
        kw = {"device_ids": [env.local_rank]} if device.type == "cuda" else {}
        ddp = DistributedDataParallel(model, **kw)
        if hook is not None:
            ddp.register_comm_hook(hook, SimulatedLink.torch_hook)
    elif variant == "naive":
        ddp = NaiveDDP(model, comm_hook=hook, recorder=rec)
    else:
        ddp = BucketedDDP(model, bucket_cap_mb=cap, comm_hook=hook, recorder=rec,
                          overlap=variant == "bucketed")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return {"ddp": ddp, "opt": opt, "rec": rec,
            "cap": cap if variant.startswith("bucketed") else None}


def _time_rounds(runs: dict, step, rounds: int, steps: int, device) -> dict:
    """Steps/s of every run in each round (rotated order), timed on the slowest rank."""
    import torch
    import torch.distributed as dist

    rates: dict = {key: [] for key in runs}
    keys = list(runs)
    for rnd in range(rounds):
        for key in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            dist.barrier()
            if device.type == "cuda":  # the GPU done with what came before: not timed
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(runs[key])
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                   device=device)  # NCCL reduces CUDA tensors only
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rates[key].append(steps / float(elapsed))
    return rates


def _exposed(run: dict, R: int) -> dict:
    """Exposed ms per step (min/median/max), its share and the model's prediction, from the
    recorder of every rank. A collective: every rank calls it for the same runs."""
    from ..commsim import gather_records, job_exposed_s, job_exposed_share
    from ..core.bucketed_ddp import BucketedDDP
    from ..cost_model import predict_overlap

    ddp, link = run["ddp"], run["ddp"].comm_hook
    everyone = gather_records(run["rec"])
    exposed, share, predicted = [], [], []
    for s in range(min(len(steps) for steps in everyone)):
        records = [steps[s] for steps in everyone]
        exposed.append(job_exposed_s(records) * 1e3)
        share.append(job_exposed_share(records))
        # the model, fed with the measured gradient-ready times of the rank that finished
        # backward last
        last = max(records, key=lambda r: r.t0_s + r.backward_end_s)
        if isinstance(ddp, BucketedDDP):
            ready = [max(last.grad_ready_s[ddp.param_names[i]] for i in b)
                     for b in ddp.bucket_indices]
        else:
            ready = [last.backward_end_s] * len(last.comm)
        pred = predict_overlap([e.nbytes for e in last.comm], ready, last.backward_end_s, R,
                               link.latency_s, link.bandwidth_bytes_per_s,
                               overlap=getattr(ddp, "overlap", False))
        predicted.append(pred["exposed_s"] * 1e3)
    lo, med, hi = spread(exposed)
    return {"exposed_ms": med, "exposed_ms_min": lo, "exposed_ms_max": hi,
            "exposed_share": statistics.median(share),
            "predicted_exposed_ms": statistics.median(predicted)}


def _row(variant, link, run, rates, opts, R) -> dict:
    mine, ref = rates[(variant, link)], rates[("torch", link)]
    lo, med, hi = spread(mine)
    r_lo, r_med, r_hi = spread(a / b for a, b in zip(mine, ref))
    ddp = run["ddp"]
    buckets = (len(ddp.bucket_indices) if hasattr(ddp, "bucket_indices")
               else None if variant == "torch" else len(ddp.param_names))
    return {"variant": variant, "link": link, "bucket_cap_mb": run["cap"], "buckets": buckets,
            "steps_per_s": med, "steps_per_s_min": lo, "steps_per_s_max": hi,
            "ratio_to_torch": r_med, "ratio_to_torch_min": r_lo, "ratio_to_torch_max": r_hi,
            "rounds": opts.repeats, "steps": opts.steps, "nprocs": R, "width": opts.width,
            "batch_per_rank": opts.batch, "height": opts.size[0], "width_px": opts.size[1],
            "latency_ms": opts.latency_ms if link else None,
            "bandwidth_MBps": opts.bandwidth_mbps if link else None,
            "load_avg_1min": load_avg()}


def worker(argv: list[str]) -> None:
    """The torchrun side: run every variant, print one JSON line of results on rank 0."""
    import torch
    import torch.nn.functional as F

    from ..env import cleanup, init_distributed

    opts = _worker_parser().parse_args(argv)
    env = init_distributed(timeout=300, announce=False)
    device = torch.device(env.device)
    H, W = opts.size
    g = torch.Generator().manual_seed(1000 + env.rank)
    images = torch.randn(opts.batch, 3, H, W, generator=g).to(device)
    labels = torch.randint(0, 19, (opts.batch, H, W), generator=g).to(device)

    def step(run):
        run["opt"].zero_grad(set_to_none=True)
        F.cross_entropy(run["ddp"](images), labels).backward()
        run["opt"].step()

    runs = {(v, link): _make_variant(v, link, opts, env, device)
            for v, link in variants(opts.no_link)}
    for run in runs.values():
        for _ in range(opts.warmup):
            step(run)
        if run["rec"] is not None:
            run["rec"].clear()
    rates = _time_rounds(runs, step, opts.repeats, opts.steps, device)
    rows = []
    for (variant, link), run in runs.items():
        row = _row(variant, link, run, rates, opts, env.world_size)
        if run["rec"] is not None:
            row.update(_exposed(run, env.world_size))  # a collective: every rank takes it
        rows.append(row)
    if env.rank == 0:
        print(_RESULT_TAG + json.dumps(rows), flush=True)
    runs.clear()
    # torch's DDP holds the process group (its reducer keeps a reference): free unreachable
    # wrappers now, so that the group is not torn down during interpreter exit, where
    # gloo can abort ("terminate called without an active exception").
    gc.collect()
    cleanup()


# ----------------------------------------------------------------------------- results


def write_results(rows: list[dict], path) -> None:
    """Write ``rows`` as CSV with :data:`FIELDS` (floats rounded to 4 significant digits)."""
    write_rows(rows, path, FIELDS, float_digits=4)


def read_results(path=DEFAULT_OUT) -> list[dict]:
    """Rows of a CSV written by :func:`write_results`: numbers parsed, ``link`` as bool,
    empty cells None."""
    return read_rows(path, text=("variant",), bools=("link",))


def ratios(rows: list[dict]) -> dict[str, float]:
    """The headline numbers, from rows of :func:`read_results`.

    Returns:
        ``"<variant>/torch"`` and ``"link <variant>/torch"``: the paired steps/s ratios
        (``ratio_to_torch``, median over rounds); ``"link naive/bucketed"``: how much slower
        NaiveDDP is under the link; ``"link exposed share <variant>"`` and
        ``"link exposed ms <variant>"``.
    """
    out = {}
    for r in rows:
        if r["variant"] != "torch":
            key = ("link " if r["link"] else "") + f"{r['variant']}/torch"
            out[key] = float(r["ratio_to_torch"])
    by = {(r["variant"], bool(r["link"])): r for r in rows}
    if ("bucketed", True) in by and ("naive", True) in by:
        out["link naive/bucketed"] = out["link naive/torch"] / out["link bucketed/torch"]
        for (v, link), r in by.items():
            if link and r.get("exposed_share") not in (None, ""):
                out[f"link exposed share {v}"] = float(r["exposed_share"])
                out[f"link exposed ms {v}"] = float(r["exposed_ms"])
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    """A readable table of ``rows`` plus the ratios."""
    def f(x, fmt):
        return format(float(x), fmt) if x not in ("", None) else "-"

    lines = [(f"{'variant':<20} {'link':<5} {'steps/s':>8} {'min':>7} {'max':>7} {'/torch':>7} "
              f"{'exposed ms':>10} {'share':>6} {'model ms':>8}")]
    for r in rows:
        lines.append(f"{r['variant']:<20} {bool(r['link'])!s:<5} "
                     f"{f(r['steps_per_s'], '8.2f')} {f(r['steps_per_s_min'], '7.2f')} "
                     f"{f(r['steps_per_s_max'], '7.2f')} {f(r['ratio_to_torch'], '7.3f')} "
                     f"{f(r.get('exposed_ms'), '10.1f')} "
                     f"{f(r.get('exposed_share'), '6.2f')} "
                     f"{f(r.get('predicted_exposed_ms'), '8.1f')}")
    lines += [f"{k}: {v:.3f}" for k, v in ratios(rows).items()]
    return lines


# ----------------------------------------------------------------------------- launcher side


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``ddp-lesson bench ddp``'s flags: the shared ones and the model's."""
    add_common_flags(p, nprocs="2", repeats=DEFAULT_REPEATS, out=DEFAULT_OUT)
    _add_model_flags(p)


def check(opts) -> None:
    """Refuse bad flags before any process starts (ValueError naming the flag and value)."""
    check_common(opts)
    at_least(opts, width=1, batch=1, steps=1, warmup=0, bucket_cap_mb=1e-6,
             link_bucket_cap_mb=1e-6, latency_ms=0, bandwidth_mbps=1e-6)
    if min(opts.size) < 16:
        raise ValueError(f"--size needs H and W >= 16, got {opts.size[0]} {opts.size[1]}")


def run(opts) -> int:
    """``ddp-lesson bench ddp``: one torchrun job per process count, the CSV, the figure."""
    from ..launch import TorchrunError, run_torchrun

    rows = []
    for n in parse_counts(opts.nprocs):
        args = worker_argv(opts)
        print(f"torchrun --standalone --nproc-per-node {n} -m {MODULE} " + " ".join(args),
              flush=True)
        try:
            result = run_torchrun(MODULE, args, module=True, nproc_per_node=n,
                                  timeout=opts.timeout, live=False, backend=opts.backend)
        except TorchrunError as err:
            print(f"benchmark failed: {err}\n{err.traceback or ''}", file=sys.stderr)
            for rank, text in sorted(err.result.errors.items()):
                print(f"--- rank {rank} stderr (last lines)\n"
                      + "\n".join(text.splitlines()[-15:]), file=sys.stderr)
            return 1
        line = next(ln for ln in result.rank_lines(0) if ln.startswith(_RESULT_TAG))
        rows += json.loads(line[len(_RESULT_TAG):])
    write_results(rows, opts.out)
    rows = read_results(opts.out)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {opts.out}")
    from ..viz.ddp import ddp_benchmark_figure

    write_figure(ddp_benchmark_figure, rows, opts)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_lesson.bench.ddp worker [...]`` under torchrun, or the benchmark."""
    return main_or_worker(argv, worker, "ddp-lesson bench ddp",
                          "steps/s of torch DDP, NaiveDDP and BucketedDDP", add_arguments, run,
                          check)


if __name__ == "__main__":
    sys.exit(main())
