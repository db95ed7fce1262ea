"""What torchrun tells each worker, and the raw setup that ``init_distributed`` wraps (notebook 00).

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.torchrun_env

Each worker prints the variables torchrun's agent set for it (torch 2.13,
``torch/distributed/elastic/agent/server/local_elastic_agent.py``, ``_start_workers``), values
that differ from run to run (the run id, the store's port) only as "set: True", then joins
the process group the raw way (:func:`raw_setup`), all-reduces its rank and leaves.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ddp_lesson.env import read_env

#: Variables whose values are the same on every run of the same command, in print order.
SHOWN = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
         "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE"]
#: Variables that change from run to run (or machine to machine): printed as "set: True".
VARYING = ["TORCHELASTIC_RUN_ID", "MASTER_PORT", "OMP_NUM_THREADS"]


def env_lines(environ=None) -> list[str]:
    """Two lines of ``NAME=value`` for :data:`SHOWN`, one of ``NAME set: bool`` for
    :data:`VARYING`."""
    environ = os.environ if environ is None else environ
    values = [f"{n}={environ.get(n)}" for n in SHOWN]
    return [" ".join(values[:6]), " ".join(values[6:]),
            " ".join(f"{n} set: {n in environ}" for n in VARYING)]


def raw_setup(backend: str) -> float:
    """What ``init_distributed`` and ``cleanup`` do, by hand, on ``backend`` ``"nccl"`` or
    ``"gloo"``. Synchronises all ranks; returns the all-reduced sum of the ranks."""
    device, device_id = torch.device("cpu"), None
    if backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)   # before any CUDA work: one GPU per process
        device = device_id = torch.device("cuda", local_rank)
    # device_id: NCCL connects here, with the peers, not at the first collective
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60),
                            device_id=device_id)
    x = torch.tensor([float(dist.get_rank())], device=device)
    dist.all_reduce(x)                      # sum over ranks, result on every rank
    dist.barrier()                          # nobody leaves while a peer is mid-collective
    dist.destroy_process_group()
    return x.item()


def main() -> None:
    env = read_env()
    for line in env_lines():
        print(line)
    print(f"DistEnv: rank={env.rank} local_rank={env.local_rank} world_size={env.world_size} "
          f"device={env.device}")
    print(f"raw setup on {env.backend}: all_reduce(sum of ranks) = {raw_setup(env.backend):.0f}")


if __name__ == "__main__":
    main()
