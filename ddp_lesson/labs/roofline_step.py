"""Notebook 09's measurement: one step's backward and its gradient all-reduce, timed.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.roofline_step

TinyGPT (notebook 08's, vocabulary 103), ``--batch`` sequences of 32 tokens per rank. Each
rank times backward alone (``retain_graph``) and an all-reduce of one buffer the size of all
gradients, median of 5 after a warm-up; rank 0 prints the slowest rank's medians (all-reduce
MAX) with ``FlopCounterMode``'s FLOPs. Timing lines start with ``measured`` (the notebooks'
sanitizer masks the rest).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_lesson.cost_model import flops_per_sample
from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.gpt import TinyGPT


def _median_s(fn, device: str, repeats: int = 5) -> float:
    device = torch.device(device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    args = p.parse_args(argv)
    env = init_distributed()
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=103).to(env.device)
    x = torch.randint(0, 103, (args.batch, 32), device=env.device)
    fwd, bwd = flops_per_sample(model, (x,))
    loss = model(x)[0].sum()
    backward_s = _median_s(lambda: loss.backward(retain_graph=True), env.device)
    grads = torch.zeros(sum(q.numel() for q in model.parameters()), device=env.device)
    allreduce_s = _median_s(lambda: dist.all_reduce(grads), env.device)
    slowest = torch.tensor([backward_s, allreduce_s], device=env.device, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    backward_s, allreduce_s = slowest.tolist()
    if env.rank == 0:
        per_sample = backward_s / args.batch
        print(f"TinyGPT: {args.batch} sequences of 32 tokens per rank, world_size={env.world_size}")
        print(f"FLOPs per sequence (FlopCounterMode): forward {fwd:.3g}, backward {bwd:.3g}")
        print(f"gradients all-reduced: {grads.numel():,} floats = {4 * grads.numel():,} bytes")
        rate = bwd * args.batch / backward_s
        print(f"measured backward: {backward_s * 1e3:.2f} ms = {rate / 1e9:.2f} GFLOP/s")
        print(f"measured all-reduce: {allreduce_s * 1e3:.2f} ms")
        print(f"measured compute-bound batch: {allreduce_s / per_sample:.1f} sequences per rank")
    cleanup()


if __name__ == "__main__":
    main()
