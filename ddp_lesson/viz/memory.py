"""Data movement per rank under DDP, ZeRO and FSDP (notebook 08's FSDP2 deep dive)."""
from __future__ import annotations

from .style import MIN_WIDTH_IN, SMALL_PT, finish, subplots

__all__ = ["data_movement_per_step", "data_movement_figure"]


def data_movement_per_step(world_size: int) -> dict[str, list[tuple[str, float]]]:
    """Bytes one rank sends per training step, in units of the parameter bytes (ring model).

    An all-gather or reduce-scatter of ``Psi`` bytes sends ``(R-1)/R * Psi`` per rank, an
    all-reduce twice that (notebook 03); broadcasting each owner's ``1/R`` of the parameters,
    ``(R-1)/R * Psi`` received per rank. Gradients and parameters of one dtype. Pure.

    Returns:
        scheme -> [(collective, units), ...]: DDP; ZeRO-1 as here and in torch's
        ``ZeroRedundancyOptimizer`` (all-reduce, broadcast); ZeRO-1 as in the paper
        (reduce-scatter, all-gather); FSDP / ZeRO-3 (all-gather twice, reduce-scatter).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    f = (world_size - 1) / world_size
    return {
        "DDP": [("all-reduce grads", 2 * f)],
        "ZeRO-1 (ours, torch ZeRO)": [("all-reduce grads", 2 * f), ("broadcast params", f)],
        "ZeRO-1 (paper)": [("reduce-scatter grads", f), ("all-gather params", f)],
        "FSDP (ZeRO-3)": [("all-gather params", f), ("all-gather params again (bwd)", f),
                          ("reduce-scatter grads", f)],
    }


def data_movement_figure(world_size: int = 8, figsize=(MIN_WIDTH_IN, 3.4)):
    """Stacked bars of :func:`data_movement_per_step`: what each scheme sends per step.

    Returns:
        The ``Figure``; each scheme's total is written at the end of its bar (text gid
        ``"total:{scheme}"``).
    """
    moves = data_movement_per_step(world_size)
    colours = {"all-reduce grads": "#4c72b0", "broadcast params": "#dd8452",
               "reduce-scatter grads": "#55a868", "all-gather params": "#c44e52",
               "all-gather params again (bwd)": "#e6a0a0"}
    fig, ax = subplots(figsize=figsize)
    names = list(moves)
    seen = set()
    for i, name in enumerate(names):
        left = 0.0
        for what, units in moves[name]:
            ax.barh(i, units, left=left, color=colours[what], edgecolor="white",
                    label=None if what in seen else what)
            seen.add(what)
            left += units
        t = ax.text(left + 0.03, i, f"{left:.2f}", va="center", fontsize=SMALL_PT)
        t.set_gid(f"total:{name}")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 3.3)
    ax.set_xlabel(f"bytes sent per rank per step / parameter bytes (R = {world_size}, ring model)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return finish(fig)
