"""A clinic-style case whose peer runs behind: rank 1 fails outside any collective at once,
rank 0 reaches its broadcast ``DELAY`` seconds later (a loaded machine), as rank 0 of the
clinic's ``model_mismatch`` did when CI caught it.

    torchrun --nproc-per-node 2 tests/programs/clinic_late_peer.py DELAY --timeout 2 \
        --flight-dir DIR

Run through ``ddp_lesson.labs.clinic._common.main``: rank 0's record must show the broadcast
unfinished, whatever ``DELAY`` (up to the clinic's join timeout).
"""
import sys
import time

from ddp_lesson.labs.clinic import _common

delay = float(sys.argv[1])


def run(env, fixed: bool) -> None:
    import torch
    import torch.distributed as dist

    if env.rank == 1:
        raise RuntimeError("rank 1 fails outside any collective")
    time.sleep(delay)
    print("rank 0 enters broadcast", flush=True)
    dist.broadcast(torch.ones(49), 0)


_common.main(__doc__, run, sys.argv[2:])
