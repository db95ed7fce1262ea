"""A two-rank job that goes wrong in one chosen way and leaves each rank's flight record.

    torchrun --nproc-per-node 2 tests/programs/flight_case.py CASE DIR

CASE: ``differ`` (rank 0 all_reduce, rank 1 broadcast), ``shape`` (all_reduce of 3 vs 4
elements), ``skip`` (rank 1 never calls the third collective), ``silent`` (rank 1 dies without
a record), ``ok`` (nothing wrong). Each rank first runs two matching all_reduces. The record is
written while the job hangs (a thread started before the faulty step), by
``ddp_lesson.flight.dump_when_stuck`` for ``skip`` and ``silent`` (rank 1 of ``silent`` dies
once rank 0's record is out and rank 0 is done, as a rank killed by the OOM killer would), and
by torch's own calls for ``differ`` (the raw pickle, under NCCL's default file prefix) and
``shape`` (torch's JSON form): the reader takes dumps it did not write.
"""
import datetime
import os
import pickle
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
from torch.distributed.distributed_c10d import _set_pg_timeout

from ddp_lesson.flight import dump_when_stuck, write_trace

case, out = sys.argv[1], sys.argv[2]
RANK0_DONE = out.rstrip("/") + ".rank0_done"  # beside the dumps' folder, not in it
# Joined with a patient timeout: a group's timeout also bounds the wait for the peers at
# init, and on a loaded machine one rank can reach init more than 5 s after the other (its
# Python and torch still starting). Once both all_reduces below have returned every rank is
# up, and the faulty step gets 5 s (_set_pg_timeout, as ddp_lesson.labs.clinic does).
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)
dist.all_reduce(x)
_set_pg_timeout(datetime.timedelta(seconds=5), dist.group.WORLD)


def wait_for(paths: list[str], timeout_s: float = 60.0) -> None:
    """Poll until every file in ``paths`` exists, at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def torch_dump(name: str, dump) -> threading.Thread:
    def write():
        time.sleep(1.0)
        data = dump()
        with open(os.path.join(out, name + ".tmp"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


if case == "differ":
    dumper = torch_dump(f"nccl_trace_rank_{rank}", _dump_fr_trace)
elif case == "shape":
    dumper = torch_dump(f"trace_{rank}", _dump_fr_trace_json)
elif case == "skip" or (case == "silent" and rank == 0):
    ok, dumper = dump_when_stuck(out, rank, after_s=1.0, stacks=case == "skip")

try:
    if case == "differ":
        dist.all_reduce(torch.ones(3)) if rank == 0 else dist.broadcast(x, 0)
    elif case == "shape":
        dist.all_reduce(torch.ones(3 + rank))
    elif case in ("skip", "silent"):
        if rank == 0:
            dist.all_reduce(x)
        elif case == "silent":  # dies, without a record, once rank 0 has written its own
            # and is past its last line: exiting 1 sooner, torchrun could stop rank 0 before
            # its "done" (1 of 2 loaded suite runs). Rank 0's all_reduce ends at the 5 s
            # timeout, the peer still alive.
            wait_for([RANK0_DONE])
            os._exit(1)
        else:
            dumper.join(60)  # stuck elsewhere (say, in data loading) until the record is out
    elif case == "ok":
        dist.all_reduce(x)
        # the record marks a collective completed a moment after the call returned
        deadline = time.monotonic() + 30
        while (pickle.loads(_dump_fr_trace(includeStackTraces=False))["pg_status"]["0"]
               ["last_completed_collective"] < 3 and time.monotonic() < deadline):
            time.sleep(0.05)
        write_trace(out, rank, stacks=False)
except RuntimeError:
    pass  # the timeout or the peer's exit: expected
if case in ("differ", "shape", "skip") or (case == "silent" and rank == 0):
    dumper.join(60)
if case != "silent":
    # leave only once every rank's record is out: a rank gone sooner fails the peer's pending
    # collective, retired as completed, before a late peer's dump (1 of 2 loaded runs, shape)
    name = "nccl_trace_rank_" if case == "differ" else "trace_"
    wait_for([os.path.join(out, f"{name}{r}") for r in (0, 1)])
print("done", flush=True)
if case == "silent" and rank == 0:
    open(RANK0_DONE, "w").close()
os._exit(0)
