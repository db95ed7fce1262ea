"""Check the ring, pipelined ring and naive all-reduce against ``dist.all_reduce``.

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.collectives_check

Every rank runs every case: int32/int64/float32/float64; 0 to a few thousand elements (numel
< world size, odd sizes); SUM/AVG/PRODUCT/MIN/MAX; contiguous and strided; subgroups with
``--group-sizes 1,2,3``. Integers must match torch bit for bit, floats within rounding
(another summation order). Rank 0 prints a line per world size and variant:
``world of 3, ring: 162 cases, bit-equal ints: True, floats within rounding: True``.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

from ddp_lesson.cli import plain
from ddp_lesson.collectives import naive_all_reduce, pipelined_ring_all_reduce, ring_all_reduce
from ddp_lesson.env import cleanup, init_distributed, reduce_device

DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _input(numel: int, dtype: torch.dtype, rank: int, seed: int, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
        return x.abs() + 0.5 if op == "product" else x
    hi = 4 if op == "product" else 1000
    return torch.randint(-hi, hi, (numel,), generator=g, dtype=dtype)


def _ok(mine: torch.Tensor, ref: torch.Tensor, inputs_abs_sum: torch.Tensor,
        world_size: int) -> bool:
    if not mine.dtype.is_floating_point:
        return torch.equal(mine, ref)
    # within rounding: |Δ| <= R · eps · Σ|x| (a bound on any summation order's error)
    eps = torch.finfo(mine.dtype).eps
    tol = world_size * eps * inputs_abs_sum.to(mine.dtype) + torch.finfo(mine.dtype).tiny
    return bool(((mine - ref).abs() <= tol).all())


def run_cases(variant, world_size: int, rank: int, sizes, group=None,
              dtypes=DTYPES) -> tuple[int, bool, bool]:
    """Run every case for one variant; returns (cases, ints bit-equal, floats within rounding)."""
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
           "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    cases, ints_ok, floats_ok, seed = 0, True, True, 0
    for dtype in dtypes:
        for numel in sizes:
            for name, op in ops.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                seed += 1
                # drawn on the CPU (the same numbers on any machine), then on the device
                # the default group reduces on: cuda:LOCAL_RANK under NCCL, else cpu
                x = _input(numel, dtype, rank, seed, name).to(reduce_device())
                ref = x.clone()
                dist.all_reduce(ref, op=op, group=group)
                absum = x.abs().to(torch.float64)
                dist.all_reduce(absum, group=group)
                if name == "product":
                    absum = ref.abs().to(torch.float64) * world_size
                mine = variant(x.clone(), op, group)
                ok = _ok(mine, ref, absum, world_size)
                if dtype.is_floating_point:
                    floats_ok &= ok
                else:
                    ints_ok &= ok
                cases += 1
    return cases, ints_ok, floats_ok


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    p.add_argument("--piece-numel", type=int, default=3,
                   help="pipelined ring piece size (small, so every chunk has several pieces)")
    p.add_argument("--group-sizes", default="",
                   help="comma-separated sizes k: also check on a subgroup of ranks 0..k-1 "
                        "(world sizes other than the job's, in one launch)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and dtypes")
    args = p.parse_args(argv)
    env = init_distributed(timeout=60)
    R, rank = env.world_size, env.rank
    variants = {
        "ring": ring_all_reduce,
        "pipelined ring": functools.partial(pipelined_ring_all_reduce,
                                            piece_numel=args.piece_numel),
        "naive": naive_all_reduce,
    }
    dtypes = (torch.int64, torch.float32) if args.quick else DTYPES
    sub_sizes = [int(k) for k in args.group_sizes.split(",") if k.strip()]
    for k in [R, *sub_sizes]:
        if not 1 <= k <= R:
            raise SystemExit(f"group size {k} is outside [1, {R}]")
        group = None if k == R else dist.new_group(list(range(k)))  # every rank must call it
        if rank >= k:
            continue
        sizes = sorted({0, 1, 2, max(1, k - 1), k, k + 1, 7, 13, 1000}
                       | (set() if args.quick else {4099}))
        where = "world" if group is None else "subgroup"
        for label, fn in variants.items():
            n, iok, fok = run_cases(fn, k, rank, sizes, group=group, dtypes=dtypes)
            if rank == 0:
                print(f"{where} of {k}, {label}: {n} cases, bit-equal ints: {iok}, "
                      f"floats within rounding: {fok}")
    # a strided (non-contiguous) 2-D tensor: the column view of a matrix
    m = torch.arange(12, dtype=torch.int64, device=env.device).reshape(3, 4) * (rank + 1)
    col, ref = m[:, 1], m[:, 1].clone()
    dist.all_reduce(ref)
    ring_all_reduce(col)
    strided_ok = torch.equal(m[:, 1], ref)
    if rank == 0:
        print(f"strided view reduced in place: {strided_ok}")
    cleanup()


if __name__ == "__main__":
    main()
