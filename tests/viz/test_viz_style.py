"""Figures readable at 100% zoom: at least 700 px wide, no text under 9 pt, legends off the data.

Drawn from small hand-made rows (no benchmark is run); the stored CSVs are read where a figure
needs real rows.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

from ddp_lesson.viz.collectives import (
    allreduce_bandwidth_figure,
    cost_model_figure,
    ring_allreduce_steps_figure,
)
from ddp_lesson.viz.ddp import bucket_sweep_figure
from ddp_lesson.viz.sampler import sampler_heatmap
from ddp_lesson.viz.style import DPI, subplots
from ddp_lesson.viz.training import lr_recipe_figure, scaling_figure

ROOT = Path(__file__).resolve().parents[2]


def _allreduce_rows():
    from ddp_lesson.bench.allreduce import summarise

    rows = []
    for R in (2, 4):
        for m in ("gloo", "ring", "pipelined", "sendrecv", "shift"):
            for kib in (64, 1024, 16384):
                rows.append(summarise(R, m, kib * 1024, [1e-3 * kib / 64, 2e-3 * kib / 64], 1))
    return rows


def _figures():
    from ddp_lesson.bench.lr_recipe import read_csv
    from ddp_lesson.bench.scaling import aggregate
    from ddp_lesson.cost_model import predict_bucket_sweep

    ar = _allreduce_rows()
    phases = {p: 0.001 for p in ("data", "forward", "backward", "comm_exposed", "optimizer",
                                 "other")}
    runs = [{"mode": "weak", "nprocs": n, "batch_per_rank": 8, "global_batch": 8 * n,
             "steps": 2, "samples_per_s": s, "step_s": 0.1, "phases": phases}
            for n, s in ((1, 100.0), (1, 110.0), (2, 180.0), (2, 170.0))]
    sweep = predict_bucket_sweep([4000] * 10, [0, 0.01, 1], 0.01, 2, 1e-4, 1e8)
    return {
        "allreduce_bandwidth_figure": lambda: allreduce_bandwidth_figure(ar),
        "cost_model_figure": lambda: cost_model_figure(ar),
        "ring_allreduce_steps_figure": lambda: ring_allreduce_steps_figure(3),
        "scaling_figure": lambda: scaling_figure(aggregate(runs)),
        "bucket_sweep_figure": lambda: bucket_sweep_figure(sweep, [(0, 0.001), (1, 0.002)]),
        "sampler_heatmap": lambda: sampler_heatmap(10, 3),
        "lr_recipe_figure": lambda: lr_recipe_figure(read_csv(ROOT / "benchmarks" /
                                                              "lr_recipe.csv")),
    }


@pytest.mark.parametrize("name", sorted(_figures()))
def test_figure_is_wide_enough_and_its_text_big_enough(name):
    fig = _figures()[name]()
    try:
        width_px = fig.get_size_inches()[0] * fig.dpi
        assert width_px >= 700, f"{name}: {width_px:.0f} px wide"
        assert fig.dpi == DPI
        sizes = {t.get_text(): t.get_fontsize() for t in fig.findobj(Text) if t.get_text()}
        small = {k: v for k, v in sizes.items() if v < 9}
        assert not small, f"{name}: text under 9 pt: {small}"
    finally:
        plt.close(fig)


def test_subplots_widens_a_narrow_figure_keeping_its_aspect():
    fig, _ = subplots(figsize=(3.6, 1.5))
    assert tuple(fig.get_size_inches()) == pytest.approx((7.2, 3.0))
    assert fig.get_size_inches()[0] * fig.dpi == pytest.approx(720)
    plt.close(fig)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_allreduce_legend_covers_no_panel():
    """The legend sits below both panels, so it covers none of the R = 4 panel's lines."""
    fig = allreduce_bandwidth_figure(_allreduce_rows())
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert ax.get_legend() is None
            assert not _overlaps(box, ax.get_window_extent(renderer))
        assert [c.get_gid() for c in fig.axes[1].collections].count("spread") == 5
    finally:
        plt.close(fig)


def test_bucket_sweep_counts_sit_under_the_ticks_not_behind_points():
    from ddp_lesson.cost_model import predict_bucket_sweep

    rows = predict_bucket_sweep([4000] * 10, [0, 0.01, 1], 0.01, 2, 1e-4, 1e8)
    fig = bucket_sweep_figure(rows, [(0, 0.001), (1, 0.002)])
    try:
        ax = fig.axes[0]
        assert not ax.texts                            # no labels inside the axes
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == [f"{cap}\n{r['buckets']}" for cap, r in zip(("0", "0.01", "1"), rows)]
    finally:
        plt.close(fig)
