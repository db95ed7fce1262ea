"""Benchmark: training steps/s of torch's DDP, NaiveDDP and BucketedDDP, and exposed communication.

    python -m ddp_lesson.bench_ddp                 # (the lead wires it to: ddp-lesson bench ddp)
    python -m ddp_lesson.bench_ddp --rounds 9 --steps 8 --out runs/bench/ddp.csv
    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.bench_ddp worker --rounds 3

One torchrun job (2 processes, gloo unless told otherwise) trains the DeepLab-style model
(``ddp_lesson.models.build_model("deeplab", width=W)``) on the same fixed batch with every
variant, from the same seed:

* without a link: ``torch`` (``DistributedDataParallel`` with its defaults), ``naive``
  (:class:`~ddp_lesson.ddp.NaiveDDP`), ``bucketed`` (:class:`~ddp_lesson.ddp.BucketedDDP`,
  ``bucket_cap_mb=25`` like torch);
* under a :class:`~ddp_lesson.ddp.SimulatedLink` (default α = 0.5 ms, 100 MB/s): ``torch``
  (the link as a DDP communication hook), ``naive``, ``bucketed`` with overlap and
  ``bucketed`` without overlap (both with ``--link-bucket-cap-mb``, several buckets).

Timing: ``--rounds`` rounds; in each round every variant runs ``--steps`` steps, in an order
rotated from round to round, variants that are compared running next to each other (so a burst
of load from other programs hits them alike). Each timed block starts after a barrier and
counts the slowest rank's time. A variant's steps/s is the median over rounds (min and max
kept to show the noise); ``ratio_to_torch`` is the median over rounds of its rate divided by
torch's rate in the same round (same link setting), the number least disturbed by a
machine shared with other work. For the wrappers under the link, a
:class:`~ddp_lesson.ddp.Recorder` measures the exposed communication per step
(:func:`~ddp_lesson.ddp.job_exposed_s`: from the last rank's end of backward to the last
rank's averaged gradients) and its share of that rank's communication time, next to the cost
model's prediction from the measured gradient-ready times
(:func:`~ddp_lesson.ddp.predict_overlap`); medians over steps.

Writes one CSV row per variant (``--out``, default ``benchmarks/ddp.csv``) and a figure
(``--figure``, default next to the CSV, ``.png``); prints the ratios.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_OUT = "benchmarks/ddp.csv"
FIELDS = ("variant", "link", "bucket_cap_mb", "buckets", "steps_per_s", "steps_per_s_min",
          "steps_per_s_max", "ratio_to_torch", "rounds", "steps", "exposed_ms", "exposed_share",
          "predicted_exposed_ms", "nprocs", "width", "batch_per_rank", "height", "width_px",
          "latency_ms", "bandwidth_MBps")
#: (variant, under the link?) in the order they run in round 0; variants compared with each
#: other run next to each other, so a burst of load from other programs hits both alike.
VARIANTS = (
    ("torch", False), ("bucketed", False), ("naive", False),
    ("torch", True), ("bucketed", True), ("bucketed-no-overlap", True), ("naive", True),
)


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddp_lesson.bench_ddp worker")
    _add_common(p)
    return p


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=16, help="DeepLab base width (default 16)")
    p.add_argument("--batch", type=int, default=4, help="images per rank per step (default 4)")
    p.add_argument("--size", type=int, nargs=2, default=(64, 128), metavar=("H", "W"),
                   help="image size (default 64 128)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per block (default 6)")
    p.add_argument("--rounds", type=int, default=11, help="rounds of every variant (default 11)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="BucketedDDP's cap without the link (default 25, torch's default)")
    p.add_argument("--link-bucket-cap-mb", type=float, default=0.25,
                   help="BucketedDDP's cap under the link (default 0.25)")
    p.add_argument("--latency-ms", type=float, default=0.5, help="link latency α (default 0.5)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0,
                   help="link bandwidth in MB/s, 1 MB = 1e6 bytes (default 100)")


def worker(argv: list[str]) -> None:
    """The torchrun side: run every variant, print one JSON line of results on rank 0."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from .ddp import (BucketedDDP, NaiveDDP, Recorder, SimulatedLink, gather_records,
                      job_exposed_s, job_exposed_share, predict_overlap)
    from .env import cleanup, init_distributed
    from .models import build_model

    opts = _worker_parser().parse_args(argv)
    env = init_distributed(timeout=300, announce=False)
    rank, R = env.rank, env.world_size
    device = torch.device(env.device)
    H, W = opts.size
    g = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(opts.batch, 3, H, W, generator=g).to(device)
    labels = torch.randint(0, 19, (opts.batch, H, W), generator=g).to(device)

    def make(variant: str, link: bool):
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
        return {"ddp": ddp, "opt": opt, "rec": rec, "cap": None if variant != "bucketed"
                and variant != "bucketed-no-overlap" else cap}

    def step(run):
        run["opt"].zero_grad(set_to_none=True)
        F.cross_entropy(run["ddp"](images), labels).backward()
        run["opt"].step()

    runs = {(v, link): make(v, link) for v, link in VARIANTS}
    for run in runs.values():
        for _ in range(opts.warmup):
            step(run)
        if run["rec"] is not None:
            run["rec"].clear()
    rates: dict = {key: [] for key in runs}
    keys = list(runs)
    for rnd in range(opts.rounds):
        order = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
        for key in order:
            run = runs[key]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(opts.steps):
                step(run)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rates[key].append(opts.steps / float(elapsed))
    rows = []
    for (variant, link), run in runs.items():
        row = {"variant": variant, "link": link,
               "bucket_cap_mb": run["cap"] if run["cap"] is not None else "",
               "buckets": len(run["ddp"].bucket_indices) if hasattr(run["ddp"], "bucket_indices")
               else ("" if variant == "torch" else len(run["ddp"].param_names)),
               "steps_per_s": statistics.median(rates[(variant, link)]),
               "steps_per_s_min": min(rates[(variant, link)]),
               "steps_per_s_max": max(rates[(variant, link)]),
               # the median over rounds of this variant's rate / torch's rate in the same round
               "ratio_to_torch": statistics.median(
                   a / b for a, b in zip(rates[(variant, link)], rates[("torch", link)])),
               "rounds": opts.rounds, "steps": opts.steps,
               "exposed_ms": "", "exposed_share": "", "predicted_exposed_ms": "",
               "nprocs": R, "width": opts.width, "batch_per_rank": opts.batch,
               "height": H, "width_px": W,
               "latency_ms": opts.latency_ms if link else "",
               "bandwidth_MBps": opts.bandwidth_mbps if link else ""}
        rec = run["rec"]
        if rec is not None:
            ddp, link_ = run["ddp"], run["ddp"].comm_hook
            everyone = gather_records(rec)  # a collective: every rank takes this branch
            exposed, share, predicted = [], [], []
            for s in range(min(len(steps) for steps in everyone)):
                records = [steps[s] for steps in everyone]
                exposed.append(job_exposed_s(records) * 1e3)
                share.append(job_exposed_share(records))
                # the model, fed with the measured gradient-ready times of the rank that
                # finished backward last
                last = max(records, key=lambda r: r.t0_s + r.backward_end_s)
                if isinstance(ddp, BucketedDDP):
                    ready = [max(last.grad_ready_s[ddp.param_names[i]] for i in b)
                             for b in ddp.bucket_indices]
                else:
                    ready = [last.backward_end_s] * len(last.comm)
                pred = predict_overlap([e.nbytes for e in last.comm], ready,
                                       last.backward_end_s, R, link_.latency_s,
                                       link_.bandwidth_bytes_per_s,
                                       overlap=getattr(ddp, "overlap", False))
                predicted.append(pred["exposed_s"] * 1e3)
            row["exposed_ms"] = statistics.median(exposed)
            row["exposed_share"] = statistics.median(share)
            row["predicted_exposed_ms"] = statistics.median(predicted)
        rows.append(row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    runs.clear()
    # torch's DDP holds the process group (its reducer keeps a reference): free unreachable
    # wrappers now, so that the group is not torn down during interpreter exit, where
    # gloo can abort ("terminate called without an active exception").
    gc.collect()
    cleanup()


# ----------------------------------------------------------------------------- launcher side


def write_results(rows: list[dict], path) -> None:
    """Write ``rows`` as CSV with :data:`FIELDS` (floats rounded to 4 significant digits)."""
    from .bench import write_rows

    write_rows(rows, path, FIELDS, float_digits=4)


def read_results(path=DEFAULT_OUT) -> list[dict]:
    """Rows of a CSV written by :func:`write_results`, numbers parsed, ``link`` as bool."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out = {}
            for k, v in row.items():
                if k in ("variant",):
                    out[k] = v
                elif k == "link":
                    out[k] = v == "True"
                elif v == "":
                    out[k] = None
                else:
                    out[k] = float(v)
            rows.append(out)
    return rows


def ratios(rows: list[dict]) -> dict[str, float]:
    """The numbers the issue's targets are stated in, from rows of :func:`read_results`.

    Returns:
        ``"<variant>/torch"`` and ``"link <variant>/torch"``: the paired steps/s ratios
        (``ratio_to_torch``); ``"link naive/bucketed"``: how much slower NaiveDDP is under the
        link; ``"link exposed share <variant>"`` and ``"link exposed ms <variant>"``.
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
    lines = [f"{'variant':<20} {'link':<5} {'steps/s':>8} {'min':>7} {'max':>7} {'/torch':>7} "
             f"{'exposed ms':>10} {'share':>6} {'model ms':>8}"]
    for r in rows:
        def f(x, fmt):
            return format(float(x), fmt) if x not in ("", None) else "-"
        lines.append(f"{r['variant']:<20} {str(bool(r['link'])):<5} "
                     f"{f(r['steps_per_s'], '8.2f')} {f(r['steps_per_s_min'], '7.2f')} "
                     f"{f(r['steps_per_s_max'], '7.2f')} {f(r['ratio_to_torch'], '7.3f')} "
                     f"{f(r['exposed_ms'], '10.1f')} "
                     f"{f(r['exposed_share'], '6.2f')} {f(r['predicted_exposed_ms'], '8.1f')}")
    lines += [f"{k}: {v:.3f}" for k, v in ratios(rows).items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_lesson.bench_ddp [options]`` (or ``... worker [options]`` under torchrun)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        worker(argv[1:])
        return 0
    from .launch import TorchrunError, run_torchrun

    p = argparse.ArgumentParser(
        prog="ddp-lesson bench ddp",
        description="steps/s of torch DDP, NaiveDDP and BucketedDDP (and exposed "
                    "communication under a simulated link) on the DeepLab-style model")
    p.add_argument("--nprocs", type=int, default=2, help="processes (default 2)")
    p.add_argument("--backend", default="gloo", help="gloo (default), nccl or auto")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV path (default {DEFAULT_OUT})")
    p.add_argument("--figure", default=None, help="PNG path (default: the CSV's, .png)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds (default 900)")
    _add_common(p)
    opts, _ = p.parse_known_args(argv)
    worker_args = ["worker"] + _launcher_only(argv)
    print(f"torchrun --standalone --nproc-per-node {opts.nprocs} -m ddp_lesson.bench_ddp "
          + " ".join(worker_args), flush=True)
    try:
        result = run_torchrun("ddp_lesson.bench_ddp", worker_args, module=True,
                              nproc_per_node=opts.nprocs, timeout=opts.timeout, live=False,
                              backend=opts.backend)
    except TorchrunError as err:
        print(f"benchmark failed: {err}", file=sys.stderr)
        print(err.traceback or "", file=sys.stderr)
        for rank, text in sorted(err.result.errors.items()):
            print(f"--- rank {rank} stderr (last lines)\n" + "\n".join(text.splitlines()[-15:]),
                  file=sys.stderr)
        return 1
    line = next(l for l in result.rank_lines(0) if l.startswith("RESULT "))
    rows = json.loads(line[len("RESULT "):])
    write_results(rows, opts.out)
    figure = opts.figure or str(Path(opts.out).with_suffix(".png"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .viz import ddp_benchmark_figure

    fig = ddp_benchmark_figure(read_results(opts.out))
    fig.savefig(figure, dpi=80)
    plt.close(fig)
    print("\n".join(summary_lines(read_results(opts.out))))
    print(f"wrote {opts.out} and {figure}")
    return 0


def _launcher_only(argv: list[str]) -> list[str]:
    """``argv`` without the launcher's own options and their values (the worker's arguments)."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--nprocs", "--backend", "--out", "--figure", "--timeout"):
            skip = "=" not in a
            continue
        keep.append(a)
    return keep


if __name__ == "__main__":
    sys.exit(main())
