"""Matplotlib figures used by the notebooks; each function returns a ``matplotlib.figure.Figure``.

Figures are drawn with pyplot (so a notebook cell ends with ``plt.show()`` and the image is
stored as a small PNG); a caller that only wants the picture (a widget, a test) closes the
figure with ``plt.close(fig)``. matplotlib is imported inside the functions, so importing this
module costs nothing.

Sections: sampler figures (notebook 02); collective and ring figures (notebook 03);
training figures: loss curves, predicted masks, the scaling study (notebook 05).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "DPI", "MIN_WIDTH_IN", "SMALL_PT", "LABEL_PT", "TITLE_PT", "subplots", "finish",
    "SamplerLayout",
    "sampler_layout",
    "sampler_heatmap",
    "assignment_over_epochs",
]


# ======================================================================= one style for every figure

#: Every figure is drawn at this resolution (dots per inch) ...
DPI = 100
#: ... and at least this wide (inches): 7.2 in x 100 dpi = 720 px, readable at 100% zoom.
MIN_WIDTH_IN = 7.2
#: The smallest text in any figure (points): tick labels, legends, annotations.
SMALL_PT = 9
#: Axis labels and panel titles.
LABEL_PT = 10
#: Figure titles.
TITLE_PT = 11


def subplots(nrows: int = 1, ncols: int = 1, figsize=(MIN_WIDTH_IN, 3.2), **kwargs):
    """``plt.subplots`` in the series' style: :data:`DPI`, at least :data:`MIN_WIDTH_IN` wide
    (a narrower ``figsize`` is scaled up, keeping its aspect), default font :data:`LABEL_PT`.

    Every figure function of this module starts here and ends with :func:`finish`.
    """
    import matplotlib.pyplot as plt

    w, h = figsize
    if w < MIN_WIDTH_IN:
        w, h = MIN_WIDTH_IN, h * MIN_WIDTH_IN / w
    with plt.rc_context({"font.size": LABEL_PT, "axes.titlesize": LABEL_PT,
                         "axes.labelsize": LABEL_PT, "xtick.labelsize": SMALL_PT,
                         "ytick.labelsize": SMALL_PT, "legend.fontsize": SMALL_PT}):
        return plt.subplots(nrows, ncols, figsize=(w, h), dpi=DPI, **kwargs)


def finish(fig, rect=None):
    """Raise any text below :data:`SMALL_PT` to it (a label set elsewhere at a smaller size),
    then lay the figure out (``tight_layout``, within ``rect`` if given). Returns ``fig``."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < SMALL_PT:
            text.set_fontsize(SMALL_PT)
    fig.tight_layout(**({"rect": rect} if rect else {}))
    return fig


# =========================================================================== sampler figures

@dataclass
class SamplerLayout:
    """Where every dataset index goes in one epoch of a
    :class:`ddp_lesson.sampler.DistributedSampler`.

    Built by :func:`sampler_layout` from the package's pure index functions (no process
    group). Position ``j`` of rank ``r`` is entry ``p = j * R + r`` of the padded global
    order; it is *padding* when ``p >= N`` (a wrapped-round repeat of an earlier index).

    Attributes:
        n: dataset length N.
        num_replicas: world size R.
        num_samples: indices per rank (``len(sampler)`` on every rank).
        total_size: ``num_samples * R``.
        shards: ``shards[r]`` = the indices rank r yields, in order (length num_samples).
        is_padding: ``is_padding[r][j]`` True when ``shards[r][j]`` is a padded repeat.
        padding: the padded (repeated) indices in padded-order position order.
        dropped: indices of the global order cut by ``drop_last=True`` (not seen this epoch).
        order: the global order before padding/cutting (length N).
    """

    n: int
    num_replicas: int
    num_samples: int
    total_size: int
    shards: list[list[int]]
    is_padding: list[list[bool]]
    padding: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)


def sampler_layout(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                   epoch: int = 0, drop_last: bool = False) -> SamplerLayout:
    """Every rank's shard for one epoch, with padding and dropped indices marked.

    Pure index arithmetic from :mod:`ddp_lesson.sampler` (same indices as torch's
    ``DistributedSampler`` with ``set_epoch(epoch)``); no process group, no synchronisation.

    Args:
        n: dataset length N, ``>= 0``.
        num_replicas: world size R, ``>= 1``.
        shuffle, seed, epoch, drop_last: as in ``DistributedSampler`` (``epoch`` is the value
            the sampler holds, i.e. what ``set_epoch`` last set).

    Returns:
        A :class:`SamplerLayout`.

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    from .sampler import global_order, num_samples_per_rank, padded_order, shard_indices

    num_samples = num_samples_per_rank(n, num_replicas, drop_last)
    total_size = num_samples * num_replicas
    order = global_order(n, shuffle, seed, epoch)
    padded = padded_order(n, num_replicas, shuffle, seed, epoch, drop_last)
    shards = [shard_indices(n, num_replicas, r, shuffle, seed, epoch, drop_last)
              for r in range(num_replicas)]
    is_padding = [[j * num_replicas + r >= n for j in range(num_samples)]
                  for r in range(num_replicas)]
    return SamplerLayout(
        n=n, num_replicas=num_replicas, num_samples=num_samples, total_size=total_size,
        shards=shards, is_padding=is_padding,
        padding=padded[n:] if total_size > n else [],
        dropped=order[total_size:] if total_size < n else [],
        order=order,
    )


def sampler_heatmap(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                    epoch: int = 0, drop_last: bool = False, figsize=None, annotate=None):
    """Rank x position grid of one epoch's assignment, padded repeats outlined and hatched.

    Row ``r`` is what rank ``r`` yields, left to right; each cell is coloured and labelled
    with its dataset index. Padded repeats (``drop_last=False``) get a red hatched outline;
    indices cut by ``drop_last=True`` are listed under the grid. Same indices as torch's
    ``DistributedSampler``; no process group.

    Args:
        n, num_replicas, shuffle, seed, epoch, drop_last: as :func:`sampler_layout`.
        figsize: inches; default grows with the grid, about (6, 0.9 + 0.45 R).
        annotate: write the index in each cell; default when the grid has <= 200 cells.

    Returns:
        The ``Figure`` (one Axes). Its image holds the ``(R, num_samples)`` index matrix
        (``fig.axes[0].images[0].get_array()``); padding outlines are patches with
        ``gid == "padding"``.

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    lay = sampler_layout(n, num_replicas, shuffle, seed, epoch, drop_last)
    R, k = lay.num_replicas, lay.num_samples
    if figsize is None:
        figsize = (6, min(0.9 + 0.45 * R, 5))
    fig, ax = subplots(figsize=figsize)
    title = (f"N={n}, R={R}, shuffle={shuffle}, drop_last={drop_last}"
             + (f", seed+epoch={seed}+{epoch}" if shuffle else "")
             + f": {k} per rank")
    ax.set_title(title, fontsize=LABEL_PT)
    if k == 0:
        ax.text(0.5, 0.5, "every rank gets 0 samples", ha="center", va="center",
                transform=ax.transAxes, fontsize=TITLE_PT)
        ax.set_xticks([])
        ax.set_yticks(range(R))
        ax.set_yticklabels([f"rank {r}" for r in range(R)], fontsize=SMALL_PT)
        ax.set_ylim(R - 0.5, -0.5)
    else:
        grid = np.array(lay.shards, dtype=float)
        ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(n - 1, 1), aspect="auto",
                  interpolation="nearest")
        if annotate is None:
            annotate = R * k <= 200
        for r in range(R):
            for j in range(k):
                if annotate:
                    # light text on the dark end of viridis, dark text on the light end
                    light = grid[r, j] < 0.6 * max(n - 1, 1)
                    ax.text(j, r, str(lay.shards[r][j]), ha="center", va="center",
                            fontsize=SMALL_PT if k <= 16 else 6,
                            color="white" if light else "black")
                if lay.is_padding[r][j]:
                    ax.add_patch(Rectangle((j - 0.5, r - 0.5), 1, 1, fill=False,
                                           edgecolor="red", linewidth=2, hatch="//",
                                           gid="padding"))
        ax.set_xticks(range(k))
        ax.set_xticklabels([str(j) for j in range(k)], fontsize=SMALL_PT)
        ax.set_yticks(range(R))
        ax.set_yticklabels([f"rank {r}" for r in range(R)], fontsize=SMALL_PT)
    notes = []
    if lay.padding:
        notes.append(f"red hatched = padding, repeats of {sorted(set(lay.padding))}")
    if lay.dropped:
        notes.append(f"dropped (drop_last): {sorted(lay.dropped)}")
    ax.set_xlabel("position in the rank's list" + ("\n" + "; ".join(notes) if notes else ""),
                  fontsize=SMALL_PT)
    return finish(fig)


def assignment_over_epochs(n: int, num_replicas: int, epochs: int = 3, seed: int = 0,
                           drop_last: bool = False, figsize=(6, 3)):
    """Which rank gets each dataset index, epoch after epoch, without and with ``set_epoch``.

    Two panels, rows = epochs, columns = dataset index, colour = the rank that receives the
    index (shuffle=True). Left: the loop never calls ``set_epoch``, so the sampler keeps
    epoch 0 and every row is the same. Right: ``set_epoch(e)`` before epoch ``e``, so the
    permutation is reseeded with ``seed + e`` and every index moves between ranks. An index
    that a rank also gets as padding is marked with a white dot (it has two owners); an
    index cut by ``drop_last`` is grey. The legend names the ranks' colours, and the dot and
    the grey when the figure has them.

    Args:
        n: dataset length N (columns).
        num_replicas: world size R.
        epochs: number of epochs (rows).
        seed: the sampler's seed.
        drop_last: the sampler's ``drop_last``.
        figsize: inches.

    Returns:
        The ``Figure`` with two Axes; ``fig.axes[i].images[0].get_array()`` is the
        ``(epochs, N)`` owner matrix (masked where dropped), panel 0 without, 1 with
        ``set_epoch``. No process group.

    Raises:
        ValueError: ``n < 1`` or ``num_replicas < 1``.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    if n < 1:
        raise ValueError(f"n must be >= 1 to draw the assignment, got {n}")
    base = plt.get_cmap("tab10")
    cmap = ListedColormap([base(r % 10) for r in range(num_replicas)]).with_extremes(
        bad="lightgrey")
    fig, axes = subplots(1, 2, figsize=figsize, sharey=True)
    any_padding = any_dropped = False
    for ax, call_set_epoch in zip(axes, (False, True)):
        owner = np.ma.masked_all((epochs, n))
        dup_x, dup_y = [], []
        for e in range(epochs):
            lay = sampler_layout(n, num_replicas, True, seed, e if call_set_epoch else 0,
                                 drop_last)
            for r in range(num_replicas):
                for idx, pad in zip(lay.shards[r], lay.is_padding[r]):
                    if pad:
                        dup_x.append(idx)
                        dup_y.append(e)
                    else:
                        owner[e, idx] = r
        ax.imshow(owner, cmap=cmap, vmin=-0.5, vmax=num_replicas - 0.5, aspect="auto",
                  interpolation="nearest")
        if dup_x:
            ax.scatter(dup_x, dup_y, s=12, c="white", edgecolors="black", linewidths=0.5,
                       gid="padding")
        any_padding = any_padding or bool(dup_x)
        any_dropped = any_dropped or bool(np.ma.getmaskarray(owner).any())
        ax.set_title("with set_epoch(e)" if call_set_epoch else "without set_epoch",
                     fontsize=LABEL_PT)
        ax.set_xlabel("dataset index", fontsize=SMALL_PT)
        ax.set_xticks(range(0, n, max(1, n // 6)))
        ax.tick_params(labelsize=SMALL_PT)
    axes[0].set_yticks(range(epochs))
    axes[0].set_ylabel("epoch", fontsize=SMALL_PT)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(r)) for r in range(num_replicas)]
    labels = [f"rank {r}" for r in range(num_replicas)]
    if any_padding:  # the white dot: the index is dealt again, as padding, to a second rank
        handles.append(plt.Line2D([], [], marker="o", linestyle="", markersize=4,
                                  markerfacecolor="white", markeredgecolor="black",
                                  markeredgewidth=0.5))
        labels.append("padded repeat")
    if any_dropped:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="lightgrey"))
        labels.append("cut by drop_last")
    fig.legend(handles, labels, loc="lower center",
               ncol=min(len(handles), 8), fontsize=SMALL_PT, frameon=False)
    return finish(fig, rect=(0, 0.1, 1, 1))


# =================================================================== gradient figures (notebook 01)


def per_rank_gradients_figure(
    shard_grads, full_grad, max_params: int | None = None, figsize=(7, 3)
):
    """Each rank's shard gradient, their average, and the full-batch gradient, per parameter.

    Bars: rank r's gradient entries (one colour per rank). Black bar outline: the average of
    the ranks' gradients (what the all-reduce delivers). Red x: the gradient of the mean loss
    on the whole global batch — it sits exactly on the average for equal shards.

    Args:
        shard_grads: list of R 1-D tensors (flattened gradients, one per rank).
        full_grad: 1-D tensor, the single-process gradient on the global batch.
        max_params: how many leading entries to draw (None: all).
        figsize: inches.

    Returns:
        The ``Figure`` (one Axes). No process group needed.

    Raises:
        ValueError: no gradients, or gradients of different lengths.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if not shard_grads:
        raise ValueError("no shard gradients to draw")
    n = full_grad.numel()
    if any(g.numel() != n for g in shard_grads):
        raise ValueError(f"every gradient needs {n} entries, got "
                         f"{[g.numel() for g in shard_grads]}")
    k = n if max_params is None else min(max_params, n)
    grads = np.stack([g.detach().cpu().double().numpy()[:k] for g in shard_grads])
    avg = grads.mean(axis=0)
    full = full_grad.detach().cpu().double().numpy()[:k]
    R = len(shard_grads)
    fig, ax = subplots(figsize=figsize)
    width = 0.8 / R
    xs = np.arange(k)
    for r in range(R):
        ax.bar(xs - 0.4 + width * (r + 0.5), grads[r], width=width, label=f"rank {r}",
               color=plt.get_cmap("tab10")(r % 10), alpha=0.75)
    ax.bar(xs, avg, width=0.86, fill=False, edgecolor="black", linewidth=1.2,
           label="average of ranks")
    ax.scatter(xs, full, marker="x", color="red", s=40, zorder=5, label="full batch")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xticks(xs)
    ax.set_xlabel("parameter entry", fontsize=SMALL_PT)
    ax.set_ylabel("gradient", fontsize=SMALL_PT)
    ax.set_title(
        f"{R} shard gradients, their average and the full-batch gradient", fontsize=LABEL_PT
    )
    ax.tick_params(labelsize=SMALL_PT)
    ax.legend(
        fontsize=SMALL_PT,
        ncol=min(R + 2, 6),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        frameon=False,
    )
    return finish(fig)


# ================================================================= collective figures (notebook 03)

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

    All-reduce methods are drawn as bus bandwidth (algbw · 2(R-1)/R, nccl-tests'
    PERFORMANCE.md) so they can be read against the link: the grey lines are the measured
    send/recv bandwidth per direction (dashed: ranks 0 and 1 alone; dotted: every rank
    sending at once). Lines join the medians over repeats; the shaded band around each spans
    min..max (where the rows have ``busbw_GBps_min``/``_max``). The legend sits below the
    panels, so it covers no line.

    Args:
        rows: dicts as :func:`ddp_lesson.bench.allreduce.read_results` returns.
        figsize: inches.

    Returns:
        The ``Figure`` (one Axes per process count).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no benchmark rows to draw")
    nprocs = sorted({r["nprocs"] for r in rows})
    fig, axes = subplots(1, len(nprocs), figsize=figsize, sharey=True, squeeze=False)
    lo = min(r["size_bytes"] for r in rows if r["method"] not in ("sendrecv", "shift")) \
        if any(r["method"] not in ("sendrecv", "shift") for r in rows) else 0
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
        ticks = sorted(
            {r["size_bytes"] for r in rows if r["nprocs"] == R and r["size_bytes"] >= lo}
        )
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(t) for t in ticks], rotation=45, fontsize=SMALL_PT)
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
    (:func:`ddp_lesson.collectives.fit_alpha_beta`),
    then the model's curves (:func:`~ddp_lesson.collectives.naive_allreduce_time`,
    ``tree_allreduce_time``, ``ring_allreduce_time``) are drawn for each process count with
    the measured times of gloo, the ring and the pipelined ring as points.

    Args:
        rows: dicts as :func:`ddp_lesson.bench.allreduce.read_results` returns (needs
            ``sendrecv`` rows).
        figsize: inches.

    Returns:
        The ``Figure``; ``fig.alpha_beta`` holds the fitted ``(alpha_s, beta_s_per_byte)``.

    Raises:
        ValueError: no send/recv rows to fit.
    """
    import numpy as np

    from .collectives import (
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
    """The ring all-reduce step by step, as a static picture: reduce-scatter, then all-gather.

    One panel per state of :func:`ddp_lesson.collectives.simulate_ring_all_reduce` (step 0:
    the inputs, then each of the 2(R-1) steps). In a panel, a row per rank and a column per
    chunk; each cell shows the chunk's value and, after Σ, the ranks summed into it. Colours:
    grey = only the rank's own input, yellow = partly summed, green = summed over every rank;
    a thick border marks the chunk that arrived in this step, and the line under the panel
    lists the step's messages (``r0→r1 c0``: rank 0 sent chunk 0 to rank 1).

    Args:
        world_size: R, 2 to 6 (one panel per step: 2R-1 panels).
        figsize: inches; default about 2 inches per panel, at least :data:`MIN_WIDTH_IN`.

    Returns:
        The ``Figure``; ``fig.axes[k]`` is step k, titled with its phase.

    Raises:
        ValueError: ``world_size`` outside 2..6.
    """
    from matplotlib.patches import Rectangle

    from .collectives import simulate_ring_all_reduce

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


__all__ += ["per_rank_gradients_figure", "allreduce_bandwidth_figure", "cost_model_figure",
            "ring_allreduce_steps_figure"]


# =================================================================== training figures (notebook 05)


def loss_curves_figure(curves, title: str = "training loss per optimizer step",
                       reference: str | None = None, figsize=None):
    """Loss curves overlaid, one line per run, x = optimizer step (1-based).

    Args:
        curves: ``{label: [loss per step, ...]}`` (e.g. ``summary["step_losses"]`` of runs
            with 1 and 2 processes at the same global batch). Later lines are drawn dashed
            so that curves that coincide stay visible.
        title: title of the loss axes.
        reference: a label of ``curves``; when given, a second panel shows every other
            curve's ``|loss - reference loss|`` per step on a log scale (curves that look
            the same on the left may differ by 1e-7 or by 1e-3: the right panel tells).
        figsize: default ``(6, 3)``, or ``(9, 3)`` with a reference panel.

    Returns:
        The figure.
    """

    panels = 2 if reference is not None else 1
    fig, axes = subplots(1, panels, figsize=figsize or ((9, 3) if panels == 2 else (6, 3)),
                         squeeze=False)
    ax = axes[0][0]
    styles = ["-", "--", ":", "-."]
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, styles[i % len(styles)],
                lw=max(0.8, 2 - 0.4 * i), label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over labelled pixels)")
    ax.set_title(title, fontsize=TITLE_PT)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=SMALL_PT)
    if reference is not None:
        bx = axes[0][1]
        ref = curves[reference]
        for i, (label, losses) in enumerate(curves.items()):
            if label == reference:
                continue
            # 0 cannot be drawn on a log scale: exact agreement shows at the floor, 1e-9
            delta = [max(abs(a - b), 1e-9) for a, b in zip(losses, ref)]
            bx.semilogy(range(1, len(delta) + 1), delta, "o" + styles[i % len(styles)],
                        color=f"C{i}", ms=3, label=label)
        bx.set_xlabel("optimizer step")
        bx.set_ylabel(f"|loss - loss of '{reference}'|", fontsize=SMALL_PT)
        bx.set_title("difference from the reference", fontsize=TITLE_PT)
        bx.grid(alpha=0.3, which="both")
        bx.legend(fontsize=SMALL_PT)
    return finish(fig)


def masks_figure(images, targets, preds, figsize=None):
    """Image, ground truth and prediction side by side, in the official Cityscapes colours.

    Args:
        images: ``(N, 3, H, W)`` normalised images (as the data sets return them).
        targets: ``(N, H, W)`` trainIds 0..18 or 255 (void, drawn black).
        preds: ``(N, H, W)`` predicted trainIds (``logits.argmax(1)``).
        figsize: default ``(6, 1.1 * N + 0.4)``.

    Returns:
        The figure: one row per sample, columns image | ground truth | prediction.
    """

    from .data import colorize_target, denormalize_image

    n = len(images)
    fig, axes = subplots(n, 3, figsize=figsize or (6, 1.1 * n + 0.4), squeeze=False)
    for i in range(n):
        panels = (denormalize_image(images[i]), colorize_target(targets[i]),
                  colorize_target(preds[i]))
        for j, (ax, panel) in enumerate(zip(axes[i], panels)):
            ax.imshow(panel, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(("image", "ground truth", "prediction")[j], fontsize=LABEL_PT)
    return finish(fig)


def scaling_figure(rows, figsize=(8, 3)):
    """The scaling study: samples/s against processes (left), step-time breakdown (right).

    Args:
        rows: rows of ``benchmarks/scaling.csv`` (:func:`ddp_lesson.bench.scaling.read_csv`):
            mode, nprocs, samples_per_s, samples_per_s_min/max, efficiency and the phase
            seconds data_s, forward_s, backward_s, comm_exposed_s, optimizer_s, other_s.

    Returns:
        The figure. Left: measured samples/s per mode with min-max bars over repeats, and the
        ideal line (R x the 1-process rate). Right: one stacked bar per (mode, R), the
        median seconds per step in each phase.
    """

    phases = ("data", "forward", "backward", "comm_exposed", "optimizer", "other")
    colors = ("#8c8c8c", "#4c72b0", "#55a868", "#c44e52", "#dd8452", "#cccccc")
    fig, (ax, bx) = subplots(1, 2, figsize=figsize,
                                 gridspec_kw={"width_ratios": [1, 1.3]})
    modes = [m for m in ("weak", "strong") if any(r["mode"] == m for r in rows)]
    for mode, color, dy in zip(modes, ("#4c72b0", "#dd8452"), (5, -12)):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["nprocs"])
        x = [r["nprocs"] for r in rs]
        y = [r["samples_per_s"] for r in rs]
        err = [[r["samples_per_s"] - r["samples_per_s_min"] for r in rs],
               [r["samples_per_s_max"] - r["samples_per_s"] for r in rs]]
        ax.errorbar(x, y, yerr=err, marker="o", color=color, capsize=3, label=f"{mode} scaling")
        one = next((r["samples_per_s"] for r in rs if r["nprocs"] == 1), None)
        if one:
            ax.plot(x, [one * n for n in x], ":", color=color, lw=1, label=f"{mode}: ideal")
            for xi, r in zip(x, rs):
                ax.annotate(f"{r['efficiency']:.2f}", (xi, r["samples_per_s"]),
                            textcoords="offset points", xytext=(4, dy), fontsize=SMALL_PT,
                            color=color)
    ax.set_xlabel("processes R")
    ax.set_ylabel("samples / s")
    ax.set_xticks(sorted({r["nprocs"] for r in rows}))
    ax.set_title("throughput (labels: efficiency)", fontsize=LABEL_PT)
    ax.legend(fontsize=SMALL_PT)
    ax.grid(alpha=0.3)
    labels, bottoms = [], []
    bars = [r for m in modes for r in sorted((r for r in rows if r["mode"] == m),
                                             key=lambda r: r["nprocs"])]
    for i, r in enumerate(bars):
        labels.append(f"{r['mode'][0]}{r['nprocs']}")
        bottom = 0.0
        for phase, color in zip(phases, colors):
            h = r[f"{phase}_s"] * 1e3
            bx.bar(i, h, bottom=bottom, color=color, label=phase if i == 0 else None)
            bottom += h
        bottoms.append(bottom)
    bx.set_xticks(range(len(bars)))
    bx.set_xticklabels(labels, fontsize=SMALL_PT)
    bx.set_xlabel("mode (w = weak, s = strong) and R")
    bx.set_ylabel("ms per step")
    bx.set_title("where a step's time goes (rank 0)", fontsize=LABEL_PT)
    bx.legend(fontsize=SMALL_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return finish(fig)


__all__ += ["loss_curves_figure", "masks_figure", "scaling_figure"]


# ================================================================ DDP wrapper figures (notebook 04)


def _as_step_record(rec):
    from .commsim import StepRecord

    return rec if isinstance(rec, StepRecord) else StepRecord.from_dict(rec)


def ddp_timeline_figure(panels, figsize=(7, 3.4), align: bool = True):
    """Per-rank timeline of one training step: backward, gradient-ready ticks, all-reduces.

    One panel per scenario (e.g. NaiveDDP, buckets without overlap, buckets with overlap),
    sharing the time axis. In each, every rank has two lanes: the upper one is backward
    (grey bar from the end of forward to the end of autograd, a tick where each gradient was
    accumulated), the lower one its all-reduces (alternating colours, one box per bucket or
    per parameter) and, hatched in red, the time between the end of that rank's backward
    and the moment its ``backward()`` returned with averaged gradients (communication, or
    waiting for a slower rank). Each panel's title gives the job's exposed communication
    (:func:`ddp_lesson.ddp.job_exposed_s`).

    Args:
        panels: ``[(title, records), ...]`` where ``records`` holds one
            :class:`ddp_lesson.ddp.StepRecord` (or its ``to_dict()``) per rank, in rank order.
        figsize: inches.
        align: shift each rank by its ``t0_s`` (when its forward returned, on the machine's
            monotonic clock) so that the ranks share one time axis, starting at the earliest
            rank; False: every rank starts at 0 (use for ranks on different machines).

    Returns:
        The ``Figure``, one Axes per panel. Exposed spans are patches with
        ``gid == "exposed"``, all-reduce boxes ``gid == "comm"``.
    """
    from matplotlib.patches import Patch

    fig, axes = subplots(len(panels), 1, figsize=figsize, sharex=True,
                             squeeze=False)
    colours = ("tab:blue", "tab:orange")
    for ax, (title, records) in zip(axes[:, 0], panels):
        records = [_as_step_record(r) for r in records]
        first = min(r.t0_s for r in records) if align else 0.0
        for row, rec in enumerate(records):
            y = len(records) - 1 - row
            shift = (rec.t0_s - first) * 1e3 if align else 0.0
            ax.broken_barh([(shift, rec.backward_end_s * 1e3)], (y + 0.05, 0.4),
                           facecolors="lightgrey", edgecolors="grey", linewidth=0.5)
            ticks = [shift + t * 1e3 for t in rec.grad_ready_s.values()]
            ax.vlines(ticks, y + 0.05, y + 0.45, colors="black", linewidth=0.5)
            for k, e in enumerate(rec.comm):
                ax.broken_barh([(shift + e.start_s * 1e3,
                                 max(e.end_s - e.start_s, 1e-5) * 1e3)],
                               (y - 0.45, 0.4), facecolors=colours[k % 2], edgecolors="white",
                               linewidth=0.3, gid="comm")
            if rec.exposed_s > 0:
                ax.broken_barh([(shift + rec.backward_end_s * 1e3, rec.exposed_s * 1e3)],
                               (y - 0.5, 1.0), facecolors="none", edgecolors="red",
                               hatch="///", linewidth=0.8, gid="exposed")
        ax.set_yticks(range(len(records)))
        ax.set_yticklabels([f"rank {len(records) - 1 - i}" for i in range(len(records))],
                           fontsize=SMALL_PT)
        ax.set_ylim(-0.6, len(records) - 0.4)
        if align:
            from .commsim import job_exposed_s

            exposed = job_exposed_s(records) * 1e3
            what = "after the last rank's backward"
        else:
            exposed, what = max(r.exposed_s for r in records) * 1e3, "on the slowest rank"
        ax.set_title(
            f"{title}: {exposed:.0f} ms of communication exposed {what}", fontsize=SMALL_PT
        )
        ax.tick_params(labelsize=SMALL_PT)
    axes[-1, 0].set_xlabel("ms since the first rank's forward returned" if align
                           else "ms since the end of forward", fontsize=SMALL_PT)
    handles = [Patch(facecolor="lightgrey", edgecolor="grey", label="backward (| = grad ready)"),
               Patch(facecolor=colours[0], label="all-reduce"),
               Patch(facecolor="none", edgecolor="red", hatch="///",
                     label="after backward (communication or waiting)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=SMALL_PT, frameon=False)
    return finish(fig, rect=(0, 0.06, 1, 1))


def bucket_sweep_figure(predicted, measured=None, figsize=(MIN_WIDTH_IN, 3.4)):
    """Exposed communication against bucket cap: the cost model's curve and measured points.

    Args:
        predicted: rows of :func:`ddp_lesson.ddp.predict_bucket_sweep` (the last row, with
            ``cap_mb=None``, is NaiveDDP and is drawn as a horizontal line).
        measured: optional ``[(cap_mb, exposed_s), ...]`` (several per cap allowed);
            ``cap_mb=None`` marks NaiveDDP measurements.
        figsize: inches.

    Returns:
        The ``Figure`` (one Axes, log-scaled x). The model's line has ``gid == "model"``,
        the measured points ``gid == "measured"``.
    """

    fig, ax = subplots(figsize=figsize)
    caps = [r for r in predicted if r["cap_mb"] is not None]
    naive = [r for r in predicted if r["cap_mb"] is None]
    xs = [max(r["cap_mb"], 1e-3) for r in caps]
    ys = [r["exposed_s"] * 1e3 for r in caps]
    ax.plot(xs, ys, "-o", color="tab:blue", markersize=4, label="cost model", gid="model")
    best = min(range(len(ys)), key=ys.__getitem__)
    ax.plot([xs[best]], [ys[best]], "*", color="tab:green", markersize=12,
            label=f"model optimum: {caps[best]['cap_mb']:g} MB")
    if naive:
        ax.axhline(naive[0]["exposed_s"] * 1e3, color="tab:red", linestyle="--", linewidth=1,
                   label="NaiveDDP (model)")
    if measured:
        pts = [(max(c, 1e-3), e * 1e3) for c, e in measured if c is not None]
        if pts:
            ax.scatter(*zip(*pts), s=12, color="black", zorder=3, label="measured",
                       gid="measured")
        nv = [e * 1e3 for c, e in measured if c is None]
        if nv:
            ax.scatter([xs[0]] * len(nv), nv, s=12, marker="x", color="tab:red", zorder=3,
                       label="NaiveDDP measured")
    ax.set_xscale("log")
    # every cap gets its own tick; a cap of 0 (one bucket per parameter) sits at 1e-3
    # the bucket counts go under the ticks, where no measured point can hide them
    ax.set_xticks(xs, [("0" if r["cap_mb"] == 0 else f"{r['cap_mb']:g}") + f"\n{r['buckets']}"
                       for r in caps])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (second line: buckets)", fontsize=LABEL_PT)
    ax.set_ylabel("exposed communication (ms)", fontsize=LABEL_PT)
    ax.tick_params(labelsize=SMALL_PT)
    ax.legend(fontsize=SMALL_PT, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return finish(fig)


def ddp_benchmark_figure(rows, figsize=(7, 3)):
    """Steps/s of torch's DDP, NaiveDDP and BucketedDDP, without and with a simulated link.

    Args:
        rows: rows of ``benchmarks/ddp.csv`` (:func:`ddp_lesson.bench.ddp.read_results`):
            ``variant``, ``link``, ``steps_per_s`` (median), ``steps_per_s_min``/``_max``,
            ``exposed_share``.
        figsize: inches.

    Returns:
        The ``Figure``: left, no link; right, under the link, each bar labelled with its
        exposed-communication share where measured. Error bars span min..max over rounds.
    """

    fig, axes = subplots(1, 2, figsize=figsize)
    colours = {"torch": "tab:grey", "naive": "tab:red", "bucketed": "tab:blue",
               "bucketed-no-overlap": "tab:cyan"}
    for ax, link in zip(axes, (False, True)):
        mine = [r for r in rows if bool(r["link"]) == link]
        names = [r["variant"] for r in mine]
        med = [float(r["steps_per_s"]) for r in mine]
        lo = [m - float(r["steps_per_s_min"]) for m, r in zip(med, mine)]
        hi = [float(r["steps_per_s_max"]) - m for m, r in zip(med, mine)]
        ax.bar(range(len(mine)), med, yerr=[lo, hi], capsize=3,
               color=[colours.get(n, "tab:purple") for n in names])
        for i, r in enumerate(mine):
            if r.get("exposed_share") not in (None, ""):
                ax.text(i, med[i] * 0.3, f"exposed\n{float(r['exposed_share']):.0%}",
                        ha="center", va="center", fontsize=SMALL_PT, color="white")
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([n.replace("-no-overlap", "\nno overlap") for n in names],
                           fontsize=SMALL_PT)
        ax.set_ylabel("steps/s (median; bars: min..max)", fontsize=LABEL_PT)
        ax.tick_params(labelsize=SMALL_PT)
        described = [r for r in mine if r.get("latency_ms") not in (None, "")]
        if link and described:
            ax.set_title(f"simulated link: {float(described[0]['latency_ms']):g} ms, "
                         f"{float(described[0]['bandwidth_MBps']):g} MB/s", fontsize=SMALL_PT)
        elif link:
            ax.set_title("simulated link", fontsize=SMALL_PT)
        else:
            ax.set_title("gloo on this machine (no link model)", fontsize=SMALL_PT)
    return finish(fig)


__all__ += ["ddp_timeline_figure", "bucket_sweep_figure", "ddp_benchmark_figure"]


# ===================================================================== memory figures (notebook 07)


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

    from .memory import GB, STAGE_NAMES, STAGES, memory_per_rank

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


__all__ += ["memory_stages_figure"]


# ==================================================================== torch's Reducer (notebook 04)

#: The rows of :func:`reducer_map_figure`: (stage, our BucketedDDP, torch's C++ Reducer).
REDUCER_MAP = [
    (
        "1 · a gradient is\naccumulated",
        "p.register_post_accumulate_grad_hook(hook)\n→ _grad_ready(i):\n  bucket.pending -= 1",
        "post-hook on p's AccumulateGrad node\n→ Reducer::autograd_hook(i)\n"
        "→ mark_variable_ready(i)",
    ),
    (
        "2 · a bucket is\nready",
        "pending == 0 → _launch(bucket):\ncopy each .grad × 1/R into bucket.flat\n"
        "(in bucket order on every rank)",
        "copy .grad into its bucket view,\n× 1/div_factor_ when no hook is set;\n"
        "mark_bucket_ready (in bucket order)",
    ),
    (
        "3 · all-reduce",
        "comm_hook(flat, group) → work (.wait())\ndefault: dist.all_reduce(flat,\n"
        "  async_op=True), a SUM",
        "all_reduce_bucket → run_comm_hook(\n  GradBucket) → Future[Tensor];\n"
        "a registered hook divides itself",
    ),
    (
        "4 · end of\nbackward",
        "queue_callback(_final_callback)\n→ _after_backward: wait every\nbucket, copy flat → .grad",
        "queue_callback(finalize_backward):\nwait the futures, copy into .grad\n"
        "(a view: no copy). Buckets are rebuilt\nonce, before the 2nd forward",
    ),
]


def reducer_map_figure(figsize=(11, 5.4)):
    """Our ``BucketedDDP`` (ddp_lesson/ddp.py) beside torch's C++ ``Reducer``, stage by stage.

    Four rows (:data:`REDUCER_MAP`): a parameter's gradient is accumulated (a hook after
    gradient accumulation), its bucket is ready, the bucket is all-reduced, backward ends
    (a callback queued on autograd's engine finalizes). Sources: ``torch/nn/parallel/
    distributed.py`` and ``torch/csrc/distributed/c10d/reducer.hpp`` (torch 2.13).

    Args:
        figsize: inches; at the figure's 80 dpi the default is 880 px wide. Every text is
            at least 9 pt.

    Returns:
        The ``Figure`` (one Axes, axis off); each box's text artist has ``gid``
        ``"stage{k}"``, ``"ours{k}"`` or ``"torch{k}"``. Pure drawing, no process group.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=figsize, dpi=80)
    ax.set_xlim(0, 100)
    n = len(REDUCER_MAP)
    ax.set_ylim(0, n * 12 + 7)
    ax.set_position([0.01, 0.01, 0.98, 0.98])
    ax.axis("off")
    cols = [
        (0.8, 13.5, "stage", "#eeeeee"),
        (16, 40.5, "our BucketedDDP (ddp_lesson/ddp.py)", "#dbe9f6"),
        (58.5, 40.5, "torch's Reducer (C++, reducer.cpp)", "#fde3cf"),
    ]
    for x, w, title, _ in cols[1:]:
        ax.text(x + w / 2, n * 12 + 4, title, ha="center", va="center", fontsize=11,
                fontweight="bold")
    for k, row in enumerate(REDUCER_MAP):
        y = (n - 1 - k) * 12 + 1
        for (x, w, kind, colour), text, gid in zip(cols, row, ("stage", "ours", "torch")):
            ax.add_patch(FancyBboxPatch((x, y), w, 10, boxstyle="round,pad=0.3,rounding_size=1",
                                        facecolor=colour, edgecolor="grey", linewidth=0.8))
            t = ax.text(x + w / 2, y + 5, text, ha="center", va="center",
                        fontsize=10 if kind == "stage" else 9,
                        family="sans-serif" if kind == "stage" else "monospace")
            t.set_gid(f"{gid}{k + 1}")
        if k < n - 1:
            for x, w, _, _ in cols[1:]:
                ax.annotate("", xy=(x + w / 2, y - 1.4), xytext=(x + w / 2, y + 0.2),
                            arrowprops={"arrowstyle": "->", "color": "grey"})
    return fig


__all__ += ["REDUCER_MAP", "reducer_map_figure"]


# ============================================================ launch and sharding figures


def torchrun_topology_figure(nnodes: int = 2, nproc_per_node: int = 4, figsize=(11, 4.6)):
    """torchrun -> agents -> workers -> process group, on ``nnodes`` x ``nproc_per_node``.

    One torchrun per node starts that node's *agent* (torch's ``LocalElasticAgent``), which
    starts and watches ``nproc_per_node`` workers. The agents meet at the rendezvous endpoint
    (``--rdzv-endpoint``); the workers' ``init_process_group`` meets at the store named by
    ``MASTER_ADDR:MASTER_PORT``. Every worker box shows ``RANK`` (``node * nproc_per_node +
    local_rank``) and ``LOCAL_RANK``. Sources: torch 2.13, ``torch/distributed/run.py`` and
    ``elastic/agent/server/local_elastic_agent.py``.

    Returns:
        The ``Figure``; each worker's text artist has gid ``"worker{RANK}"`` and each agent's
        ``"agent{node}"``. Pure drawing, no process group.
    """
    from matplotlib.patches import FancyBboxPatch

    fig, ax = subplots(figsize=figsize)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.axis("off")

    def box(x, y, w, h, text, colour, gid=None, **kw):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.3,rounding_size=1",
                                    facecolor=colour, edgecolor="grey", linewidth=0.8))
        t = ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL_PT, **kw)
        if gid:
            t.set_gid(gid)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->",
                                                                 "color": "grey"})

    box(30, 88, 40, 9, "rendezvous endpoint (--rdzv-endpoint, c10d):\nthe agents meet here",
        "#eeeeee")
    node_w = 96 / nnodes
    worker_w = (node_w - 4) / nproc_per_node
    for node in range(nnodes):
        x0 = 2 + node * node_w
        ax.add_patch(FancyBboxPatch((x0, 20), node_w - 2, 62, boxstyle="round,pad=0.3",
                                    facecolor="none", edgecolor="#999999", linestyle="--"))
        ax.text(x0 + 1, 79, f"node {node} (GROUP_RANK={node})", ha="left", va="center",
                fontsize=SMALL_PT, fontweight="bold")
        box(x0 + 6, 62, node_w - 14, 11,
            f"torchrun --nnodes {nnodes} --nproc-per-node {nproc_per_node}\n"
            "agent: starts and watches the workers", "#fde3cf", gid=f"agent{node}")
        arrow(x0 + node_w / 2 - 1, 74, 50, 87)
        for lr in range(nproc_per_node):
            rank = node * nproc_per_node + lr
            wx = x0 + 1 + lr * worker_w
            box(wx + 0.5, 30, worker_w - 2, 18, f"worker\nRANK {rank}\nLOCAL_RANK {lr}",
                "#dbe9f6", gid=f"worker{rank}")
            arrow(x0 + node_w / 2 - 1, 61, wx + worker_w / 2 - 0.5, 49)
            arrow(wx + worker_w / 2 - 0.5, 29, wx + worker_w / 2 - 0.5, 13)
    world = nnodes * nproc_per_node
    box(2, 3, 94, 9, f"process group: WORLD_SIZE={world} ranks (init_process_group meets at "
        "the store MASTER_ADDR:MASTER_PORT), then all_reduce, ...", "#e2f0d9")
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


__all__ += ["data_movement_figure", "data_movement_per_step", "torchrun_topology_figure"]
