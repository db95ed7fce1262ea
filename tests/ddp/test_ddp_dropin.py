"""NaiveDDP and BucketedDDP as drop-ins for torch's DDP: docs/pitfalls.md B15-B23, B31-B33;
2 ranks.

One torchrun launch (gloo, 20 s process-group timeout) runs every scenario of the test program
``tests/programs/ddp_dropin.py`` and prints one JSON line per scenario and rank; torch's
``DistributedDataParallel`` runs the same inputs where it is the reference.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_lesson.launch import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
OURS = ("naive", "bucketed")
NAMES = {"naive": "NaiveDDP", "bucketed": "BucketedDDP"}
PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "ddp_dropin.py"


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
    for v in OURS:
        for key, diff in (("out_features", "shape (3, 4) on rank 0 but (2, 4) on rank 1"),
                          ("transposed", "shape (3, 4) on rank 0 but (4, 3) on rank 1"),
                          ("no trainable on rank 1",
                           "requires_grad=True on rank 0 but False on rank 1")):
            e0, e1 = _both(lab, "different_models", f"{v} {key}")
            assert e0 == e1, (v, key)  # the very same error on both ranks
            kind, cls, msg = e0
            assert (kind, cls) == ("error", "ValueError")
            assert msg.startswith(f"{NAMES[v]}: the model differs between ranks")
            assert "parameter 0 ('weight' on rank 0, 'weight' on rank 1)" in msg
            assert diff in msg, msg


def test_case2_join_shadows_uneven_inputs_like_torch(lab):
    for v in ("torch", *OURS):
        assert _both(lab, "uneven_inputs", f"{v} divide_by_initial_world_size=True") == [
            [2.0, 3.0, 3.0], [2.0, 3.0]], v
        assert _both(lab, "uneven_inputs", f"{v} divide_by_initial_world_size=False") == [
            [2.0, 3.0, 6.0], [2.0, 3.0]], v


def test_case3_buffers_replaced_in_forward_are_broadcast_like_torch(lab):
    for v in ("torch", *OURS):
        assert _both(lab, "buffers_reassigned", f"{v} broadcast_buffers=True") == [
            [2.125], [2.625]], v
        # broadcast_buffers=False: no broadcast at all, not even at construction (torch's rule)
        assert _both(lab, "buffers_reassigned", f"{v} broadcast_buffers=False") == [
            [2.125], [4.25]], v


def test_case4_gradients_the_wrapper_does_not_average_are_an_error_on_every_rank(lab):
    assert _both(lab, "unfrozen_after_wrapping", "torch unfrozen") == [[1.0], [3.0]]  # diverged
    for v in OURS:
        for key, names in (("unfrozen", "rank 0: net.0.weight; rank 1: net.0.weight"),
                           ("added", "rank 0: extra; rank 1: extra")):
            e0, e1 = _both(lab, "unfrozen_after_wrapping", f"{v} {key}")
            assert e0 == e1
            assert e0[:2] == ["error", "RuntimeError"]
            assert names in e0[2] and "Wrap the model again" in e0[2], e0
        # frozen after wrapping: named as such, and told to wrap again, not to freeze it
        e0, e1 = _both(lab, "unfrozen_after_wrapping", f"{v} frozen")
        assert e0 == e1 and e0[:2] == ["error", "RuntimeError"], e0
        assert ("rank 0: net.0.weight (index 0; frozen after wrapping); rank 1: net.0.weight "
                "(index 0; frozen after wrapping)") in e0[2], e0
        assert "Wrap the model again after changing requires_grad" in e0[2], e0
        assert "freeze it" not in e0[2], e0


def test_case5_no_sync_with_find_unused_gives_torchs_values_and_no_bad_advice(lab):
    for v in ("torch", *OURS):
        # a.grad, b.grad, warnings advising to leave the flag False
        assert _both(lab, "unused_with_no_sync", f"{v} find_unused=True") == [
            [3.0, 5.0, 0], [3.0, 5.0, 0]], v
    for v in OURS:
        e0, e1 = _both(lab, "unused_with_no_sync", f"{v} find_unused=False")
        assert e0 == e1 and e0[:2] == ["error", "RuntimeError"]
        assert ("a.weight (index 0; it got its gradient only inside no_sync(), so "
                "find_unused_parameters=True is needed)") in e0[2]
        assert "b.weight" not in e0[2]


def test_case6_checkpointed_forward_gives_torchs_gradients(lab):
    ref = lab["reentrant_checkpoint"][0]["torch use_reentrant=True"]
    assert ref[-2:] == [5.0, 5.0]  # head.bias: 5 samples, summed, averaged over 2 ranks
    for r in (0, 1):
        for v in ("torch", *OURS):
            for reentrant in (True, False):
                assert lab["reentrant_checkpoint"][r][f"{v} use_reentrant={reentrant}"] == ref


def test_case7_torch_signature_device_ids_on_cpu(lab):
    for r in (0, 1):
        got = lab["device_ids"][r]
        for v in ("torch", *OURS):
            assert got[f"{v} None"] == []
            assert got[f"{v} [0]"][:2] == ["error", "ValueError"]
            assert "device_ids [0], output_device None" in got[f"{v} [0]"][2]
        for v in OURS:
            for feature in ("gradient_as_bucket_view", "static_graph"):
                want = (f"{NAMES[v]} does not support {feature}=True; use torch's "
                        "DistributedDataParallel")
                assert got[f"{v} {feature}"] == ["error", "NotImplementedError", want]
            kind, cls, msg = got[f"{v} register_comm_hook"]
            assert (kind, cls) == ("error", "NotImplementedError")
            assert msg.startswith(f"{NAMES[v]} does not support register_comm_hook")
            assert "use torch's DistributedDataParallel" in msg
        kind, cls, msg = got["naive bucket_cap_mb"]
        assert (kind, cls) == ("error", "NotImplementedError")
        assert msg.startswith("NaiveDDP does not support bucket_cap_mb=25")


def test_a_skipped_backward_is_an_error_on_every_rank(lab):
    for v in OURS:
        e0, e1 = _both(lab, "skipped_backward", v)
        assert e0 == e1 and e0[:2] == ["error", "RuntimeError"]
        assert "different numbers of synchronised forwards (rank 0: 2, rank 1: 1)" in e0[2]


def test_pre_division_keeps_an_fp16_average_finite(lab):
    # 40000 + 40000 overflows fp16 (max 65504); 20000 + 20000 does not
    for v in ("torch", *OURS):
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


def test_b32_ours_average_every_backward(lab):
    # each backward's share averaged: 3, then 3 + (2 + 6) / 2, then 7 + (3 + 7) / 2
    for v in (*OURS, "core naive", "core bucketed"):
        assert _both(lab, "several_backwards", v) == [[3.0, 7.0, 12.0]] * 2, v
    for v in OURS:
        assert _both(lab, "several_backwards", v + " find_unused") == [[3.0, 7.0, 12.0]] * 2
        # the no_sync micro-batch (4 and 0) is averaged by the first synchronised backward
        assert _both(lab, "several_backwards", v + " no_sync first") == [[5.0, 9.0, 14.0]] * 2


def test_b32_a_no_grad_forward_between_forward_and_backward_changes_nothing(lab):
    # x = 1 and 5: the mean 3.0 on both ranks, as torch (before: 1.0 and 5.0, not averaged)
    for v in ("torch", *OURS, "core naive", "core bucketed"):
        assert _both(lab, "several_backwards", v + " no_grad forward between") == [[3.0]] * 2, v


def test_b32_each_backward_has_its_own_unused_parameter_check(lab):
    for v in OURS:
        # forward a+b (x = 1, 5), forward a (x = 2, 6); backward of each: b only in the first
        assert _both(lab, "several_backwards", f"{v} ab then a, find_unused=True") == [
            [[3.0, 3.0], [7.0, 3.0]]] * 2, v
        e0, e1 = _both(lab, "several_backwards", f"{v} ab then a, find_unused=False")
        assert e0 == e1 and e0[:2] == ["error", "RuntimeError"], e0
        assert "backward 2 after the last synchronised forward" in e0[2], e0
        assert "rank 0: b.weight (index 1); rank 1: b.weight (index 1)" in e0[2], e0


def test_b32_several_backwards_inside_join(lab):
    # rank 0 steps (1, 2) and (3, 4), rank 1 one step (5, 6); two forwards, two backwards each
    for v in OURS:
        r0, r1 = _both(lab, "several_backwards_join", f"{v} divide_by_initial_world_size=False")
        assert (r0, r1) == ([[7.0, 7.0]], [[7.0]]), v
        r0, r1 = _both(lab, "several_backwards_join", f"{v} divide_by_initial_world_size=True")
        assert r0[0] == [7.0] and r1[0] == [7.0], v     # all ranks in: each backward averaged
        assert r0[1] == r1[1] and r0[1][:2] == ["error", "RuntimeError"], (r0, r1)
        assert "second backward after one forward inside Join, with 1 of 2 ranks" in r0[1][2]


def test_b33_two_forwards_one_backward_with_a_buffer_like_torch(lab):
    # lin(x) * scale, w = 1, scale 2, x = 1 and 2, two forwards: (2 * 2 + 4 * 2) / 2 = 6.0; the
    # buffer's version is still the construction broadcast's (torch's and ours; the cores only
    # broadcast at construction, without bumping it)
    for v in ("torch", *OURS):
        assert _both(lab, "two_forwards_buffer", v + " scaled") == [[6.0, 1]] * 2, v
    for v in ("core naive", "core bucketed"):
        assert _both(lab, "two_forwards_buffer", v + " scaled") == [[6.0, 0]] * 2, v
    torch0, torch1 = _both(lab, "two_forwards_buffer", "torch batchnorm")
    assert torch0[:10] == torch1[:10]           # gradients averaged
    assert torch0[10:] != torch1[10:]           # running statistics: each rank's second batch
    for v in OURS:
        assert _both(lab, "two_forwards_buffer", v + " batchnorm") == [torch0, torch1], v
