"""The ring all-reduce: a reduce-scatter, then an all-gather, built from point-to-point messages.

``R`` ranks stand in a ring; each talks only to its neighbours, sending right to ``rank + 1``
and receiving from the left, ``rank - 1``. The tensor is cut into ``R`` chunks. In each of
``2(R - 1)`` steps every rank sends one chunk and receives one, at the same time, so every link
is busy in both directions. The whole schedule is one formula: at step ``s`` rank ``r``

    sends chunk ``(r - s) mod R``  and receives chunk ``(r - s - 1) mod R``

(what ``r`` receives is what its left neighbour sends, and it forwards it at the next step).

1. **Reduce-scatter** (steps ``0 .. R-2``): the received chunk is *added* to the local copy.
   Each chunk travels once round the ring gathering a contribution from every rank; after
   ``R - 1`` steps rank ``r`` holds chunk ``(r + 1) mod R`` summed over all ranks.
2. **All-gather** (steps ``R-1 .. 2R-3``): the received chunk, already complete, *replaces*
   the local copy, until every rank holds every summed chunk.

Each rank sends ``2(R-1)/R`` of the tensor in all: under twice its size whatever ``R`` is, which
is why the ring is bandwidth-optimal (P. Patarasuk and X. Yuan, J. Parallel Distrib. Comput.
69(2), 2009; A. Gibiansky, "Bringing HPC techniques to deep learning", Baidu Research, 2017).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_all_reduce", "ring_send_chunk", "ring_recv_chunk", "chunk_bounds"]


def ring_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """Sum (``op=SUM``) or average (``op=AVG``) ``tensor`` over the ranks, in place, on a ring.

    A collective: every rank of ``group`` (None: the default group) must call it with a
    contiguous tensor of the same shape and dtype; it returns when this rank has done its
    ``2(R-1)`` exchanges. AVG is SUM, then one division by ``R`` (gloo's rule; floats only).
    Returns ``tensor``. Floats agree with ``dist.all_reduce`` up to the order of additions.

    Raises:
        ValueError: an ``op`` other than SUM and AVG (``ddp_lesson.collectives`` has them all).
    """
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"the core ring does SUM and AVG only, not {op}")
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    right, left = to_global((rank + 1) % R), to_global((rank - 1) % R)
    flat = tensor.view(-1)                       # chunks are ranges of the flat view
    bounds = chunk_bounds(flat.numel(), R)
    for step in range(2 * (R - 1)):
        s0, s1 = bounds[ring_send_chunk(rank, step, R)]
        r0, r1 = bounds[ring_recv_chunk(rank, step, R)]
        incoming = torch.empty(r1 - r0, dtype=flat.dtype, device=flat.device)
        reqs = []
        if s1 > s0:                              # an empty chunk (numel < R) sends nothing
            reqs.append(dist.isend(flat[s0:s1], dst=right, group=group, tag=step))
        if r1 > r0:
            reqs.append(dist.irecv(incoming, src=left, group=group, tag=step))
        for req in reqs:                         # both done before the chunks are touched
            req.wait()
        if step < R - 1:
            flat[r0:r1] += incoming              # reduce-scatter: add the partial sum
        else:
            flat[r0:r1] = incoming               # all-gather: take the finished chunk
    if op == dist.ReduceOp.AVG:
        flat /= R
    return tensor


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
