"""Timelines and a bucket-size sweep under a simulated network link (notebook 04).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.ddp_overlap \\
        --out runs/04/overlap.json

On a CPU machine, gloo over loopback is so cheap that overlap has little to hide. A
:class:`ddp_lesson.commsim.SimulatedLink` (default α = 0.5 ms, 100 MB/s) makes every all-reduce
take the α-β model's time, so the effect of message count and of overlap shows. Every rank
trains the DeepLab-style model on its own fixed batch with:

1. NaiveDDP (one all-reduce per parameter after backward);
2. BucketedDDP without overlap (buckets sent after backward);
3. BucketedDDP with overlap (a bucket is sent as soon as its last gradient is ready);
4. BucketedDDP with overlap for each cap of a sweep.

A :class:`ddp_lesson.commsim.Recorder` on each wrapper records gradient-ready times and
all-reduce intervals; rank 0 gathers every rank's records and writes them to ``--out`` as
JSON for :func:`ddp_lesson.viz.ddp.ddp_timeline_figure` and
:func:`ddp_lesson.viz.ddp.bucket_sweep_figure`.
Printed lines are deterministic (bucket counts, what was written); the measured times go only
into the JSON. Model and batch are built on the CPU and moved to the rank's device
(:func:`ddp_lesson.env.reduce_device`: ``cuda:LOCAL_RANK`` under NCCL, which refuses CPU tensors).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lesson.commsim import Recorder, SimulatedLink, gather_records, job_exposed_s
from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP
from ddp_lesson.env import reduce_device
from ddp_lesson.models import build_model

#: Bucket caps of the sweep (MiB); 0 puts every parameter in a bucket of its own.
SWEEP_CAPS_MB = (0.0, 0.01, 0.03, 0.1, 0.25, 0.5, 1.0, 25.0)


def _train(ddp, images, labels, steps: int) -> None:
    opt = torch.optim.SGD(ddp.module.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        # Start every step together: a timeline then shows one step, not the drift a slow
        # rank carried over from the previous one (real training has no such barrier).
        dist.barrier()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(images), labels).backward()
        opt.step()


def run(width: int = 16, batch: int = 4, size=(64, 128), latency_ms: float = 0.5,
        bandwidth_mbps: float = 100.0, cap_mb: float = 0.25, caps_mb=SWEEP_CAPS_MB,
        steps: int = 4) -> dict:
    """Run every scenario on this rank (a collective: call on every rank).

    Returns (on every rank)::

        {"timeline": [[title, [record per rank]], ...],   # records as dicts
         "sweep": [[cap_mb, exposed_s], ...], "naive": [exposed_s, ...],
         "backward_s": median measured backward, "param_nbytes": [...],
         "buckets": {cap: n}, "link": [latency_s, bandwidth_bytes_per_s], "world_size": R}

    Exposed times are per step, for the whole job (:func:`ddp_lesson.commsim.job_exposed_s`).
    """
    rank = dist.get_rank()
    device = reduce_device()  # cuda:LOCAL_RANK under NCCL (CUDA tensors only), else cpu
    g = torch.Generator().manual_seed(1000 + rank)  # drawn on the CPU, the same on any machine
    images = torch.randn(batch, 3, *size, generator=g).to(device)
    labels = torch.randint(0, 19, (batch, *size), generator=g).to(device)
    link = SimulatedLink(latency_ms / 1e3, bandwidth_mbps * 1e6)

    def wrapped(kind: str, cap: float = cap_mb):
        torch.manual_seed(0)
        model = build_model("deeplab", width=width).to(device)
        rec = Recorder()
        if kind == "naive":
            return NaiveDDP(model, comm_hook=link, recorder=rec), rec
        return BucketedDDP(model, bucket_cap_mb=cap, comm_hook=link, recorder=rec,
                           overlap=kind == "overlap"), rec

    result = {"timeline": [], "sweep": [], "naive": [], "buckets": {},
              "link": [link.latency_s, link.bandwidth_bytes_per_s],
              "world_size": dist.get_world_size()}
    backward = []
    titles = {"naive": "NaiveDDP", "no-overlap": f"buckets of {cap_mb:g} MB, no overlap",
              "overlap": f"buckets of {cap_mb:g} MB, overlapped"}
    for kind, title in titles.items():
        ddp, rec = wrapped(kind)
        _train(ddp, images, labels, 1)  # warm-up
        rec.clear()
        _train(ddp, images, labels, steps)
        everyone = gather_records(rec)
        per_step = [[everyone[r][s] for r in range(len(everyone))] for s in range(steps)]
        exposed = [job_exposed_s(records) for records in per_step]
        # show the step in which the ranks were most in step (the smallest spread of their
        # forward end times): the algorithm, with as little of the machine's noise as possible
        clean = min(range(steps), key=lambda s: max(r.t0_s for r in per_step[s])
                    - min(r.t0_s for r in per_step[s]))
        result["timeline"].append([title, [r.to_dict() for r in per_step[clean]]])
        if kind == "naive":
            result["naive"] = exposed
            result["param_nbytes"] = [p.numel() * p.element_size()
                                      for p in ddp._params]
        backward += [s.backward_end_s for ranks in everyone for s in ranks]
    for cap in caps_mb:
        ddp, rec = wrapped("overlap", cap)
        result["buckets"][str(cap)] = len(ddp.bucket_indices)
        _train(ddp, images, labels, 1)
        rec.clear()
        _train(ddp, images, labels, steps)
        everyone = gather_records(rec)
        for s in range(steps):
            result["sweep"].append([cap, job_exposed_s([ranks[s] for ranks in everyone])])
        backward += [s.backward_end_s for ranks in everyone for s in ranks]
    result["backward_s"] = statistics.median(backward)
    return result


def main(argv=None) -> dict:
    """Parse options, run :func:`run`, write the JSON on rank 0, print deterministic facts."""
    from ddp_lesson.env import cleanup, init_distributed, print0

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/04/overlap.json", help="JSON written by rank 0")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="images per rank")
    p.add_argument("--latency-ms", type=float, default=0.5)
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--cap-mb", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=4, help="recorded steps per scenario")
    opts = p.parse_args(argv)
    init_distributed(timeout=120)
    result = run(width=opts.width, batch=opts.batch, latency_ms=opts.latency_ms,
                 bandwidth_mbps=opts.bandwidth_mbps, cap_mb=opts.cap_mb, steps=opts.steps)
    if dist.get_rank() == 0:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result))
    print0(f"link: alpha = {opts.latency_ms:g} ms, bandwidth = {opts.bandwidth_mbps:g} MB/s")
    pairs = [f"{float(c):g} -> {n}" for c, n in result["buckets"].items()]
    print0("buckets per cap (MB):")
    for i in range(0, len(pairs), 4):      # four caps a line: no line wraps in a notebook
        print0("  " + ", ".join(pairs[i:i + 4]))
    print0(f"recorded {len(result['timeline'])} timelines and a sweep of "
           f"{len(result['buckets'])} caps on {result['world_size']} ranks")
    # torch's DDP holds the process group (its reducer keeps a reference): free unreachable
    # wrappers now, so that the group is not torn down during interpreter exit, where
    # gloo can abort ("terminate called without an active exception").
    gc.collect()
    cleanup()
    return result


if __name__ == "__main__":
    main()
