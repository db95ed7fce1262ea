"""Hang clinic 4: a model that differs between ranks.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.model_mismatch [--fixed]

The bug: the model's width depends on the rank (in practice: a config read per host, an
unseeded random architecture, a rank-dependent branch). DDP's constructor compares the
ranks' parameter shapes and refuses before any step ("... appears not to match sizes of the
same param in process 0", naming the parameter); a hand-written gradient all_reduce would
hang instead (clinic case 2). The fix: build the model from the same settings everywhere
(broadcast the config from rank 0).
"""
from __future__ import annotations


def run(env, fixed: bool) -> None:
    """The program's body on the joined default group (no cleanup): broken or ``fixed``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    hidden = 8 if fixed else 8 + env.rank  # BUG without --fixed: 8 on rank 0, 9 on rank 1
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(),
                                 torch.nn.Linear(hidden, 1))
    print(f"rank {env.rank}: hidden width {hidden}")
    model = DistributedDataParallel(module)  # checks that every rank has the same shapes
    model(torch.ones(2, 4)).sum().backward()
    print(f"rank {env.rank}: one step done with DDP")
    dist.barrier()
    del model  # freed while the group lives


def main(argv=None) -> None:
    from . import _common

    _common.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
