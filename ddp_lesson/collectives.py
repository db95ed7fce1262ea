"""All-reduce from point-to-point messages beside the core ring: a pipelined ring, a naive one.

Run the check against torch's own all_reduce on 3 CPU processes::

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.collectives_check

* :func:`ring_all_reduce` is :func:`ddp_lesson.core.ring.ring_all_reduce`, the one ring loop
  (every op, dtype checks, groups, odd world sizes), and :func:`ring_reduce_scatter` runs its
  first half.
* :func:`pipelined_ring_all_reduce` — the ring's schedule with each chunk cut into pieces,
  each forwarded as soon as it has been reduced (what NCCL and gloo do in C++).
* :func:`naive_all_reduce` — through rank 0: rank 0's link carries 2(R-1) full tensors.
* :func:`simulate_ring_all_reduce` — the ring in pure Python, for the stepper widget.

Sources: P. Patarasuk and X. Yuan, J. Parallel Distrib. Comput. 69(2), 2009 (the ring is
bandwidth-optimal); A. Gibiansky, Baidu Research, 2017 (the ring for data-parallel training);
R. Thakur, R. Rabenseifner and W. Gropp, IJHPCA 19(1), 2005 (the alpha-beta costs, in
:mod:`ddp_lesson.cost_model`). Every all-reduce here is a collective: all ranks of the group
call it with tensors of the same shape and dtype and the same ``op`` (and ``piece_numel``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .core.ring import chunk_bounds, combine_fn, ring_all_reduce, ring_recv_chunk, ring_send_chunk

__all__ = [
    "chunk_bounds", "piece_bounds", "ring_send_chunk", "ring_recv_chunk",
    "ring_all_reduce", "pipelined_ring_all_reduce", "naive_all_reduce", "ring_reduce_scatter",
    "holdings_line", "format_values", "RingState", "simulate_ring_all_reduce",
    "default_piece_numel",
]


def piece_bounds(start: int, stop: int, piece_numel: int) -> list[tuple[int, int]]:
    """Cut the chunk ``[start, stop)`` into pieces of ``piece_numel`` elements (the last may
    be shorter): ``piece_bounds(10, 15, 2) == [(10, 12), (12, 14), (14, 15)]``.

    Raises:
        ValueError: ``piece_numel < 1``.
    """
    if piece_numel < 1:
        raise ValueError(f"piece_numel must be >= 1, got {piece_numel}")
    return [(a, min(a + piece_numel, stop)) for a in range(start, stop, piece_numel)]


# ----------------------------------------------------------------------------- group plumbing


def _world(group) -> tuple[int, int, int, int]:
    """(rank, world_size, global rank of the left neighbour, global rank of the right one)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # no group: torch's error
    if rank < 0:
        raise ValueError("this process is not a member of the group it was given")

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return rank, world_size, glob((rank - 1) % world_size), glob((rank + 1) % world_size)


def _flat_view(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous 1-D tensor to work on, and the contiguous tensor it views."""
    work = tensor.contiguous()            # tensor itself when already contiguous
    return work.view(-1), work


# Receive buffers are kept between calls: a fresh multi-MiB allocation costs a page fault per
# 4 KiB page on first touch, which on a small CPU machine takes longer than the transfer.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A reusable 1-D buffer of at least ``numel`` elements (contents undefined)."""
    key = (dtype, str(device), slot)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf[:numel]


def _tag(step: int, piece: int = 0, pieces_per_step: int = 1) -> int:
    # gloo matches a receive to a send by (peer, tag): a distinct tag per message keeps
    # pieces that are in flight at the same time from ever being confused.
    return step * pieces_per_step + piece


# ----------------------------------------------------------------------------- ring


def ring_reduce_scatter(tensor: torch.Tensor, op=dist.ReduceOp.SUM,
                        group=None) -> tuple[int, int]:
    """The ring's first half (:func:`ring_all_reduce` with ``all_gather=False``), in place; a
    collective. Returns the flat ``(start, stop)`` of the chunk this rank holds reduced, chunk
    ``(rank + 1) mod R`` (``dist.reduce_scatter`` gives rank ``r`` chunk ``r``: a relabelling).

    Raises:
        ValueError: a non-contiguous ``tensor``; otherwise as :func:`ring_all_reduce`.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_reduce_scatter needs a contiguous tensor")
    ring_all_reduce(tensor, op, group, all_gather=False)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return chunk_bounds(tensor.numel(), world_size)[(rank + 1) % world_size]


#: The pipelined ring's default: each chunk in this many pieces ...
DEFAULT_PIECES_PER_CHUNK = 4
#: ... of at least this many elements (256 KiB of float32): smaller pieces cost more in
#: per-message overhead than they gain in overlap (see benchmarks/allreduce.csv).
MIN_PIECE_NUMEL = 64 * 1024


def default_piece_numel(numel: int, world_size: int) -> int:
    """The pipelined ring's piece size (elements), the same on every rank:
    ``max(ceil(chunk / 4), 65536)``, ``chunk = ceil(numel / world_size)``."""
    chunk = -(-numel // max(world_size, 1))
    return max(-(-chunk // DEFAULT_PIECES_PER_CHUNK), MIN_PIECE_NUMEL, 1)


def pipelined_ring_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                              piece_numel: int | None = None) -> torch.Tensor:
    """Ring all-reduce with every chunk cut into pieces that flow round the ring independently.

    Same schedule as :func:`ring_all_reduce`, but a piece is forwarded as soon as it has been
    received and reduced: receiving piece k+1, adding k and sending k-1 overlap, as NCCL's
    slices and gloo's segments do. The next step's receives are posted before this step's
    pieces are waited for; two chunk-sized receive buffers per rank, reused between calls.

    Args:
        tensor, op, group: as for :func:`ring_all_reduce`.
        piece_numel: elements per piece (the same on every rank); None:
            :func:`default_piece_numel`. Small pieces overlap better, pay latency more often.

    Returns:
        ``tensor``, reduced in place, bit-identical to :func:`ring_all_reduce` (same order).

    Raises:
        as :func:`ring_all_reduce`; ValueError for ``piece_numel < 1``.

    Synchronisation: yes — a collective.
    """
    combine = combine_fn(tensor, op)
    if piece_numel is not None and piece_numel < 1:
        raise ValueError(f"piece_numel must be >= 1, got {piece_numel}")
    rank, world_size, left, right = _world(group)
    flat, work = _flat_view(tensor)
    if piece_numel is None:
        piece_numel = default_piece_numel(flat.numel(), world_size)
    n_steps = 2 * (world_size - 1)
    if world_size > 1 and flat.numel() > 0:
        bounds = chunk_bounds(flat.numel(), world_size)
        pieces = [piece_bounds(a, b, piece_numel) for a, b in bounds]
        max_pieces = max(len(p) for p in pieces)
        longest = max(b - a for a, b in bounds)
        bufs = [_scratch(longest, flat.dtype, flat.device, slot) for slot in (0, 1)]
        sends: dict[tuple[int, int], object] = {}   # (step, piece) -> send request

        def recv_target(step: int, k: int) -> torch.Tensor:
            c = ring_recv_chunk(rank, step, world_size)
            a, b = pieces[c][k]
            if step < world_size - 1:           # reduce-scatter: into a buffer, then added
                c0 = bounds[c][0]
                return bufs[step % 2][a - c0: b - c0]
            # all-gather: straight into the tensor. This chunk left this rank as a send at
            # reduce-scatter step j = step - (R-1); that send must be done before we overwrite.
            req = sends.pop((step - (world_size - 1), k), None)
            if req is not None:
                req.wait()
            return flat[a:b]

        def post_recv(step: int, k: int):
            return dist.irecv(recv_target(step, k), src=left, group=group,
                              tag=_tag(step, k, max_pieces))

        def post_send(step: int, k: int) -> None:
            a, b = pieces[ring_send_chunk(rank, step, world_size)][k]
            sends[(step, k)] = dist.isend(flat[a:b], dst=right, group=group,
                                          tag=_tag(step, k, max_pieces))

        def n_recv_pieces(step: int) -> int:
            return len(pieces[ring_recv_chunk(rank, step, world_size)])

        recvs = {(0, k): post_recv(0, k) for k in range(n_recv_pieces(0))}
        for k in range(len(pieces[ring_send_chunk(rank, 0, world_size)])):
            post_send(0, k)
        for step in range(n_steps):
            c = ring_recv_chunk(rank, step, world_size)
            nxt = step + 1
            n_next = n_recv_pieces(nxt) if nxt < n_steps else 0
            # Post the next step's receives now, so the left neighbour's pieces can flow as
            # soon as it forwards them — unless they land on a chunk whose send may still be
            # in flight (R = 2: the all-gather overwrites the chunk sent at step 0); those are
            # posted piece by piece below, once that piece's send is done.
            if nxt < n_steps and (nxt < world_size - 1 or world_size > 2):
                for k in range(n_next):
                    recvs[(nxt, k)] = post_recv(nxt, k)
            for k, (a, b) in enumerate(pieces[c]):
                recvs.pop((step, k)).wait()
                if step < world_size - 1:
                    c0 = bounds[c][0]
                    flat[a:b] = combine(flat[a:b], bufs[step % 2][a - c0: b - c0])
                if nxt < n_steps:
                    # The piece just finished is the next step's piece k: forward it now,
                    # while the rest of this step's pieces are still arriving.
                    if k < n_next and (nxt, k) not in recvs:
                        recvs[(nxt, k)] = post_recv(nxt, k)
                    post_send(nxt, k)
            for k in range(n_next):  # the next chunk may have one piece more than this one
                if (nxt, k) not in recvs:
                    recvs[(nxt, k)] = post_recv(nxt, k)
        for req in sends.values():
            req.wait()
        _finish_avg_(flat, op, world_size)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce through rank 0 (``isend``/``irecv``): it receives and sends R-1 whole
    tensors, ``2(R-1) · n`` elements on its link against the ring's ``2(R-1)/R · n`` per rank.

    Args, Returns, Raises: as :func:`ring_all_reduce`. Rank 0 reduces the contributions in
    rank order 0, 1, ..., R-1.

    Synchronisation: yes — a collective; ranks other than 0 wait for rank 0's result.
    """
    combine = combine_fn(tensor, op)
    rank, world_size, _, _ = _world(group)
    flat, work = _flat_view(tensor)

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    if world_size > 1 and flat.numel() > 0:
        if rank == 0:
            bufs = {
                r: _scratch(flat.numel(), flat.dtype, flat.device, r) for r in range(1, world_size)
            }
            reqs = {r: dist.irecv(bufs[r], src=glob(r), group=group, tag=_tag(0)) for r in bufs}
            for r in range(1, world_size):
                reqs[r].wait()
                flat.copy_(combine(flat, bufs[r]))
            _finish_avg_(flat, op, world_size)
            for req in [dist.isend(flat, dst=glob(r), group=group, tag=_tag(1)) for r in bufs]:
                req.wait()
        else:
            dist.isend(flat, dst=glob(0), group=group, tag=_tag(0)).wait()
            dist.irecv(flat, src=glob(0), group=group, tag=_tag(1)).wait()
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def _finish_avg_(flat: torch.Tensor, op, world_size: int) -> None:
    if op == dist.ReduceOp.AVG:          # SUM, then one division: gloo's rule, as the core's
        flat.div_(world_size)


def holdings_line(label: str, before, after) -> str:
    """One line of a "who holds what" picture: ``"broadcast    before [0, 0]  after [10, 11]"``
    (tensors, lists or None; :func:`format_values`). Never synchronises."""
    return f"{label:<15} before {format_values(before):<18} after {format_values(after)}"


def format_values(values) -> str:
    """``values`` (tensor, list, number or None) as text the same on every machine: ``[1, 2.5]``
    (whole numbers without a point, others to 4 significant digits), ``-`` for None."""
    if values is None:
        return "-"
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(format_values(v) for v in values) + "]"
    if isinstance(values, float) and values.is_integer():
        return str(int(values))
    if isinstance(values, float):
        return f"{values:.4g}"
    return str(values)


# ----------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class RingState:
    """Every rank's chunks after ``step`` (``0 .. 2(R-1)``) steps of the ring, in ``phase``
    ``"start"``, ``"reduce-scatter"`` or ``"all-gather"``: ``values[rank][chunk]`` the numbers
    held, ``contributors[rank][chunk]`` the ranks summed in them, ``moves`` the step's messages
    ``(src, dst, chunk)``."""

    step: int
    phase: str
    values: tuple
    contributors: tuple
    moves: tuple

    @property
    def world_size(self) -> int:
        return len(self.values)


def _default_values(world_size: int) -> list[list[float]]:
    # rank r holds 1..R scaled by 10^r: the sum reads digit by digit (R=3: 111, 222, 333)
    return [[float((c + 1) * 10 ** r) for c in range(world_size)] for r in range(world_size)]


def simulate_ring_all_reduce(world_size: int = 3, values=None) -> list[RingState]:
    """Play the ring sum all-reduce in pure Python and return the state after every step.

    ``values[rank]``: that rank's numbers (same length on every rank); default: rank r holds
    ``[1, 2, ..., R] · 10^r``.

    Returns:
        ``2(R-1) + 1`` :class:`RingState` objects (step 0 = inputs; the last: every rank holds
        every chunk's full sum).

    Raises:
        ValueError: ``world_size < 1`` or ``values`` of the wrong shape.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if values is None:
        values = _default_values(world_size)
    if len(values) != world_size:
        raise ValueError(f"values has {len(values)} ranks, world_size is {world_size}")
    numel = len(values[0])
    if any(len(v) != numel for v in values):
        raise ValueError("every rank needs the same number of values")
    bounds = chunk_bounds(numel, world_size)
    held = [[list(values[r][a:b]) for a, b in bounds] for r in range(world_size)]
    who = [[frozenset([r]) for _ in bounds] for r in range(world_size)]

    def snapshot(step: int, phase: str, moves) -> RingState:
        return RingState(step, phase,
                         tuple(tuple(tuple(c) for c in row) for row in held),
                         tuple(tuple(row) for row in who), tuple(moves))

    states = [snapshot(0, "start", ())]
    for step in range(2 * (world_size - 1)):
        reduce_phase = step < world_size - 1
        # every rank sends simultaneously: read all outgoing messages first
        msgs = []
        for r in range(world_size):
            c = ring_send_chunk(r, step, world_size)
            msgs.append(((r + 1) % world_size, c, list(held[r][c]), who[r][c], r))
        moves = []
        for dst, c, data, contrib, src in msgs:
            if reduce_phase:
                held[dst][c] = [x + y for x, y in zip(held[dst][c], data)]
                who[dst][c] = who[dst][c] | contrib
            else:
                held[dst][c] = data
                who[dst][c] = contrib
            moves.append((src, dst, c))
        states.append(snapshot(step + 1, "reduce-scatter" if reduce_phase else "all-gather", moves))
    return states
