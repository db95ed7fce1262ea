"""What several exercises' checkers share: standing in for ``torch.distributed`` functions
while a candidate runs (03.6 refuses torch's collectives and records point-to-point messages;
08.4 records every communication call)."""
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
