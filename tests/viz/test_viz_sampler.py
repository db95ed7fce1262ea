"""Sampler figures (ddp_lesson.viz.sampler): the data they draw, checked against torch's sampler."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from sampler_reference import torch_shards  # noqa: E402

from ddp_lesson.viz.sampler import assignment_over_epochs, sampler_heatmap, sampler_layout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:DistributedSampler with drop_last=True")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def padding_cells(fig):
    """(rank, position) of every padding outline in a heatmap."""
    return sorted((round(p.get_y() + 0.5), round(p.get_x() + 0.5))
                  for p in fig.axes[0].patches if p.get_gid() == "padding")


@pytest.mark.parametrize("n,r,shuffle,seed,epoch,drop_last",
                         [(10, 3, False, 0, 0, False), (11, 3, True, 0, 1, True),
                          (23, 4, True, 5, 2, False), (3, 8, False, 0, 0, False)])
def test_layout_matches_torch(n, r, shuffle, seed, epoch, drop_last):
    lay = sampler_layout(n, r, shuffle, seed, epoch, drop_last)
    expected = torch_shards(n, r, shuffle, seed, epoch, drop_last)
    assert lay.shards == expected
    assert lay.num_samples == len(expected[0])
    # a position is padding iff its place in the padded order (j * R + r) is past N
    flat = [(j * r + rank, i) for rank, s in enumerate(expected) for j, i in enumerate(s)]
    assert sorted(i for p, i in flat if p >= n) == sorted(lay.padding)
    seen = {i for s in expected for i in s}
    assert sorted(lay.dropped) == sorted(set(range(n)) - seen)


def test_heatmap_a3_draws_the_shards_and_outlines_two_repeats():
    fig = sampler_heatmap(10, 3)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    grid = np.asarray(fig.axes[0].images[0].get_array())
    assert grid.tolist() == torch_shards(10, 3, False)  # [[0,3,6,9],[1,4,7,0],[2,5,8,1]]
    # A3: ranks 1 and 2 hold the repeats, in their last position
    assert padding_cells(fig) == [(1, 3), (2, 3)]
    assert "repeats of [0, 1]" in fig.axes[0].get_xlabel()
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == [str(i) for row in torch_shards(10, 3, False) for i in row]
    w, h = fig.get_size_inches()
    assert w <= 8 and h <= 5


def test_heatmap_drop_last_lists_the_dropped_tail():
    fig = sampler_heatmap(11, 3, shuffle=True, epoch=1, drop_last=True)
    shards = torch_shards(11, 3, True, 0, 1, True)
    assert np.asarray(fig.axes[0].images[0].get_array()).tolist() == shards
    assert padding_cells(fig) == []
    dropped = sorted(set(range(11)) - {i for s in shards for i in s})
    assert len(dropped) == 2
    assert f"dropped (drop_last): {dropped}" in fig.axes[0].get_xlabel()


def test_heatmap_with_empty_shards():
    fig = sampler_heatmap(3, 7, drop_last=True)  # A7: every rank gets 0 samples
    assert len(fig.axes[0].images) == 0
    assert any("0 samples" in t.get_text() for t in fig.axes[0].texts)


def owner_from_torch(n, r, epoch):
    """owner[i] = the rank that gets dataset index i as a non-padding entry."""
    owner = [None] * n
    for rank, shard in enumerate(torch_shards(n, r, True, 0, epoch)):
        for j, i in enumerate(shard):
            if j * r + rank < n:
                owner[i] = rank
    return owner


def test_assignment_over_epochs_without_and_with_set_epoch():
    fig = assignment_over_epochs(10, 3, epochs=4, seed=0)
    assert isinstance(fig, Figure)
    ax_without, ax_with = fig.axes[:2]
    assert "without" in ax_without.get_title() and "with set_epoch" in ax_with.get_title()
    without = np.asarray(ax_without.images[0].get_array())
    with_ = np.asarray(ax_with.images[0].get_array())
    assert without.shape == with_.shape == (4, 10)
    for e in range(4):
        assert without[e].tolist() == owner_from_torch(10, 3, 0)   # epoch stays 0
        assert with_[e].tolist() == owner_from_torch(10, 3, e)
    # the rows differ with set_epoch, are identical without
    assert len({tuple(row) for row in with_.tolist()}) > 1
    # 2 padded repeats per epoch, 4 epochs, marked as dots in each panel
    for ax in (ax_without, ax_with):
        dots = [c for c in ax.collections if c.get_gid() == "padding"]
        assert len(dots) == 1 and len(dots[0].get_offsets()) == 8


def test_assignment_over_epochs_masks_dropped_indices():
    fig = assignment_over_epochs(11, 3, epochs=2, drop_last=True)
    arr = fig.axes[1].images[0].get_array()
    for e in range(2):
        seen = {i for s in torch_shards(11, 3, True, 0, e, True) for i in s}
        assert sorted(np.flatnonzero(np.ma.getmaskarray(arr)[e]).tolist()) == \
            sorted(set(range(11)) - seen)


def test_assignment_over_epochs_legend_names_the_marks():
    # torch pads N=10 on R=3 to 12 entries, pads nothing for N=12, and cuts N=11 to 9 with
    # drop_last: the legend names the white dot / the grey only when the figure has them
    for n, drop_last, extra in ((10, False, ["padded repeat"]), (12, False, []),
                                (11, True, ["cut by drop_last"])):
        dealt = sum(len(s) for s in torch_shards(n, 3, True, 0, 0, drop_last))
        assert (dealt > n, dealt < n) == ("padded repeat" in extra, "cut by drop_last" in extra)
        fig = assignment_over_epochs(n, 3, epochs=2, drop_last=drop_last)
        assert [t.get_text() for t in fig.legends[0].get_texts()] == \
            ["rank 0", "rank 1", "rank 2"] + extra


def test_assignment_over_epochs_rejects_empty_dataset():
    with pytest.raises(ValueError, match="n must be >= 1 to draw the assignment, got 0"):
        assignment_over_epochs(0, 2)
