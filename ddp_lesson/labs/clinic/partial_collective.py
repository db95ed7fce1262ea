"""Hang clinic 1: a collective that only some ranks call.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.partial_collective [--fixed]

The bug: rank 0 logs a global metric with an ``all_reduce`` inside ``if rank == 0:``. Rank 0
waits in the collective for peers that never enter it. With gloo's default timeout it would
wait 30 minutes (NCCL's: 10); with ``init_distributed(timeout=5)`` gloo raises after 5 s on
rank 0 ("Timed out waiting ... for recv operation"), or at once when the peer has left
("Connection closed by peer"). The fix: every rank calls every collective, in the same order;
only the *printing* is guarded by ``if rank == 0``.
"""
from __future__ import annotations


def run(env, fixed: bool) -> None:
    """The program's body on the joined default group (no cleanup): broken or ``fixed``."""
    import torch
    import torch.distributed as dist

    loss = torch.tensor([float(env.rank + 1)])
    if fixed:
        dist.all_reduce(loss)  # every rank takes part ...
        if env.rank == 0:      # ... and only the printing is rank 0's
            print(f"mean loss over {env.world_size} ranks: {loss.item() / env.world_size:.2f}")
    elif env.rank == 0:
        print("rank 0 enters all_reduce; the other ranks do not")
        dist.all_reduce(loss)  # BUG: the other ranks never get here
    else:
        print(f"rank {env.rank} skips the all_reduce and goes on")
    if fixed:
        dist.barrier()


def main(argv=None) -> None:
    from . import _common

    _common.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
