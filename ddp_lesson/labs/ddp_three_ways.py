"""Torch's DDP, NaiveDDP and BucketedDDP train to the same weights (notebook 04).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.ddp_three_ways

Every rank builds the same model from the same seed, trains it for a few SGD-with-momentum
steps on its own slice of the same global batches with each wrapper, and compares: each
wrapper against torch's ``DistributedDataParallel`` (largest difference over all
parameters and ranks), and the ranks against each other (bit-identical weights). Models: the
DeepLab-style net and the toys with a frozen layer, a tied weight and an unused branch
(``ddp_lesson.labs.ddp_toys``). Rank 0 prints facts, not floats, so the output is the same
on every machine. Models and batches are built on the CPU (the same numbers everywhere) and moved
to the rank's device (:func:`ddp_lesson.env.reduce_device`: ``cuda:LOCAL_RANK`` under NCCL,
which refuses CPU tensors; the CPU under gloo).
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP
from ddp_lesson.env import reduce_device
from ddp_lesson.labs.ddp_toys import TOYS, shard, toy_batch
from ddp_lesson.models import build_model

TOLERANCE = 1e-6


def _deeplab():
    return build_model("deeplab", width=8)


def _seg_batch(step: int, world_size: int, per_rank: int = 1, size=(32, 64)):
    g = torch.Generator().manual_seed(100 + step)
    n = per_rank * world_size
    return torch.randn(n, 3, *size, generator=g), torch.randint(0, 19, (n, *size), generator=g)


def train(make, wrap, batch, steps: int = 3) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Train ``make()`` wrapped by ``wrap`` for ``steps`` steps; returns ``(model, wrapper)``.

    A collective (every rank, same arguments). ``batch(step)`` gives the global batch; this
    rank trains on its contiguous slice.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = reduce_device()  # cuda:LOCAL_RANK under NCCL (CUDA tensors only), else cpu
    torch.manual_seed(0)
    model = make().to(device)  # built on the CPU: the same weights on a GPU as on a CPU
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step))
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()
    return model, ddp


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |a - b| over every parameter, maximised over ranks (a collective)."""
    worst = torch.tensor(max(float((p - q).abs().max())
                             for p, q in zip(a.parameters(), b.parameters())),
                         dtype=torch.float64, device=reduce_device())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def identical_on_every_rank(model: torch.nn.Module) -> bool:
    """True when every rank holds bit-identical parameters (a collective)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def compare(name: str, make, batch, unused: bool, cap_mb: float) -> list[str]:
    """Train with the three wrappers and describe the outcome in two lines: how many tensors
    the wrappers synchronise of those registered and the buckets; equal to torch's DDP."""
    ref, _ = train(make, lambda m: DistributedDataParallel(m, find_unused_parameters=unused),
                   batch)
    # the cores need no flag: a parameter with no gradient on a rank contributes zeros
    naive, nddp = train(make, NaiveDDP, batch)
    bucketed, bddp = train(make, lambda m: BucketedDDP(m, bucket_cap_mb=cap_mb), batch)
    registered = len(list(ref.named_parameters(remove_duplicate=False)))
    return [
        f"{name}: {len(nddp.param_names)} of {registered} tensors synchronised, "
        f"{len(bddp.bucket_indices)} buckets",
        f"{name}: Naive, Bucketed = torch's DDP within {TOLERANCE:g}: "
        f"{max_difference(naive, ref) < TOLERANCE}, {max_difference(bucketed, ref) < TOLERANCE}"
        f"; same on all ranks: {all(map(identical_on_every_rank, (ref, naive, bucketed)))}",
    ]


def main(argv=None) -> None:
    """Compare the wrappers on DeepLab and on the toys; rank 0 prints the facts."""
    from ddp_lesson.env import cleanup, init_distributed, print0

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    init_distributed(timeout=60)
    R = dist.get_world_size()
    lines = compare("deeplab", _deeplab, lambda s: _seg_batch(s, R), False, 0.05)
    for name in ("frozen", "tied", "unused"):
        cls, unused = TOYS[name]
        lines += compare(name, cls, lambda s: toy_batch(s, 2 * R), unused, 0.0)
    for line in lines:
        print0(line)
    # torch's DDP holds the process group (its reducer keeps a reference): free unreachable
    # wrappers now, so that the group is not torn down during interpreter exit, where
    # gloo can abort ("terminate called without an active exception").
    gc.collect()
    cleanup()


if __name__ == "__main__":
    main()
