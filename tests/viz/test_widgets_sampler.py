"""The sampler explorer widget, built and driven without a browser.

The controls are set through their ipywidgets traits, as a user's clicks would set them; what
the explorer shows is checked against torch's own DistributedSampler and the literal values of
pitfalls.md §A.
"""
from __future__ import annotations

import re

import pytest
from sampler_reference import torch_shards

from ddp_lesson.widgets import sampler_explorer, sampler_report

pytestmark = pytest.mark.filterwarnings("ignore:DistributedSampler with drop_last=True")


def shown(text):
    """{rank: (indices, padded flags)} from the 'rank r: [...]' lines."""
    ranks = {}
    for line in text.splitlines():
        m = re.fullmatch(r"rank (\d+): \[(.*)\]", line)
        if m:
            items = [x.strip() for x in m.group(2).split(",") if x.strip()]
            ranks[int(m.group(1))] = ([int(x.rstrip("*")) for x in items],
                                      [x.endswith("*") for x in items])
    return ranks


def line_starting(text, prefix):
    return next(l for l in text.splitlines() if l.startswith(prefix))


@pytest.fixture(scope="module")
def explorer():
    return sampler_explorer(n=10, world_size=3)


def test_builds_without_a_display_and_has_a_constant_repr():
    import ipywidgets

    e = sampler_explorer()
    assert isinstance(e, ipywidgets.VBox)
    assert repr(e) == ("SamplerExplorer(N=10, world_size=3, epoch=0, seed=0, shuffle=False, "
                       "drop_last=False, set_epoch=True)")
    # what nbval compares when the widget is displayed, and what a reader sees where it cannot
    # be drawn (a stored notebook on GitHub): the report as text, fixed by the initial settings
    assert e._repr_mimebundle_()["text/plain"] == (
        "sampler explorer (run the notebook to move its sliders)\n" + e.text)
    assert e.text.splitlines()[3:6] == ["rank 0: [0, 3, 6, 9]", "rank 1: [1, 4, 7, 0*]",
                                        "rank 2: [2, 5, 8, 1*]"]
    assert e.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert e.values() == dict(n=10, world_size=3, epoch=0, seed=0, shuffle=False,
                              drop_last=False, call_set_epoch=True)


def test_initial_text_is_case_a3(explorer):
    explorer.set(n=10, world_size=3, epoch=0, seed=0, shuffle=False, drop_last=False,
                 call_set_epoch=True)
    text = explorer.text
    assert shown(text) == {0: ([0, 3, 6, 9], [False] * 4),
                           1: ([1, 4, 7, 0], [False, False, False, True]),
                           2: ([2, 5, 8, 1], [False, False, False, True])}
    assert "ceil(10 / 3) = 4; total_size = 12" in text
    assert line_starting(text, "padding").endswith("[0, 1]")
    assert "dropped: none" in text
    assert (
        explorer.report.value.startswith("<pre>")
        and "rank 1: [1, 4, 7, 0*]" in explorer.report.value
    )


def test_sliders_redraw_text_and_figure(explorer):
    explorer.set(n=10, world_size=3, epoch=0, seed=0, shuffle=False, drop_last=False,
                 call_set_epoch=True)
    before_png, before = explorer.image.value, explorer.redraws
    explorer.n.value = 11                      # one control, one redraw
    assert explorer.redraws == before + 1
    assert explorer.image.value != before_png
    explorer.drop_last.value = True  # A6: N=11, R=3, drop_last -> 3 each, 9 and 10 dropped
    assert shown(explorer.text) == {0: ([0, 3, 6], [False] * 3), 1: ([1, 4, 7], [False] * 3),
                                    2: ([2, 5, 8], [False] * 3)}
    assert line_starting(explorer.text, "dropped").endswith("[9, 10]")
    assert "ceil((11 - 3) / 3) = 3" in explorer.text
    assert "padding: none" in explorer.text
    explorer.world_size.value = 1
    assert shown(explorer.text) == {0: (list(range(11)), [False] * 11)}


def test_set_changes_several_controls_with_one_redraw(explorer):
    before = explorer.redraws
    explorer.set(n=12, world_size=3, drop_last=False)
    assert explorer.redraws == before + 1
    assert "N / R = 12 / 3 = 4" in explorer.text
    with pytest.raises(TypeError, match=r"unknown control\(s\) \['batch'\]"):
        explorer.set(batch=3)


@pytest.mark.parametrize("n,world,seed,epoch,drop_last",
                         [(10, 3, 0, 2, False), (23, 4, 7, 5, False), (11, 3, 1, 3, True),
                          (3, 7, 0, 1, False), (40, 8, 99, 9, True)])
def test_set_epoch_toggle_matches_torch(explorer, n, world, seed, epoch, drop_last):
    explorer.set(n=n, world_size=world, seed=seed, epoch=epoch, shuffle=True,
                 drop_last=drop_last, call_set_epoch=True)
    got = {r: idx for r, (idx, _) in shown(explorer.text).items()}
    assert got == dict(enumerate(torch_shards(n, world, True, seed, epoch, drop_last)))
    assert f"seed + epoch = {seed} + {epoch} = {seed + epoch}" in explorer.text
    # "call set_epoch" off: the sampler keeps epoch 0 whatever the slider says (A1)
    explorer.call_set_epoch.value = False
    got = {r: idx for r, (idx, _) in shown(explorer.text).items()}
    assert got == dict(enumerate(torch_shards(n, world, True, seed, 0, drop_last)))
    assert "set_epoch never called" in explorer.text


def test_padding_and_dropped_lists_match_torch_order(explorer):
    import torch

    explorer.set(n=10, world_size=3, seed=0, epoch=4, shuffle=True, drop_last=False,
                 call_set_epoch=True)
    g = torch.Generator()
    g.manual_seed(0 + 4)
    order = torch.randperm(10, generator=g).tolist()
    # padding = the first 2 entries of the order, dealt again, and starred where they land
    assert line_starting(explorer.text, "padding").endswith(str(order[:2]))
    starred = [i for idx, flags in shown(explorer.text).values()
               for i, f in zip(idx, flags) if f]
    assert sorted(starred) == sorted(order[:2])
    explorer.drop_last.value = True
    assert line_starting(explorer.text, "dropped").endswith(str(sorted(order[9:])))


def test_dataset_smaller_than_world(explorer):
    # A7: N=3, R=7 -> rank r gets [r % 3]; ranks 3..6 hold padding
    explorer.set(n=3, world_size=7, shuffle=False, drop_last=False, epoch=0)
    assert shown(explorer.text) == {r: ([r % 3], [r >= 3]) for r in range(7)}
    explorer.drop_last.value = True
    assert shown(explorer.text) == {r: ([], []) for r in range(7)}
    assert "every rank gets 0 samples" in explorer.text
    assert line_starting(explorer.text, "dropped").endswith("[0, 1, 2]")


def test_text_only_and_bad_initial_values():
    e = sampler_explorer(n=5, world_size=2, show_figure=False)
    assert e.image is None
    assert shown(e.text) == {0: ([0, 2, 4], [False] * 3), 1: ([1, 3, 0], [False, False, True])}
    with pytest.raises(ValueError, match=r"world_size=9 is outside the slider range \[1, 8\]"):
        sampler_explorer(world_size=9)
    with pytest.raises(ValueError, match=r"n=41 is outside the slider range \[0, 40\]"):
        sampler_explorer(n=41)


def test_report_is_the_same_text_without_a_widget():
    assert sampler_report(10, 3) == sampler_explorer(10, 3, show_figure=False).text
    assert "shuffle=False: seed and epoch change nothing" in sampler_report(10, 3, epoch=5)
    assert sampler_report(0, 2).splitlines()[3:] == ["rank 0: []", "rank 1: []", "padding: none",
                                                     "dropped: none"]
