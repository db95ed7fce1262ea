"""Hang clinic 3: ranks with different numbers of batches under DDP, and the fix with ``Join``.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.uneven_batches [--fixed]

The bug: each rank holds its own data and rank ``r`` has ``3 + r`` batches (an uneven split
without a ``DistributedSampler``, or a streaming source). DDP all-reduces the gradients in
every ``backward()``; when rank 0 runs out of data and leaves the loop, rank 1's 4th backward
waits for a peer that never comes: gloo raises "Timed out waiting ... ms" after the process
group's timeout (5 s here; 30 min by default, 10 on NCCL). The fix: ``with Join([model]):`` around
the loop (``torch.distributed.algorithms.Join``, torch's "Distributed Training with Uneven
Inputs Using the Join Context Manager" tutorial): a rank that finished shadows the
collectives of the others with zero gradients until every rank is done. Also fine: give every
rank the same number of batches (``DistributedSampler`` pads, ``drop_last`` trims).

``--fixed`` runs the loop under ``Join`` with torch's ``DistributedDataParallel`` (a
``Joinable``: ``join_hook`` in ``torch/nn/parallel/distributed.py``) and prints whether the
weights ended equal on every rank. The cores of notebook 04 are not ``Joinable``.
"""
from __future__ import annotations


def run(env, fixed: bool) -> None:
    """The program's body on the joined default group (no cleanup): broken or ``fixed``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms import Join
    from torch.nn.parallel import DistributedDataParallel

    gen = torch.Generator().manual_seed(env.rank)
    batches = [torch.randn(2, 4, generator=gen) for _ in range(3 + env.rank)]  # 3 vs 4
    print(f"rank {env.rank}: {len(batches)} batches")

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop(model):
        for x in batches:
            opt.zero_grad()
            model(x).square().mean().backward()  # all_reduce of the gradients
            opt.step()

    if fixed:
        with Join([model]):  # finished ranks shadow the others' all_reduces
            loop(model)
        w = model.module.weight.detach().clone()
        same = [torch.zeros_like(w) for _ in range(env.world_size)]
        dist.all_gather(same, w)
        equal = all(torch.equal(s, same[0]) for s in same)
        print(f"rank {env.rank}: done; weights equal on all ranks: {equal}")
    else:
        loop(model)  # BUG: the rank with more batches waits in its extra backward
        print(f"rank {env.rank}: done with my batches")
    dist.barrier()
    del model  # freed while the group lives


def main(argv=None) -> None:
    from . import _common

    _common.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
