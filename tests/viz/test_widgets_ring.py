"""The ring all-reduce stepper: its states against a simulation written here from the algorithm.

The expected states for R = 3 are worked out by hand from the ring's description (Patarasuk &
Yuan 2009; Baidu's ring all-reduce): in reduce-scatter step s rank r sends chunk r - s to rank
r + 1, which adds it; in all-gather step s rank r sends chunk r + 1 - s, which overwrites.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from notebook_cells import code_cells

from ddp_lesson.collectives import simulate_ring_all_reduce
from ddp_lesson.viz.collectives import ring_state_html, ring_state_text
from ddp_lesson.widgets import ring_allreduce_stepper

ROOT = Path(__file__).resolve().parents[2]

# R = 3, contributors of every (rank, chunk) after each step, worked out by hand.
# Step 1: 0->1 c0, 1->2 c1, 2->0 c2.  Step 2: 0->1 c2, 1->2 c0, 2->0 c1 (reduce-scatter done:
# rank r owns chunk r+1).  Step 3: 0->1 c1, 1->2 c2, 2->0 c0.  Step 4: 0->1 c0, 1->2 c1, 2->0 c2.
A = frozenset({0, 1, 2})
HAND = {
    0: [[{0}, {0}, {0}], [{1}, {1}, {1}], [{2}, {2}, {2}]],
    1: [[{0}, {0}, {0, 2}], [{0, 1}, {1}, {1}], [{2}, {1, 2}, {2}]],
    2: [[{0}, A, {0, 2}], [{0, 1}, {1}, A], [A, {1, 2}, {2}]],
    3: [[A, A, {0, 2}], [{0, 1}, A, A], [A, {1, 2}, A]],
    4: [[A, A, A], [A, A, A], [A, A, A]],
}
HAND_MOVES = {
    1: {(0, 1, 0), (1, 2, 1), (2, 0, 2)},
    2: {(0, 1, 2), (1, 2, 0), (2, 0, 1)},
    3: {(0, 1, 1), (1, 2, 2), (2, 0, 0)},
    4: {(0, 1, 0), (1, 2, 1), (2, 0, 2)},
}


def _values_from_contributors(contrib, inputs):
    # a chunk that sums ranks S holds Σ_{q in S} inputs[q][chunk]
    return [[sum(inputs[q][c] for q in contrib[r][c]) for c in range(3)] for r in range(3)]


def test_r3_states_match_the_hand_simulation():
    inputs = [[1, 2, 3], [10, 20, 30], [100, 200, 300]]
    states = simulate_ring_all_reduce(3)
    assert len(states) == 5 and [s.step for s in states] == [0, 1, 2, 3, 4]
    assert [s.phase for s in states] == ["start", "reduce-scatter", "reduce-scatter",
                                         "all-gather", "all-gather"]
    for step, state in enumerate(states):
        assert [[set(c) for c in row] for row in state.contributors] == \
            [[set(c) for c in row] for row in HAND[step]], step
        want = _values_from_contributors(HAND[step], inputs)
        assert [[v[0] for v in row] for row in state.values] == want, step
        if step:
            assert set(state.moves) == HAND_MOVES[step]
    assert all(v == ((111,), (222,), (333,)) for v in states[-1].values)


@pytest.mark.parametrize("R,numel", [(1, 3), (2, 5), (4, 4), (5, 3), (6, 13)])
def test_any_world_size_ends_with_the_sum_everywhere(R, numel):
    inputs = [[float(r * 100 + i) for i in range(numel)] for r in range(R)]
    states = simulate_ring_all_reduce(R, inputs)
    assert len(states) == 2 * (R - 1) + 1
    total = [sum(inputs[r][i] for r in range(R)) for i in range(numel)]
    for r in range(R):
        flat = [v for chunk in states[-1].values[r] for v in chunk]
        assert flat == total
        assert all(c == frozenset(range(R)) for c in states[-1].contributors[r])
    # after the reduce-scatter, rank r owns chunk (r+1) mod R, fully summed
    rs = states[R - 1]
    for r in range(R):
        assert rs.contributors[r][(r + 1) % R] == frozenset(range(R))
    with pytest.raises(ValueError):
        simulate_ring_all_reduce(3, [[1.0], [2.0]])


def test_stepper_is_built_without_a_display_and_follows_its_sliders():
    s = ring_allreduce_stepper(world_size=3)
    assert repr(s) == "RingAllReduceStepper(world_size=3, step=0 of 4)"
    # shown where the widget cannot be drawn (stored notebook, GitHub): text, not the repr
    assert s._repr_mimebundle_()["text/plain"].splitlines() == [
        "ring all-reduce stepper, world size 3 (run the notebook to move its sliders)",
        "step 0 of 4: inputs, nothing sent yet",
        "rank 0: c0=[1] Σ0  c1=[2] Σ0  c2=[3] Σ0",
        "rank 1: c0=[10] Σ1  c1=[20] Σ1  c2=[30] Σ1",
        "rank 2: c0=[100] Σ2  c1=[200] Σ2  c2=[300] Σ2"]
    assert s.step.max == 4 and s.state.step == 0
    assert s.text.splitlines()[0] == "step 0 of 4: inputs, nothing sent yet"
    s.step.value = 2
    assert s.state.step == 2
    assert s.text == ring_state_text(simulate_ring_all_reduce(3)[2])
    assert s.view.value == ring_state_html(s.state)
    assert "rank 2 → rank 0: chunk 1" in s.view.value
    s.world_size.value = 4
    assert s.step.max == 6 and len(s.states) == 7 and s.state.step == 2
    assert repr(s) == "RingAllReduceStepper(world_size=4, step=2 of 6)"
    s.world_size.value = 2
    assert s.step.max == 2 and s.state.step == 2
    assert "done: every rank holds the full sum" in s.text
    with pytest.raises(ValueError, match=r"step=5 is outside \[0, 4\]"):
        ring_allreduce_stepper(world_size=3, step=5)
    with pytest.raises(ValueError, match=r"world_size=9 is outside \[1, 6\]"):
        ring_allreduce_stepper(world_size=9)


def test_custom_values_are_kept_for_their_world_size():
    s = ring_allreduce_stepper(world_size=2, values=[[1.0, 2.0], [3.0, 4.0]], step=2)
    assert s.text.splitlines()[-1] == "rank 1: c0=[4] Σ01  c1=[6] Σ01"
    s.world_size.value = 3                         # other sizes use the default inputs
    s.world_size.value = 2
    assert "c0=[4]" in s.text


def test_notebook_03_stepper_outputs():
    cells = code_cells("03_collectives.ipynb")
    shown = next(c for c in cells if c.source.strip().endswith("stepper"))
    reprs = [o["data"]["text/plain"] for o in shown.outputs if "data" in o]
    # a reader's text where the widget cannot be drawn (a stored notebook on GitHub), not the
    # Python repr
    assert reprs == [ring_allreduce_stepper(world_size=3)._repr_mimebundle_()["text/plain"]]
    stepper, texts = ring_allreduce_stepper(world_size=3), []   # the states the widget shows
    for k in (1, 2, 4):
        stepper.step.value = k
        texts.append(stepper.text)
    text = "\n\n".join(texts)
    inputs = [[1, 2, 3], [10, 20, 30], [100, 200, 300]]
    for step in (1, 2, 4):
        vals = _values_from_contributors(HAND[step], inputs)
        for r in range(3):
            cells_txt = "  ".join(
                f"c{c}=[{vals[r][c]}] Σ{''.join(str(q) for q in sorted(HAND[step][r][c]))}"
                for c in range(3))
            assert f"rank {r}: {cells_txt}" in text, (step, r)
        moves = sorted(HAND_MOVES[step])
        assert "moves: " + ", ".join(f"r{s}->r{d} c{c}" for s, d, c in moves) in text
    assert "step 4 of 4: all-gather (done: every rank holds the full sum)" in text
