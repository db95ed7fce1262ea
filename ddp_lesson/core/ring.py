"""The ring all-reduce: a reduce-scatter, then an all-gather, built from point-to-point messages.

``R`` ranks stand in a ring; each sends right to ``rank + 1`` and receives from the left,
``rank - 1``. The tensor is cut into ``R`` chunks. In each of ``2(R - 1)`` steps every rank
sends one chunk and receives one, at the same time, so every link is busy in both directions.
At step ``s`` rank ``r`` sends chunk ``(r - s) mod R`` and receives chunk ``(r - s - 1) mod R``
(what ``r`` receives is what its left neighbour sends; it forwards it at the next step).

1. **Reduce-scatter** (steps ``0 .. R-2``): the received chunk is *combined* (added, for SUM)
   into the local copy. After ``R - 1`` steps rank ``r`` holds chunk ``(r + 1) mod R`` reduced
   over all ranks.
2. **All-gather** (steps ``R-1 .. 2R-3``): the received chunk, already complete, *replaces*
   the local copy, until every rank holds every reduced chunk.

Each rank sends ``2(R-1)/R`` of the tensor in all: under twice its size whatever ``R`` is, which
is why the ring is bandwidth-optimal (P. Patarasuk and X. Yuan, J. Parallel Distrib. Comput.
69(2), 2009; A. Gibiansky, "Bringing HPC techniques to deep learning", Baidu Research, 2017).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_all_reduce", "combine_fn", "ring_send_chunk", "ring_recv_chunk",
           "chunk_bounds"]

_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.AVG: torch.add,   # AVG: sum, then / R
        dist.ReduceOp.PRODUCT: torch.mul, dist.ReduceOp.MIN: torch.minimum,
        dist.ReduceOp.MAX: torch.maximum}


def ring_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                    all_gather: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` (any shape, same on every rank) over ``group``'s ranks, in place.

    A collective. ``op``: SUM, AVG (SUM, then / R, gloo's rule), PRODUCT, MIN, MAX; integers
    match ``dist.all_reduce`` bit for bit, floats up to rounding. ``all_gather=False`` stops
    after the reduce-scatter, when only chunk ``(rank + 1) mod R`` is reduced. Raises
    ValueError (bad ``op``, no group) or TypeError (see :func:`combine_fn`).
    """
    combine = combine_fn(tensor, op)
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group it was given")
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    right, left = to_global((rank + 1) % R), to_global((rank - 1) % R)
    work = tensor.contiguous()                   # itself when contiguous
    flat = work.view(-1)                         # chunks are ranges of the flat view
    bounds = chunk_bounds(flat.numel(), R)
    buf = torch.empty(bounds[0][1], dtype=flat.dtype, device=flat.device)  # the largest chunk
    for step in range((2 if all_gather else 1) * (R - 1)):
        s0, s1 = bounds[ring_send_chunk(rank, step, R)]
        r0, r1 = bounds[ring_recv_chunk(rank, step, R)]
        incoming = buf[:r1 - r0]
        reqs = []
        if s1 > s0:                              # an empty chunk (numel < R) sends nothing
            reqs.append(dist.isend(flat[s0:s1], dst=right, group=group, tag=step))
        if r1 > r0:
            reqs.append(dist.irecv(incoming, src=left, group=group, tag=step))
        for req in reqs:                         # both done before the chunks are touched
            req.wait()
        if step < R - 1:
            flat[r0:r1] = combine(flat[r0:r1], incoming)   # reduce-scatter: combine
        else:
            flat[r0:r1] = incoming               # all-gather: take the finished chunk
    if op == dist.ReduceOp.AVG:
        flat /= R
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def combine_fn(tensor: torch.Tensor, op):
    """The element-wise function that reduces two chunks of ``tensor`` under ``op``.

    Raises:
        ValueError: ``op`` is not SUM, AVG, PRODUCT, MIN or MAX.
        TypeError: AVG of an integer tensor (no exact integer mean), or a complex tensor.
    """
    if op not in _OPS:
        raise ValueError(f"reduce op {op!r} is not one of SUM, AVG, PRODUCT, MIN, MAX")
    if tensor.is_complex():
        raise TypeError(f"complex tensors ({tensor.dtype}) are not supported; reduce "
                        "torch.view_as_real(tensor) instead")
    if op == dist.ReduceOp.AVG and not tensor.is_floating_point():
        raise TypeError(f"ReduceOp.AVG of an integer tensor ({tensor.dtype}) has no exact "
                        "integer result; use SUM and divide, or convert to float first")
    return _OPS[op]


def ring_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` sends to ``rank + 1`` at ``step``: ``(rank - step) mod R``, in both
    phases (in the all-gather it is the chunk completed, or received, one step earlier)."""
    return (rank - step) % world_size


def ring_recv_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` receives from ``rank - 1`` at ``step``: ``(rank - step - 1) mod R``,
    which is ``ring_send_chunk(rank - 1, step)`` and ``ring_send_chunk(rank, step + 1)``."""
    return (rank - step - 1) % world_size


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``numel`` elements cut into ``world_size`` contiguous ``(start, stop)`` ranges whose
    sizes differ by at most one (the first ``numel % R`` get one more). ``chunk_bounds(7, 3)``
    is ``[(0, 3), (3, 5), (5, 7)]``; with ``numel < R`` some chunks are empty.

    Raises:
        ValueError: ``numel < 0`` or ``world_size < 1``.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(numel, world_size)
    starts = [c * base + min(c, extra) for c in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))
