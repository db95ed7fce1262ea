"""Small programs that the notebooks' torchrun cells (and the multi-process tests) launch.

Each lab module can run on its own under torchrun (its docstring starts with the command) and
exposes its steps as functions, so a notebook cell can call them and a test can check what
they print against torch's own implementation.
"""


def gather(obj) -> list:
    """Every rank's ``obj`` in rank order, on every rank: ``all_gather_object`` on the default
    group (a collective: every rank calls it)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
