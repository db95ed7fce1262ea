"""Per-rank gradients against the full-batch gradient (notebook 01)."""
from __future__ import annotations

from .style import LABEL_PT, SMALL_PT, finish, subplots

__all__ = ["per_rank_gradients_figure"]


def per_rank_gradients_figure(shard_grads, full_grad, max_params: int | None = None,
                              figsize=(7, 3)):
    """Each rank's shard gradient, their average, and the full-batch gradient, per parameter.

    Bars: rank r's gradient entries. Black outline: the ranks' average (what the all-reduce
    delivers). Red x: the gradient of the mean loss on the whole global batch, on the average
    for equal shards. Each entry is divided by its largest |shard value| (linear: the average
    still lands on the full-batch gradient), so 0.01 reads as well as 5.

    Args:
        shard_grads: R 1-D tensors (flattened gradients, one per rank).
        full_grad: 1-D tensor, the single-process gradient on the global batch.
        max_params: how many leading entries to draw (None: all).
        figsize: inches.

    Returns:
        The ``Figure`` (one Axes). No process group.

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
    scale = np.abs(grads).max(axis=0)
    scale[scale == 0] = 1.0
    grads = grads / scale
    avg = grads.mean(axis=0)
    full = full_grad.detach().cpu().double().numpy()[:k] / scale
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
    ax.set_ylabel("gradient ÷ largest |shard|", fontsize=SMALL_PT)
    ax.set_title(f"{R} shard gradients, their average and the full-batch gradient",
                 fontsize=LABEL_PT)
    ax.tick_params(labelsize=SMALL_PT)
    ax.legend(fontsize=SMALL_PT, ncol=min(R + 2, 6), loc="upper center",
              bbox_to_anchor=(0.5, -0.18), frameon=False)
    return finish(fig)
