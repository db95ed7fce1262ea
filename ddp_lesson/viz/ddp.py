"""The DDP wrappers at work (notebook 04): a step's timeline per rank, the bucket-size
sweep, the wrappers' benchmark, and the map of torch's C++ Reducer onto our BucketedDDP."""
from __future__ import annotations

from .style import LABEL_PT, MIN_WIDTH_IN, SMALL_PT, finish, subplots

__all__ = ["ddp_timeline_figure", "bucket_sweep_figure", "ddp_benchmark_figure", "REDUCER_MAP",
           "reducer_map_figure"]


def _as_step_record(rec):
    from ..commsim import StepRecord

    return rec if isinstance(rec, StepRecord) else StepRecord.from_dict(rec)


def ddp_timeline_figure(panels, figsize=(7, 3.4), align: bool = True):
    """Per-rank timeline of one training step: backward, gradient-ready ticks, all-reduces.

    One panel per scenario (e.g. NaiveDDP, buckets without and with overlap), sharing the time
    axis. Each rank has two lanes: backward (grey bar from the end of forward to the end of
    autograd, a tick per accumulated gradient) and its all-reduces (a box per bucket or
    parameter), with, hatched in red, the time from the end of its backward until
    ``backward()`` returned averaged gradients (communication, or waiting for a slower rank).
    Titles give the job's exposed communication (:func:`ddp_lesson.commsim.job_exposed_s`).

    Args:
        panels: ``[(title, records), ...]``, ``records`` one
            :class:`ddp_lesson.commsim.StepRecord` (or its ``to_dict()``) per rank, in rank order.
        figsize: inches.
        align: shift each rank by its ``t0_s`` (when its forward returned, monotonic clock) onto
            one time axis from the earliest rank; False: every rank starts at 0 (ranks on
            different machines).

    Returns:
        The ``Figure``, one Axes per panel; exposed spans have ``gid == "exposed"``, all-reduce
        boxes ``gid == "comm"``.
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
        ax.set_yticks(range(len(records)),
                      [f"rank {len(records) - 1 - i}" for i in range(len(records))],
                      fontsize=SMALL_PT)
        ax.set_ylim(-0.6, len(records) - 0.4)
        if align:
            from ..commsim import job_exposed_s

            exposed = job_exposed_s(records) * 1e3
            what = "after the last rank's backward"
        else:
            exposed, what = max(r.exposed_s for r in records) * 1e3, "on the slowest rank"
        ax.set_title(f"{title}: {exposed:.0f} ms of communication exposed {what}",
                     fontsize=SMALL_PT)
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
        predicted: rows of :func:`ddp_lesson.cost_model.predict_bucket_sweep` (its last row,
            ``cap_mb=None``, is NaiveDDP: a horizontal line).
        measured: optional ``[(cap_mb, exposed_s), ...]`` (several per cap allowed;
            ``cap_mb=None``: NaiveDDP).
        figsize: inches.

    Returns:
        The ``Figure`` (log-scaled x); the model's line has ``gid == "model"``, the measured
        points ``gid == "measured"``.
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
        rows: rows of ``benchmarks/ddp.csv`` (:func:`ddp_lesson.bench.ddp.read_results`).
        figsize: inches.

    Returns:
        The ``Figure``: left no link, right under the link; bars labelled with their exposed
        communication share where measured, error bars min..max over rounds.
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
        ax.set_xticks(range(len(mine)), [n.replace("-no-overlap", "\nno overlap") for n in names],
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


#: The rows of :func:`reducer_map_figure`: (stage, our BucketedDDP, torch's C++ Reducer).
REDUCER_MAP = [
    ("1 · a gradient is\naccumulated",
     "p.register_post_accumulate_grad_hook(hook)\n→ _grad_ready(i):\n  _pending[bucket] -= 1",
     "AccumulateGrad post-hook →\nReducer::autograd_hook(i) →\n"
     "mark_variable_ready_dense(i): copy\n.grad × 1/div_factor_ into its bucket\n"
     "view (a plain copy if a hook is set)"),
    ("2 · a bucket is\nready",
     "pending == 0 → _launch(b): torch.cat\nthe .grads into _flat[b]; _send ÷ R\n"
     "(in bucket order on every rank)",
     "pending == 0 (its views were\nfilled at step 1) →\n"
     "mark_bucket_ready (in bucket order)"),
    ("3 · all-reduce",
     "comm_hook(flat, group) → work (.wait())\ndefault: dist.all_reduce(flat,\n"
     "  async_op=True), a SUM",
     "all_reduce_bucket → run_comm_hook(\n  GradBucket) → Future[Tensor];\n"
     "a registered hook divides itself"),
    ("4 · end of\nbackward",
     "queue_callback(_after_backward):\nwait every bucket,\ncopy _flat[b] → .grad",
     "queue_callback(finalize_backward):\nwait the futures, copy into .grad\n"
     "(a view: no copy). Rebuilt once, before\nforward 2 (static_graph: 3); never\n"
     "with find_unused_parameters=True"),
]


def reducer_map_figure(figsize=(11, 5.4)):
    """Our ``BucketedDDP`` (ddp_lesson/core/bucketed_ddp.py) beside torch's C++ ``Reducer``.

    Four rows (:data:`REDUCER_MAP`): a gradient is accumulated, its bucket is ready, the bucket
    is all-reduced, backward ends. torch rebuilds its buckets once, in gradient-ready order,
    before the 2nd forward (``static_graph``: the 3rd; ``find_unused_parameters=True``: never;
    ``_BucketCapacityConfig``, ``_pre_forward``; ``tests/ddp/test_ddp_buckets.py``). Sources:
    ``torch/nn/parallel/distributed.py``, ``torch/csrc/distributed/c10d/reducer.hpp`` (2.13).

    Args:
        figsize: inches (80 dpi: the default is 880 px wide); no text under 9 pt.

    Returns:
        The ``Figure`` (axis off); each box's text has ``gid`` ``"stage{k}"``, ``"ours{k}"``
        or ``"torch{k}"``.
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
        (16, 40.5, "our BucketedDDP (core/bucketed_ddp.py)", "#dbe9f6"),
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
