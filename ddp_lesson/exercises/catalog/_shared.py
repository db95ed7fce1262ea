"""What several exercises' checkers share: standing in for ``torch.distributed`` functions
while a candidate runs (03.6 refuses torch's collectives and records point-to-point messages;
04.2, 04.3 and 04.4 record the all-reduces; 08.4 every communication call)."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def dist_patched(patches: dict):
    """Within the block, ``torch.distributed.<name>`` is ``patches[name]``, both where a
    candidate looks it up (``dist.all_reduce``) and in ``distributed_c10d``, whose functions
    call each other by that module's names; the originals come back afterwards, whatever the
    candidate raised."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in patches
             if hasattr(mod, name)]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, patches[name])
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def spy(name: str, before):
    """``torch.distributed.<name>`` that first calls ``before(*args, **kwargs)`` (which may
    raise); when that returns a function, it is applied to what the call returned."""
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, name)

    def spied(*args, **kwargs):
        after = before(*args, **kwargs)
        result = original(*args, **kwargs)
        return after(result) if after else result

    spied.__name__ = name
    return spied
