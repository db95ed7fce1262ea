"""Memory and data movement per rank under DDP, ZeRO and FSDP (notebook 08)."""
from __future__ import annotations

from .style import LABEL_PT, MIN_WIDTH_IN, SMALL_PT, finish, subplots

__all__ = ["memory_stages_figure", "data_movement_per_step", "data_movement_figure"]


def memory_stages_figure(num_params: float, world_size: int, capacity_bytes: float | None = None,
                         figsize=(6, 3), **kwargs):
    """Model-state memory per rank under DDP and ZeRO stages 1-3, as stacked bars (GB = 1e9 B).

    Args:
        num_params: parameters ``Psi`` of the model.
        world_size: ranks ``N``.
        capacity_bytes: optional device memory, drawn as a dashed line (e.g. 80e9).
        figsize: inches.
        **kwargs: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` for
            :func:`ddp_lesson.memory.memory_per_rank`.

    Returns:
        The ``Figure`` (one Axes); each bar patch has ``gid`` ``"params"``, ``"grads"`` or
        ``"optimizer"``, heights in GB. Pure arithmetic, no process group.
    """

    from ..memory import GB, STAGE_NAMES, STAGES, memory_per_rank

    parts = [memory_per_rank(num_params, world_size, s, **kwargs) for s in STAGES]
    names = [STAGE_NAMES[s].replace(" (", "\n(") for s in STAGES]
    fig, ax = subplots(figsize=figsize)
    bottom = [0.0] * len(parts)
    for attr, label, colour in (("params_bytes", "parameters (16-bit)", "tab:blue"),
                                ("grads_bytes", "gradients (16-bit)", "tab:orange"),
                                ("optimizer_bytes", "optimizer states (K bytes)", "tab:green")):
        h = [getattr(m, attr) / GB for m in parts]
        bars = ax.bar(range(len(parts)), h, bottom=bottom, color=colour, label=label)
        for bar in bars:
            bar.set_gid(attr.replace("_bytes", ""))
        bottom = [b + x for b, x in zip(bottom, h)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.3g} GB", ha="center", va="bottom", fontsize=SMALL_PT)
    if capacity_bytes is not None:
        ax.axhline(capacity_bytes / GB, color="red", linestyle="--", linewidth=1,
                   label=f"device memory {capacity_bytes / GB:g} GB")
    ax.set_xticks(range(len(parts)))
    ax.set_xticklabels(names, fontsize=SMALL_PT)
    ax.set_ylabel("GB per rank (1e9 bytes)", fontsize=SMALL_PT)
    ax.set_ylim(0, max(bottom) * 1.15)
    ax.set_title(f"{num_params / 1e9:g}B parameters, {world_size} ranks, model states only",
                 fontsize=LABEL_PT)
    ax.tick_params(labelsize=SMALL_PT)
    ax.legend(fontsize=SMALL_PT, frameon=False)
    return finish(fig)


def data_movement_per_step(world_size: int) -> dict[str, list[tuple[str, float]]]:
    """Bytes one rank sends per training step, in units of the parameter bytes, ring model.

    An all-gather or a reduce-scatter of a tensor of ``Psi`` bytes sends ``(R-1)/R * Psi``
    per rank, an all-reduce twice that (notebook 03); broadcasting each owner's ``1/R`` of
    the parameters makes every rank receive ``(R-1)/R * Psi``. Gradients and parameters are
    assumed the same dtype. Pure arithmetic.

    Returns:
        scheme -> [(collective, units), ...]: DDP (all-reduce), ZeRO-1 as in this series and in
        torch's ``ZeroRedundancyOptimizer`` (all-reduce, then a broadcast of the parameters),
        ZeRO-1 as in the paper (reduce-scatter, all-gather), FSDP / ZeRO-3 (all-gather in
        forward, again in backward, reduce-scatter).
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
