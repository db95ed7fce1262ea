"""Hang clinic 2: ``all_reduce`` with a different tensor shape on each rank.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.shape_mismatch [--fixed]

The bug: each rank reduces a tensor sized by its own data (here ``rank + 2`` numbers: per-rank
counts of something whose length differs between ranks). A collective requires the same shape
and dtype on every rank; gloo does not check it. The rank with the shorter tensor may even
return, with numbers summed over the wrong elements (no error for it!), while the rank with
the longer one waits for data that never comes and raises after the timeout ("Timed out
waiting 5000ms for recv operation"); the symptom then shows up in a later, innocent
collective. With
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch checks every collective first and names the
mismatch: "Detected mismatch between collectives on ranks. Rank 0 is running collective:
... TensorShape=[2] ..., but Rank 1 is running collective: ... TensorShape=[3]".
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
