"""Hang clinic 2: ``all_reduce`` with a different tensor shape on each rank.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.shape_mismatch [--fixed]

The bug: each rank reduces a tensor sized by its own data (``rank + 2`` numbers). gloo does
not check shapes: the shorter rank may return with sums over the wrong elements (no error!),
the longer one waits and raises after the timeout ("Timed out waiting 5000ms for recv
operation"), or a later, innocent collective fails. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks
every collective first: "Detected mismatch between collectives on ranks. Rank 0 is running
collective: ... TensorShape=[2] ..., but Rank 1 is running collective: ... TensorShape=[3]".
The fix: agree on the shape first (all_reduce the lengths with MAX and pad), or gather
variable-sized data with ``all_gather_object``.
"""
from __future__ import annotations


def run(env, fixed: bool) -> None:
    """The program's body on the joined default group (no cleanup): broken or ``fixed``."""
    import torch
    import torch.distributed as dist

    values = torch.arange(env.rank + 2, dtype=torch.float32)  # length differs per rank
    if fixed:
        n = torch.tensor([values.numel()])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)  # agree on one length ...
        padded = torch.zeros(int(n.item()))
        padded[:values.numel()] = values          # ... and pad to it
        dist.all_reduce(padded)
        print(f"rank {env.rank}: padded to {int(n.item())}, sum {padded.tolist()}")
    else:
        print(f"rank {env.rank}: all_reduce of shape {tuple(values.shape)}")
        dist.all_reduce(values)  # BUG: shape (2,) on rank 0, (3,) on rank 1
        print(f"rank {env.rank}: got {values.tolist()}")
    dist.barrier()


def main(argv=None) -> None:
    from . import _common

    _common.main(__doc__, run, argv)


if __name__ == "__main__":
    main()
