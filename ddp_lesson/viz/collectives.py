"""The ring all-reduce and the collectives' bandwidth (notebook 03): measured bus bandwidth,
the alpha-beta cost model, the ring's states as panels, and one ring state as text and HTML
(for :func:`ddp_lesson.widgets.ring_allreduce_stepper`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .style import LABEL_PT, MIN_WIDTH_IN, SMALL_PT, finish, subplots

__all__ = ["allreduce_bandwidth_figure", "cost_model_figure", "ring_allreduce_steps_figure",
           "ring_state_text", "ring_state_html"]

if TYPE_CHECKING:  # for the annotations only: importing collectives imports torch
    from ..collectives import RingState


_METHOD_STYLE = {
    "gloo": dict(color="tab:blue", marker="o", label="gloo all_reduce"),
    "ring": dict(color="tab:orange", marker="s", label="ring (send/recv)"),
    "pipelined": dict(color="tab:green", marker="^", label="pipelined ring"),
    "naive": dict(color="tab:red", marker="v", label="naive (via rank 0)"),
    "sendrecv": dict(color="grey", linestyle="--", marker="", label="send/recv, 2 ranks"),
    "shift": dict(color="grey", linestyle=":", marker="", label="shift, all ranks"),
}


def _size_label(nbytes: float) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes:g} B"


def allreduce_bandwidth_figure(rows, figsize=(MIN_WIDTH_IN, 3.8)):
    """Bus bandwidth against message size, one panel per process count
    (``benchmarks/allreduce.csv``).

    All-reduces are drawn as bus bandwidth (algbw · 2(R-1)/R, nccl-tests' PERFORMANCE.md), to
    read against the link: grey lines are the measured send/recv bandwidth per direction
    (dashed: ranks 0 and 1 alone; dotted: every rank at once). Lines join the medians; shaded
    bands span min..max (where the rows have ``busbw_GBps_min``/``_max``).

    Args:
        rows: dicts as :func:`ddp_lesson.bench.allreduce.read_results` returns.
        figsize: inches.

    Returns:
        The ``Figure`` (one Axes per process count; the legend below them).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no benchmark rows to draw")
    nprocs = sorted({r["nprocs"] for r in rows})
    fig, axes = subplots(1, len(nprocs), figsize=figsize, sharey=True, squeeze=False)
    lo = min((r["size_bytes"] for r in rows if r["method"] not in ("sendrecv", "shift")),
             default=0)
    for ax, R in zip(axes[0], nprocs):
        for method, style in _METHOD_STYLE.items():
            pts = sorted((r["size_bytes"], r["busbw_GBps"], r.get("busbw_GBps_min"),
                          r.get("busbw_GBps_max")) for r in rows
                         if r["nprocs"] == R and r["method"] == method and r["size_bytes"] >= lo)
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1] for p in pts], linewidth=1.3, markersize=4,
                    label=style["label"] if R == nprocs[0] else None,
                    **{k: v for k, v in style.items() if k != "label"})
            if all(p[2] is not None and p[3] is not None for p in pts):
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts],
                                color=style["color"], alpha=0.15, linewidth=0, gid="spread")
        cpus = max(r["cpus"] for r in rows if r["nprocs"] == R)
        note = f" ({R} procs on {cpus} cores)" if R > cpus else ""
        ax.set_title(f"R = {R}{note}", fontsize=LABEL_PT)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["size_bytes"] for r in rows
                        if r["nprocs"] == R and r["size_bytes"] >= lo})
        ax.set_xticks(ticks, [_size_label(t) for t in ticks], rotation=45, fontsize=SMALL_PT)
        ax.minorticks_off()
        ax.set_xlabel("tensor size", fontsize=LABEL_PT)
        ax.tick_params(labelsize=SMALL_PT)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)", fontsize=LABEL_PT)
    fig.legend(loc="lower center", ncol=3, fontsize=SMALL_PT, frameon=False)
    return finish(fig, rect=(0, 0.16, 1, 1))


def cost_model_figure(rows, figsize=(MIN_WIDTH_IN, 3.8)):
    """The α-β model of naive, tree and ring all-reduce against measured all-reduce times.

    α and β are fitted to the two-rank send/recv times
    (:func:`ddp_lesson.cost_model.fit_alpha_beta`); the model's curves are drawn per process
    count with the measured times of gloo, the ring and the pipelined ring as points.

    Args:
        rows: dicts as :func:`ddp_lesson.bench.allreduce.read_results` returns (with
            ``sendrecv`` rows).
        figsize: inches.

    Returns:
        The ``Figure``; ``fig.alpha_beta`` holds the fitted ``(alpha_s, beta_s_per_byte)``.

    Raises:
        ValueError: no send/recv rows to fit.
    """
    import numpy as np

    from ..cost_model import (
        fit_alpha_beta,
        naive_allreduce_time,
        ring_allreduce_time,
        tree_allreduce_time,
    )

    link = [r for r in rows if r["method"] == "sendrecv"]
    if not link:
        raise ValueError("no send/recv rows: run the benchmark with the sendrecv method")
    fit_R = min(r["nprocs"] for r in link)
    link = [r for r in link if r["nprocs"] == fit_R]
    alpha, beta = fit_alpha_beta([r["size_bytes"] for r in link], [r["seconds"] for r in link])
    nprocs = sorted({r["nprocs"] for r in rows})
    fig, axes = subplots(1, len(nprocs), figsize=figsize, sharey=True, squeeze=False)
    sizes = np.logspace(10, 27, 60, base=2)
    for ax, R in zip(axes[0], nprocs):
        for fn, name, style in ((naive_allreduce_time, "naive model", "r-"),
                                (tree_allreduce_time, "tree model", "m-."),
                                (ring_allreduce_time, "ring model", "k-")):
            ax.plot(sizes, [fn(s, R, alpha, beta) * 1e3 for s in sizes], style, linewidth=1,
                    label=name if R == nprocs[0] else None)
        for method in ("gloo", "ring", "pipelined", "naive"):
            pts = sorted((r["size_bytes"], r["seconds"], r.get("seconds_min", r["seconds"]),
                          r.get("seconds_max", r["seconds"])) for r in rows
                         if r["nprocs"] == R and r["method"] == method)
            if pts:
                st = _METHOD_STYLE[method]
                y = [p[1] * 1e3 for p in pts]
                ax.errorbar([p[0] for p in pts], y, fmt="none", ecolor=st["color"], alpha=0.6,
                            yerr=[[v - p[2] * 1e3 for v, p in zip(y, pts)],
                                  [p[3] * 1e3 - v for v, p in zip(y, pts)]])
                ax.scatter([p[0] for p in pts], y, s=14, color=st["color"], marker=st["marker"],
                           label=st["label"] if R == nprocs[0] else None, zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"R = {R}", fontsize=LABEL_PT)
        ax.set_xlabel("tensor size (bytes)", fontsize=SMALL_PT)
        ax.tick_params(labelsize=SMALL_PT)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("time per all-reduce (ms)", fontsize=SMALL_PT)
    fig.legend(loc="lower center", ncol=4, fontsize=SMALL_PT, frameon=False)
    fig.suptitle(f"α = {alpha * 1e6:.0f} µs, 1/β = {1 / beta / 1e9:.2f} GB/s "
                 f"(fitted to send/recv medians, R = {fit_R}; bars: min..max)", fontsize=LABEL_PT)
    finish(fig, rect=(0, 0.14, 1, 1))
    fig.alpha_beta = (alpha, beta)
    return fig


def ring_allreduce_steps_figure(world_size: int = 3, figsize=None):
    """The ring all-reduce step by step: reduce-scatter, then all-gather.

    One panel per state of :func:`ddp_lesson.collectives.simulate_ring_all_reduce` (step 0,
    the inputs, then the 2(R-1) steps); a row per rank, a column per chunk, each cell its value
    and, after Σ, the ranks summed into it. Grey: own input only; yellow: partly summed; green:
    summed over every rank; a thick border: arrived this step. Under each panel, the step's
    messages (``r0→r1 c0``: rank 0 sent chunk 0 to rank 1).

    Args:
        world_size: R, 2 to 6.
        figsize: inches; default about 2 per panel, at least
            :data:`~ddp_lesson.viz.style.MIN_WIDTH_IN`.

    Returns:
        The ``Figure``; ``fig.axes[k]`` is step k, titled with its phase.

    Raises:
        ValueError: ``world_size`` outside 2..6.
    """
    from matplotlib.patches import Rectangle

    from ..collectives import simulate_ring_all_reduce

    if not 2 <= world_size <= 6:
        raise ValueError(f"world_size must be in 2..6 for a readable figure, got {world_size}")
    states = simulate_ring_all_reduce(world_size)
    R = world_size
    colours = {"own": "#d9d9d9", "partial": "#ffe08a", "full": "#8fd18f"}
    fig, axes = subplots(1, len(states), squeeze=False,
                         figsize=figsize or (max(MIN_WIDTH_IN, 2.0 * len(states)),
                                            1.3 + 0.6 * R))
    for ax, state in zip(axes[0], states):
        arrived = {(dst, c) for _, dst, c in state.moves}
        for r in range(R):
            for c in range(R):
                who = state.contributors[r][c]
                kind = "full" if len(who) == R else "own" if who == {r} else "partial"
                bold = (r, c) in arrived
                ax.add_patch(Rectangle((c, R - 1 - r), 1, 1, facecolor=colours[kind],
                                       edgecolor="black", linewidth=2.5 if bold else 0.6))
                value = "/".join(f"{v:g}" for v in state.values[r][c])
                ax.text(c + 0.5, R - 0.5 - r, f"{value}\nΣ{''.join(map(str, sorted(who)))}",
                        ha="center", va="center", fontsize=SMALL_PT)
        ax.set_xlim(0, R)
        ax.set_ylim(0, R)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(R)], [f"c{c}" for c in range(R)])
        ax.set_yticks([R - 0.5 - r for r in range(R)],
                      [f"rank {r}" if ax is axes[0][0] else "" for r in range(R)])
        ax.tick_params(length=0, labelsize=SMALL_PT)
        phase = "inputs" if state.step == 0 else state.phase
        ax.set_title(f"step {state.step}: {phase}", fontsize=LABEL_PT)
        moves = [f"r{s}→r{d} c{c}" for s, d, c in state.moves]  # two messages a line
        ax.set_xlabel("\n".join(", ".join(moves[i:i + 2]) for i in range(0, len(moves), 2))
                      or "(nothing sent)", fontsize=SMALL_PT)
    return finish(fig)


# ------------------------------------------------ one ring state, as text and HTML (the stepper)


def _numbers(values) -> str:
    """``(1.0, 2.5)`` -> ``"[1, 2.5]"``, as :func:`ddp_lesson.collectives.holdings_line`
    writes numbers (the stepper and notebook 03's holdings alike).
    """
    from ..collectives import format_values

    return format_values(list(values))


def _state_title(state: RingState) -> str:
    total = 2 * (state.world_size - 1)
    if state.step == 0:
        return f"step 0 of {total}: inputs, nothing sent yet"
    done = " (done: every rank holds the full sum)" if state.step == total else ""
    return f"step {state.step} of {total}: {state.phase}{done}"


def ring_state_text(state: RingState) -> str:
    """One :class:`~ddp_lesson.collectives.RingState` as text: a row per rank, a column per
    chunk, each cell the chunk's numbers and, after ``Σ``, the ranks summed into it.
    """
    lines = [_state_title(state)]
    if state.moves:
        lines.append("moves: " + ", ".join(f"r{s}->r{d} c{c}" for s, d, c in state.moves))
    for r, row in enumerate(state.values):
        cells = []
        for c, vals in enumerate(row):
            contrib = "".join(str(i) for i in sorted(state.contributors[r][c]))
            cells.append(f"c{c}={_numbers(vals)} Σ{contrib}")
        lines.append(f"rank {r}: " + "  ".join(cells))
    return "\n".join(lines)


def ring_state_html(state: RingState) -> str:
    """One :class:`~ddp_lesson.collectives.RingState` as an HTML table (the stepper's picture):
    green, summed over every rank; yellow, partly; grey, own input; bold border, arrived now.
    """
    full = frozenset(range(state.world_size))
    arrived = {(d, c) for _, d, c in state.moves}
    head = "".join(f"<th style='padding:2px 8px'>chunk {c}</th>"
                   for c in range(len(state.values[0])))
    rows = []
    for r, row in enumerate(state.values):
        cells = []
        for c, vals in enumerate(row):
            contrib = state.contributors[r][c]
            color = "#b7e4b0" if contrib == full else ("#ffe9a8" if len(contrib) > 1 else "#eeeeee")
            border = "2px solid #333" if (r, c) in arrived else "1px solid #ccc"
            label = "+".join(f"r{i}" for i in sorted(contrib))
            cells.append(f"<td style='background:{color};border:{border};padding:2px 8px;"
                         f"text-align:center'>{_numbers(vals)}<br><small>{label}</small></td>")
        rows.append(f"<tr><th style='padding:2px 8px'>rank {r}</th>{''.join(cells)}</tr>")
    moves = ", ".join(f"rank {s} → rank {d}: chunk {c}" for s, d, c in state.moves) or "—"
    return (f"<div><b>{_state_title(state)}</b><br><small>messages: {moves}</small>"
            f"<table style='border-collapse:collapse;margin-top:4px'><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table></div>")
