"""Hang clinic 5: a rank that never joins (the world size does not match the launch).

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.missing_rank [--fixed]

The bug: the world size comes from the program's own configuration (here one more than
torchrun started, as a config saying 3 GPUs for a job that got 2), not torchrun's
``WORLD_SIZE``, so ``init_process_group`` waits for a rank that does not exist: 30 minutes on
gloo by default (NCCL's: 10); with a short timeout the store raises, naming how many joined.
The fix: rank and world size from torchrun's variables (``ddp_lesson.env.read_env``).
"""
from __future__ import annotations


def run(env, fixed: bool) -> None:
    """The repaired program on a joined group of torchrun's ``WORLD_SIZE`` (what ``--fixed``
    joins); the broken one needs a group of its own (:func:`main`).

    Raises:
        ValueError: ``fixed`` is False.
    """
    import torch.distributed as dist

    if not fixed:
        raise ValueError("the broken missing_rank joins a group of its own: run main()")
    print(f"rank {env.rank}: torchrun started {env.world_size} processes; joining a group of "
          f"{dist.get_world_size()}")
    dist.barrier()
    print(f"rank {env.rank}: all {dist.get_world_size()} ranks joined")


def main(argv=None) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from ...env import cleanup
    from ._common import flight_recorder, parse

    args = parse(__doc__, argv)
    launched = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    world_size = launched if args.fixed else launched + 1  # BUG unless --fixed
    print(f"rank {rank}: torchrun started {launched} processes; joining a group of {world_size}")
    recorder = flight_recorder(args, rank)  # the record of a rank stuck in the join
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except BaseException:
        if recorder is not None:
            recorder.finish(failed=True)
        raise
    if recorder is not None:
        recorder.finish()
    dist.barrier()
    print(f"rank {rank}: all {world_size} ranks joined")
    cleanup()


if __name__ == "__main__":
    main()
