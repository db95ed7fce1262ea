"""DDP's edge cases from public bug reports, torch's DDP and the cores of notebook 04:
docs/pitfalls.md B15-B24, B31-B33; 2 ranks.

One torchrun launch (gloo, 20 s process-group timeout) runs every scenario of the test program
``tests/programs/ddp_edge_cases.py`` and prints one JSON line per scenario and rank; deep dive
04 · DDP's edge cases states these numbers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddp_lesson.launch import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CORES = ("core naive", "core bucketed")
NAMES = {"core naive": "NaiveDDP", "core bucketed": "BucketedDDP"}
PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "ddp_edge_cases.py"
DEEP_DIVE = Path(__file__).resolve().parents[2] / "notebooks/deep/04_ddp_edge_cases.ipynb"


@pytest.fixture(scope="module")
def lab():
    r = run_torchrun(str(PROGRAM), nproc_per_node=2, timeout=150, live=False, backend="gloo")
    out: dict = {}
    for rank in (0, 1):
        for line in r.rank_lines(rank):
            if line.startswith("{"):
                d = json.loads(line)
                out.setdefault(d.pop("scenario"), {})[d.pop("rank")] = d
    return out


def _both(lab, scenario, key):
    return [lab[scenario][r][key] for r in (0, 1)]


def test_case1_a_model_that_differs_raises_the_same_error_on_every_rank(lab):
    # the cores' construction check (an all_gather of names, shapes, requires_grad)
    for v in CORES:
        for key, theirs in (("out_features", "('weight', (2, 4), True)"),
                            ("transposed", "('weight', (4, 3), True)"),
                            ("no trainable on rank 1", "('weight', (3, 4), False)")):
            e0, e1 = _both(lab, "different_models", f"{v} {key}")
            assert e0 == e1, (v, key)  # the very same error on both ranks
            kind, cls, msg = e0
            assert (kind, cls) == ("error", "ValueError")
            assert msg == (f"{NAMES[v]}: the model differs between ranks: rank 0 has "
                           f"('weight', (3, 4), True), rank 1 has {theirs}. Build the same "
                           "model on every rank"), msg


def test_case2_join_shadows_uneven_inputs_in_torchs_ddp(lab):
    assert _both(lab, "uneven_inputs", "torch divide_by_initial_world_size=True") == [
        [2.0, 3.0, 3.0], [2.0, 3.0]]
    assert _both(lab, "uneven_inputs", "torch divide_by_initial_world_size=False") == [
        [2.0, 3.0, 6.0], [2.0, 3.0]]


def test_case3_buffers_replaced_in_forward(lab):
    assert _both(lab, "buffers_reassigned", "torch broadcast_buffers=True") == [[2.125], [2.625]]
    # broadcast_buffers=False: no broadcast at all, not even at construction (torch's rule)
    assert _both(lab, "buffers_reassigned", "torch broadcast_buffers=False") == [
        [2.125], [4.25]]
    for v in CORES:  # rank 0's buffer at construction only: rank 1 keeps its own EMA of 3.0
        assert _both(lab, "buffers_reassigned", v) == [[2.125], [3.0]], v


def test_case4_gradients_no_wrapper_averages_stay_local_silently(lab):
    # torch's DDP and the cores alike: the ranks diverge, no error (docs/pitfalls.md B18)
    for v in ("torch", *CORES):
        assert _both(lab, "unfrozen_after_wrapping", v + " unfrozen") == [[1.0], [3.0]], v
        assert _both(lab, "unfrozen_after_wrapping", v + " added") == [[1.0], [3.0]], v
    # frozen after wrapping: no gradient from torch; the cores send zeros for it (B31)
    assert _both(lab, "unfrozen_after_wrapping", "torch frozen") == [[None], [None]]
    for v in CORES:
        assert _both(lab, "unfrozen_after_wrapping", v + " frozen") == [[0.0], [0.0]], v


def test_case5_no_sync_micro_batch_with_an_unused_parameter(lab):
    # torch with find_unused_parameters=True, the cores without a flag: a.grad, b.grad, and
    # warnings advising to leave the flag False
    for v in ("torch", *CORES):
        assert _both(lab, "unused_with_no_sync", v) == [[3.0, 5.0, 0], [3.0, 5.0, 0]], v


def test_case6_checkpointed_forward_gives_torchs_gradients(lab):
    ref = lab["reentrant_checkpoint"][0]["torch use_reentrant=True"]
    assert ref[-2:] == [5.0, 5.0]  # head.bias: 5 samples, summed, averaged over 2 ranks
    for r in (0, 1):
        for v in ("torch", *CORES):
            for reentrant in (True, False):
                assert lab["reentrant_checkpoint"][r][f"{v} use_reentrant={reentrant}"] == ref


def test_case7_torch_signature_device_ids_on_cpu(lab):
    for r in (0, 1):
        got = lab["device_ids"][r]
        assert got["torch None"] == []
        assert got["torch [0]"][:2] == ["error", "ValueError"]
        assert "device_ids [0], output_device None" in got["torch [0]"][2]


def test_a_forward_without_backward_then_training_is_averaged(lab):
    # no buffers: nothing is sent in forward, so the next backwards pair up (x = 1, 2: 1.5)
    for v in ("torch", *CORES):
        assert _both(lab, "skipped_backward", v) == [[1.5, 1.5]] * 2, v


def test_pre_division_keeps_an_fp16_average_finite(lab):
    # 40000 + 40000 overflows fp16 (max 65504); 20000 + 20000 does not
    for v in ("torch", *CORES):
        assert _both(lab, "fp16_sum", v) == [[40000.0], [40000.0]], v


def test_case8_zero1_is_an_optimizer_with_the_models_groups_like_torchs(lab):
    for r in (0, 1):
        got = lab["zero_optimizer"][r]
        for v in ("torch", "ours"):
            # group 1 (40 ones) has lr 0; the others step by 0.1 * 1
            assert got[v + " values"] == [0.9, 1.0, 0.9, 0.9], (v, r)
            assert got[v + " groups"] == [1, 1, 1, 1], (v, r)
            assert got[v + " is Optimizer"] == [True]
            # LambdaLR(0.5 ** epoch) on lr 0.1 and on the added group's 0.2
            assert got[v + " lrs"] == [[0.05, 0.1], [0.025, 0.05], [0.0125, 0.025]]
            # momentum 0.9: 1 - (0.1 + 0.05 * 1.9 + 0.025 * 2.71) = 0.73725; lr 0.2 group: 0.4745
            assert got[v + " after 3 steps"] == [0.73725, 0.73725, 0.4745, 0.4745]
    got = lab["zero_optimizer"][0]
    for v in ("torch", "ours"):
        assert got[v + " state"] == {"0": 2.71, "1": 2.71, "2": 2.71, "3": 2.71}  # 1+0.9+0.81
        assert got[v + " saved groups"] == [[[0, 1], 0.0125, 0.9], [[2, 3], 0.025, 0.9]]
    assert got["ours reloaded groups"] == [[0.0125, 0.9], [0.025, 0.9]]


def test_b32_torch_averages_only_the_first_of_several_backwards(lab):
    # torch 2.13: the first backward after the forwards is averaged, the others stay local
    assert _both(lab, "several_backwards", "torch") == [[3.0, 5.0, 8.0], [3.0, 9.0, 16.0]]
    assert _both(lab, "several_backwards", "torch find_unused") == [
        [3.0, 5.0, 8.0], [3.0, 9.0, 16.0]]
    assert _both(lab, "several_backwards", "torch no_sync first") == [
        [5.0, 7.0, 10.0], [5.0, 11.0, 18.0]]


def test_b32_the_cores_average_every_backward(lab):
    # each backward's share averaged: 3, then 3 + (2 + 6) / 2, then 7 + (3 + 7) / 2
    for v in CORES:
        assert _both(lab, "several_backwards", v) == [[3.0, 7.0, 12.0]] * 2, v
        # the no_sync micro-batch (4 and 0) is averaged by the first synchronised backward
        assert _both(lab, "several_backwards", v + " no_sync first") == [[5.0, 9.0, 14.0]] * 2
        # forward a+b (x = 1, 5), forward a (x = 2, 6); b's gradient only in the first backward
        assert _both(lab, "several_backwards", f"{v} ab then a") == [
            [[3.0, 3.0], [7.0, 3.0]]] * 2, v


def test_b32_a_no_grad_forward_between_forward_and_backward_changes_nothing(lab):
    # x = 1 and 5: the mean 3.0 on both ranks
    for v in ("torch", *CORES):
        assert _both(lab, "several_backwards", v + " no_grad forward between") == [[3.0]] * 2, v


def test_b33_two_forwards_one_backward_with_a_buffer(lab):
    # lin(x) * scale, w = 1, scale 2, x = 1 and 2, two forwards: (2 * 2 + 4 * 2) / 2 = 6.0.
    # The buffer's version: 1 in torch (its construction sync copies into it), and torch's
    # broadcast before the second forward keeps it (_unsafe_preserve_version_counter in
    # _sync_buffers), so the first forward's backward runs; 0 in the cores, which broadcast
    # into it at construction only
    assert _both(lab, "two_forwards_buffer", "torch scaled") == [[6.0, 1]] * 2
    for v in CORES:
        assert _both(lab, "two_forwards_buffer", v + " scaled") == [[6.0, 0]] * 2, v
    torch0, torch1 = _both(lab, "two_forwards_buffer", "torch batchnorm")
    assert torch0[:10] == torch1[:10]           # gradients averaged
    assert torch0[10:] != torch1[10:]           # running statistics: each rank's second batch
    for v in CORES:
        core0, core1 = _both(lab, "two_forwards_buffer", v + " batchnorm")
        assert core0 == torch0, v               # rank 0: the same gradients and statistics
        assert core1[:10] == torch1[:10], v     # rank 1: the same gradients, its own statistics
        assert core1[10:] not in (torch1[10:], core0[10:]), v


def test_the_deep_dive_states_the_numbers_of_this_run(lab):
    import nbformat

    nb = nbformat.read(DEEP_DIVE, as_version=4)
    text = re.sub(r"\s+", " ", " ".join(c.source for c in nb.cells if c.cell_type == "markdown"))

    def nums(values):
        return ", ".join(f"{v:g}" if v % 1 else f"{v:.1f}" for v in values)

    r0, r1 = _both(lab, "uneven_inputs", "torch divide_by_initial_world_size=True")
    r0_false = lab["uneven_inputs"][0]["torch divide_by_initial_world_size=False"]
    assert (f"rank 0's gradients are {nums(r0)} (the default `divide_by_initial_world_size=True`"
            f": the joined rank counts as a zero) or {nums(r0_false)} with `False`; rank 1's "
            f"are {nums(r1)}.") in text
    assert f"rank 1 holds {lab['buffers_reassigned'][1]['torch broadcast_buffers=True'][0]:g} " \
        "after 3 steps" in text
    assert f"(rank 1: {lab['buffers_reassigned'][1]['torch broadcast_buffers=False'][0]:g})" in text
    assert f"its own copy ({lab['buffers_reassigned'][1]['core naive'][0]:.1f})" in text
    u0, u1 = _both(lab, "unfrozen_after_wrapping", "torch unfrozen")
    assert f"leave {u0[0]:.1f} on rank 0 and {u1[0]:.1f} on rank 1" in text
    assert f"the next backwards average ({lab['skipped_backward'][0]['torch'][0]:g})" in text
    t0, t1 = _both(lab, "several_backwards", "torch")
    core = lab["several_backwards"][0]["core naive"]
    assert (f"give {', '.join(f'{v:g}' for v in core)} on both ranks with the cores, and "
            f"{', '.join(f'{v:g}' for v in t0)} vs {', '.join(f'{v:g}' for v in t1)} with torch"
            ) in text
    a, b, _ = lab["unused_with_no_sync"][0]["torch"]
    assert f"`a` gets {a:.1f} and `b` {b:.1f} on both ranks" in text
    assert f"Two fp16 gradients of 40000 average to {lab['fp16_sum'][0]['torch'][0]:g}" in text
