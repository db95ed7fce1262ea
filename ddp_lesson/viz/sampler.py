"""How a DistributedSampler deals a dataset out to ranks (notebook 02).

:func:`sampler_layout` computes where every index goes (no matplotlib); the figures draw it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .style import LABEL_PT, SMALL_PT, TITLE_PT, finish, subplots

__all__ = ["SamplerLayout", "sampler_layout", "sampler_heatmap", "assignment_over_epochs"]


@dataclass
class SamplerLayout:
    """Where every dataset index goes in one epoch of a
    :class:`ddp_lesson.sampler.DistributedSampler` (built by :func:`sampler_layout`).

    Position ``j`` of rank ``r`` is entry ``p = j * R + r`` of the padded global order; it is
    *padding* when ``p >= N`` (a wrapped-round repeat of an earlier index).

    Attributes:
        num_replicas: world size R.
        num_samples: indices per rank (``len(sampler)``); ``total_size = num_samples * R``.
        shards: ``shards[r]`` = the indices rank r yields, in order.
        is_padding: ``is_padding[r][j]`` True when ``shards[r][j]`` is a padded repeat.
        padding: the padded indices, in padded-order position order.
        dropped: indices cut by ``drop_last=True`` (not seen this epoch).
    """

    num_replicas: int
    num_samples: int
    total_size: int
    shards: list[list[int]]
    is_padding: list[list[bool]]
    padding: list[int]
    dropped: list[int]


def sampler_layout(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                   epoch: int = 0, drop_last: bool = False) -> SamplerLayout:
    """Every rank's shard for one epoch, with padding and dropped indices marked.

    Pure index arithmetic from :mod:`ddp_lesson.sampler` (torch's ``DistributedSampler``'s
    indices after ``set_epoch(epoch)``); no process group. Args as ``DistributedSampler``
    (``n >= 0`` its dataset length, ``num_replicas >= 1``; ``epoch`` the sampler's). Returns a
    :class:`SamplerLayout`.

    Raises:
        ValueError: ``n < 0`` or ``num_replicas < 1``.
    """
    from ..sampler import global_order, num_samples_per_rank, padded_order

    R = num_replicas
    num_samples = num_samples_per_rank(n, R, drop_last)
    total_size = num_samples * R
    order = global_order(n, shuffle, seed, epoch)
    padded = padded_order(n, R, shuffle, seed, epoch, drop_last)  # total_size entries
    return SamplerLayout(
        num_replicas=R, num_samples=num_samples, total_size=total_size,
        shards=[padded[r::R] for r in range(R)],  # rank r: every R-th entry from r
        is_padding=[[j * R + r >= n for j in range(num_samples)] for r in range(R)],
        padding=padded[n:] if total_size > n else [],
        dropped=order[total_size:] if total_size < n else [],
    )


def sampler_heatmap(n: int, num_replicas: int, shuffle: bool = False, seed: int = 0,
                    epoch: int = 0, drop_last: bool = False, figsize=None, annotate=None):
    """Rank x position grid of one epoch's assignment, padded repeats outlined and hatched.

    Row ``r`` is what rank ``r`` yields; each cell is coloured and labelled with its dataset
    index. Padded repeats get a red hatched outline; indices cut by ``drop_last=True`` are
    listed under the grid. No process group.

    Args:
        n, num_replicas, shuffle, seed, epoch, drop_last: as :func:`sampler_layout`.
        figsize: inches; default about (6, 0.9 + 0.45 R).
        annotate: write the index in each cell; default when the grid has <= 200 cells.

    Returns:
        The ``Figure``. Its image holds the ``(R, num_samples)`` index matrix
        (``fig.axes[0].images[0].get_array()``); padding outlines have ``gid == "padding"``.

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
        ax.set_xticks(range(k), [str(j) for j in range(k)], fontsize=SMALL_PT)
    ax.set_yticks(range(R), [f"rank {r}" for r in range(R)], fontsize=SMALL_PT)
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

    Two panels (shuffle=True), rows = epochs, columns = dataset index, colour = the receiving
    rank. Left: no ``set_epoch``, every row the same (epoch 0). Right: ``set_epoch(e)``
    reseeds with ``seed + e`` and indices move between ranks. A white dot marks an index also
    dealt as padding (two owners); grey, an index cut by ``drop_last``. No process group.

    Args:
        n, num_replicas: dataset length N (columns) and world size R.
        epochs: number of epochs (rows).
        seed, drop_last: the sampler's.
        figsize: inches.

    Returns:
        The ``Figure``; ``fig.axes[i].images[0].get_array()`` is the ``(epochs, N)`` owner
        matrix (masked where dropped), panel 0 without, 1 with ``set_epoch``.

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
