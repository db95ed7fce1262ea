"""Notebook 00's torchrun topology and notebook 08's data-movement figures: content and style."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

from ddp_lesson.viz.memory import data_movement_figure, data_movement_per_step
from ddp_lesson.viz.torchrun import torchrun_topology_figure


def _check_style(fig):
    assert fig.get_size_inches()[0] * fig.dpi >= 700
    small = [t.get_text() for t in fig.findobj(Text) if t.get_text() and t.get_fontsize() < 9]
    assert small == []


def test_topology_grid_ranks_and_local_ranks():
    fig = torchrun_topology_figure(2, 4)
    try:
        _check_style(fig)
        texts = {t.get_gid(): t.get_text() for t in fig.findobj(Text) if t.get_gid()}
        for rank in range(8):
            assert texts[f"worker{rank}"] == f"worker\nRANK {rank}\nLOCAL_RANK {rank % 4}"
        assert {"agent0", "agent1"} <= set(texts)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("R", [2, 8])
def test_data_movement_per_step(R):
    f = (R - 1) / R
    totals = {k: sum(u for _, u in v) for k, v in data_movement_per_step(R).items()}
    assert totals == pytest.approx({"DDP": 2 * f, "ZeRO-1 (ours, torch ZeRO)": 3 * f,
                                    "ZeRO-1 (paper)": 2 * f, "FSDP (ZeRO-3)": 3 * f})
    # ZeRO-3's 1.5x of DDP's traffic, in the ring model
    assert totals["FSDP (ZeRO-3)"] / totals["DDP"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="got 0"):
        data_movement_per_step(0)


def test_data_movement_figure_totals():
    fig = data_movement_figure(8)
    try:
        _check_style(fig)
        texts = {t.get_gid(): t.get_text() for t in fig.findobj(Text) if t.get_gid()}
        assert texts["total:DDP"] == "1.75"
        assert texts["total:FSDP (ZeRO-3)"] == "2.62"
    finally:
        plt.close(fig)
