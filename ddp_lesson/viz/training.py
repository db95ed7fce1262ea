"""The trainer's results (notebook 06 and its deep dive): loss curves, the scaling study;
the learning-rate recipe's experiment (notebook 01's deep dive)."""
from __future__ import annotations

from .style import LABEL_PT, SMALL_PT, TITLE_PT, finish, subplots

__all__ = ["loss_curves_figure", "scaling_figure", "lr_recipe_figure"]


def loss_curves_figure(curves, title: str = "training loss per optimizer step",
                       reference: str | None = None, figsize=None):
    """Loss curves overlaid, one line per run, x = optimizer step (1-based).

    Args:
        curves: ``{label: [loss per step, ...]}`` (e.g. ``summary["step_losses"]`` of runs on
            1 and 2 processes); later lines dashed, so coinciding curves stay visible.
        title: the loss panel's title.
        reference: a label of ``curves``; adds a panel of every other curve's
            ``|loss - reference loss|`` per step, log scale (1e-7 apart or 1e-3 apart).
        figsize: default ``(6, 3)``, ``(9, 3)`` with a reference panel.

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


def scaling_figure(rows, figsize=(8, 3)):
    """The scaling study: samples/s against processes (left), step-time breakdown (right).

    Args:
        rows: rows of ``benchmarks/scaling.csv`` (:func:`ddp_lesson.bench.scaling.read_csv`).

    Returns:
        The figure. Left: samples/s per mode, min-max bars, the ideal line (R x the 1-process
        rate). Right: per (mode, R), the median seconds per step in each phase, stacked.
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
    bx.set_xticks(range(len(bars)), labels, fontsize=SMALL_PT)
    bx.set_xlabel("mode (w = weak, s = strong) and R")
    bx.set_ylabel("ms per step")
    bx.set_title("where a step's time goes (rank 0)", fontsize=LABEL_PT)
    bx.legend(fontsize=SMALL_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return finish(fig)


def lr_recipe_tick(row, base_batch: int) -> str:
    """A row's tick label: ``8\nlr x0.5`` at the base batch, ``32\nsqrt`` at a larger one,
    then ``no warm-up`` where there was none.
    """
    what = f"lr x{row['lr_mult']:g}" if row["global_batch"] == base_batch else row["rule"]
    return f"{row['global_batch']}\n{what}" + ("" if row["warmup"] else "\nno warm-up")


def lr_recipe_figure(rows, figsize=(9, 3.4)):
    """The learning-rate recipe's experiment: final evaluation loss per configuration, a
    panel per optimizer.

    Args:
        rows: rows of ``benchmarks/lr_recipe.csv`` (:func:`ddp_lesson.bench.lr_recipe.read_csv`).

    Returns:
        The figure: per configuration the mean over seeds (point), min-max (bar) and each seed
        (dots); the grey band, the smallest batch at the base learning rate (min-max).
    """
    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = subplots(1, len(opts), figsize=figsize, squeeze=False, sharey=True)
    names = {"adam": "Adam", "sgd": "SGD, momentum 0.9"}
    for ax, opt in zip(axes[0], opts):
        rs = [r for r in rows if r["optimizer"] == opt]
        small = min(r["global_batch"] for r in rs)
        base = [r for r in rs if r["global_batch"] == small and r["lr_mult"] == 1]
        for r in base:
            ax.axhspan(r["eval_loss_min"], r["eval_loss_max"], color="#cccccc", alpha=0.6,
                       lw=0, label=f"batch {r['global_batch']}, base lr")
        for i, r in enumerate(rs):
            color = "#4c72b0" if r["global_batch"] == small else "#dd8452"
            if r.get("eval_loss") is None:
                ax.annotate("diverged", (i, ax.get_ylim()[1]), ha="center", va="top")
                continue
            ax.errorbar([i], [r["eval_loss"]], yerr=[[r["eval_loss"] - r["eval_loss_min"]],
                                                     [r["eval_loss_max"] - r["eval_loss"]]],
                        marker="o", color=color, capsize=3)
            seeds = [float(x) for x in r["eval_loss_per_seed"].split()]
            ax.plot([i + 0.18] * len(seeds), seeds, ".", color=color, ms=3, alpha=0.7)
        ax.set_xticks(range(len(rs)), [lr_recipe_tick(r, small) for r in rs], fontsize=SMALL_PT)
        ax.set_title(names.get(opt, opt), fontsize=LABEL_PT)
        ax.set_xlabel("global batch (sequences), learning rate")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=SMALL_PT, loc="upper left")
    axes[0][0].set_ylabel("final eval loss (nats/token)")
    return finish(fig)
