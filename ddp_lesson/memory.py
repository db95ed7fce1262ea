"""Memory per rank for mixed-precision Adam training under DDP and ZeRO stages 1, 2 and 3.

The model-state accounting of the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", Section 3.1 and Figure 1). With
``Psi`` parameters and mixed-precision Adam, every parameter costs:

* 2 bytes for its fp16/bf16 copy (used in forward and backward),
* 2 bytes for its fp16/bf16 gradient,
* ``K = 12`` bytes of optimizer state: an fp32 master copy (4), Adam's first moment (4)
  and second moment (4).

DDP keeps all of it on every rank: ``(2 + 2 + K) * Psi = 16 Psi`` bytes. ZeRO partitions it
across the ``N = world_size`` ranks, one more piece per stage:

=========  ===========================  =====================================
stage      what is partitioned          bytes per rank
=========  ===========================  =====================================
0 (DDP)    nothing                      ``(2 + 2 + K) Psi``
1 (P_os)   optimizer states             ``(2 + 2) Psi + K Psi / N``
2 (P_os+g) + gradients                  ``2 Psi + (2 + K) Psi / N``
3 (P_all)  + parameters                 ``(2 + 2 + K) Psi / N``
=========  ===========================  =====================================

The paper's example, 7.5B parameters on 64 ranks: 120 GB, 31.4 GB, 16.6 GB and 1.88 GB per
rank (GB = 1e9 bytes). Each rank also keeps its own micro-batch's activations at every stage
(:func:`saved_activation_bytes` measures them); the decision rule: :func:`per_rank_bytes`
``<= M`` fits a GPU of M bytes (temporary buffers and fragmentation not counted). Pure
arithmetic, no process group, but for the local measurements at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GB", "GIB", "STAGES", "STAGE_NAMES", "MemoryBreakdown", "memory_per_rank",
           "max_params_per_memory", "per_rank_bytes", "smallest_stage",
           "decision_lines", "local_bytes", "optimizer_state_bytes", "saved_activation_bytes",
           "checkpoint_blocks"]

#: The paper's unit: 1 GB = 1e9 bytes.
GB = 1e9
#: The binary unit GPUs report (1 GiB = 2**30 bytes).
GIB = 2 ** 30
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Model-state bytes one rank holds: 16-bit parameters (sharded at stage 3), 16-bit
    gradients (from stage 2), master weights and Adam moments (from stage 1)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        """Sum of the three parts, in bytes."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def _check(num_params, world_size, stage, activation_bytes=0):
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stage not in STAGES:
        raise ValueError(f"stage {stage} is not one of {STAGES} (0 = DDP)")


def memory_per_rank(num_params: float, world_size: int, stage: int, param_bytes: float = 2,
                    grad_bytes: float = 2, optimizer_bytes: float = 12) -> MemoryBreakdown:
    """Model-state memory of one rank, in bytes (ZeRO paper, Section 3.1 and Figure 1).

    ``num_params`` ``Psi`` of the whole model over ``world_size`` ``N`` ranks at ``stage`` (the
    table above); bytes per parameter of its forward copy and gradient (2: fp16/bf16) and of
    optimizer state (``K`` = 12 for mixed-precision Adam).

    Returns:
        A :class:`MemoryBreakdown`; ``.total_bytes`` is the paper's figure (exact division:
        real shards differ by at most one element per tensor).

    Raises:
        ValueError: ``num_params < 0``, ``world_size < 1`` or an unknown stage.
    """
    _check(num_params, world_size, stage)
    p = param_bytes * num_params
    g = grad_bytes * num_params
    o = optimizer_bytes * num_params
    n = world_size
    return MemoryBreakdown(params_bytes=p / n if stage >= 3 else p,
                           grads_bytes=g / n if stage >= 2 else g,
                           optimizer_bytes=o / n if stage >= 1 else o)


def max_params_per_memory(memory_bytes: float, world_size: int, stage: int,
                          param_bytes: float = 2, grad_bytes: float = 2,
                          optimizer_bytes: float = 12) -> float:
    """Largest ``Psi`` whose model states fit in ``memory_bytes`` per rank (activations
    ignored), :func:`memory_per_rank` inverted: 80e9 bytes with DDP: 80e9 / 16 = 5e9."""
    per_param = memory_per_rank(1, world_size, stage, param_bytes, grad_bytes,
                                optimizer_bytes).total_bytes
    return memory_bytes / per_param


def per_rank_bytes(num_params: float, activation_bytes: float, world_size: int, stage: int,
                   **bytes_per_param) -> float:
    """Bytes one rank needs: :func:`memory_per_rank`'s model states plus ``activation_bytes``,
    the activations of this rank's micro-batch, which no stage divides by ``world_size``.

    ``bytes_per_param``: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` as for
    :func:`memory_per_rank` (default mixed-precision Adam, 2 + 2 + 12). Raises ``ValueError``
    as it does, or for ``activation_bytes < 0``.
    """
    _check(num_params, world_size, stage, activation_bytes)
    return memory_per_rank(num_params, world_size, stage, **bytes_per_param).total_bytes + \
        activation_bytes


def smallest_stage(num_params: float, activation_bytes: float, world_size: int,
                   memory_bytes: float, **bytes_per_param) -> int | None:
    """The decision rule: the lowest stage (0 = DDP, 3 = FSDP) whose :func:`per_rank_bytes`
    fit in ``memory_bytes`` per GPU, or None when none does (more GPUs, a smaller micro-batch
    or activation checkpointing are then needed)."""
    return next((s for s in STAGES if per_rank_bytes(num_params, activation_bytes, world_size,
                                                     s, **bytes_per_param) <= memory_bytes),
                None)


def decision_lines(num_params: float, activation_bytes: float, world_size: int,
                   memory_bytes: float, **bytes_per_param) -> list[str]:
    """The calculator's text: GB per rank at every stage against ``memory_bytes``, then the
    stage to use (:func:`smallest_stage`). GB = 1e9 bytes."""
    lines = [f"{num_params / 1e9:g}B parameters, {activation_bytes / GB:g} GB of activations "
             f"per rank, {world_size} GPUs of {memory_bytes / GB:g} GB"]
    for s in STAGES:
        need = per_rank_bytes(num_params, activation_bytes, world_size, s, **bytes_per_param)
        lines.append(f"{STAGE_NAMES[s]:18s} {need / GB:8.2f} GB per rank: "
                     f"{'fits' if need <= memory_bytes else 'does not fit'}")
    best = smallest_stage(num_params, activation_bytes, world_size, memory_bytes,
                          **bytes_per_param)
    lines.append("use: " + (STAGE_NAMES[best] if best is not None else
                            "none fits: more GPUs, a smaller micro-batch or checkpointing"))
    return lines


# ------------------------------------------------------------------ measured, in this process

def local_bytes(t) -> int:
    """Bytes of ``t`` held by this rank: a ``DTensor``'s local shard, else the whole tensor."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer) -> int:
    """Measured bytes of the tensors in ``optimizer.state`` (Adam's ``exp_avg``,
    ``exp_avg_sq``, ``step``); for ZeRO-1 or FSDP, this rank's shard. Local."""
    return sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
               if hasattr(v, "element_size"))


def saved_activation_bytes(forward, params=()) -> tuple[int, object]:
    """Run ``forward()`` and measure the bytes autograd saves for backward meanwhile.

    Each storage passing ``torch.autograd.graph.saved_tensors_hooks``'s pack hook counts once
    (views share it), those of ``params`` (not activations) not at all; a block under
    :func:`checkpoint_blocks` saves only its input. Returns ``(bytes, forward's result)``.
    Local; CPU or GPU.
    """
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return sum(seen.values()), out


def checkpoint_blocks(blocks) -> None:
    """Activation checkpointing (``torch.utils.checkpoint.checkpoint``, ``use_reentrant=False``)
    on every module of ``blocks``, in place: forward keeps each block's input only, backward
    recomputes the block's activations (one more forward per block)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
