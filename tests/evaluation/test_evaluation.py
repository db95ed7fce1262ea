"""Exact distributed evaluation (ddp_lesson.evaluation): pitfalls.md A3, A5, A10.

Expected values are the literal ones of the cases (0.8333, 0.9), sums computed here by hand
from torch's own sampler, or a single-process baseline computed here pixel by pixel; the
multi-process runs (world sizes 1, 2, 3 on 7 samples, gloo) must reproduce it exactly.
"""
from __future__ import annotations

import json
import math
import textwrap
from fractions import Fraction

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.env import all_reduce_sum
from ddp_lesson.evaluation import (
    ExactEval,
    evaluate_exact,
    exact_accuracy,
    mean_of_rank_accuracies,
    naive_padded_accuracy,
    sharded_exact_accuracy,
)
from ddp_lesson.labs.sampler_eval import ToyClassification, ToySegmentation, toy_segmenter
from ddp_lesson.launch import TorchrunError, run_torchrun

pytestmark = pytest.mark.timeout(120)

# A3: N=10, R=3, the model is right on every sample except index 0
A3_CORRECT = [i != 0 for i in range(10)]


# --------------------------------------------------------------------------- one-process models

def test_a3_padded_accuracy_is_ten_twelfths():
    assert naive_padded_accuracy(A3_CORRECT, 3) == pytest.approx(10 / 12, abs=1e-15)
    assert round(naive_padded_accuracy(A3_CORRECT, 3), 3) == 0.833


def test_a3_exact_accuracy_is_nine_tenths_at_every_world_size():
    for r in range(1, 11):
        assert sharded_exact_accuracy(A3_CORRECT, r) == pytest.approx(0.9, abs=1e-15), r


def test_mean_of_rank_means_is_wrong_on_uneven_shards():
    # unpadded shards [0,3,6,9], [1,4,7], [2,5,8]: accuracies 3/4, 3/3, 3/3
    assert mean_of_rank_accuracies(A3_CORRECT, 3) == pytest.approx((3 / 4 + 1 + 1) / 3, abs=1e-15)
    assert round(mean_of_rank_accuracies(A3_CORRECT, 3), 3) == 0.917
    # even shards (R divides N): the mean of means happens to be right
    assert mean_of_rank_accuracies(A3_CORRECT, 2) == pytest.approx(0.9, abs=1e-15)
    # N < R: empty shards are left out, not counted as 0 or 1
    assert mean_of_rank_accuracies([True, False], 5) == pytest.approx(0.5, abs=1e-15)


def _torch_padded_accuracy(correct, r, shuffle=False, seed=0, epoch=0):
    """Pool every rank's padded shard from torch's own sampler and count."""
    seen = []
    for rank in range(r):
        s = TorchSampler(range(len(correct)), num_replicas=r, rank=rank, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        seen += list(s)
    return Fraction(sum(correct[i] for i in seen), len(seen))


@pytest.mark.parametrize("r", [1, 2, 3, 4, 7, 12])
def test_padded_accuracy_matches_torchs_padded_shards(r):
    assert naive_padded_accuracy(A3_CORRECT, r) == pytest.approx(
        float(_torch_padded_accuracy(A3_CORRECT, r)), abs=1e-15)


def test_a5_shuffled_padded_eval_changes_with_the_epoch_exact_does_not():
    got = [naive_padded_accuracy(A3_CORRECT, 3, shuffle=True, epoch=e) for e in range(6)]
    expected = [float(_torch_padded_accuracy(A3_CORRECT, 3, True, 0, e)) for e in range(6)]
    assert got == pytest.approx(expected, abs=1e-15)
    # index 0 is a repeat in some epochs (10/12) and not in others (11/12)
    assert {round(x, 3) for x in got} == {0.833, 0.917}
    assert sharded_exact_accuracy(A3_CORRECT, 3) == pytest.approx(0.9, abs=1e-15)


def test_one_process_models_reject_bad_input():
    with pytest.raises(ValueError, match="empty"):
        naive_padded_accuracy([], 3)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        sharded_exact_accuracy([True], 0)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        mean_of_rank_accuracies([True], 0)


# --------------------------------------------------------------------------- without a group

def test_exact_accuracy_without_a_process_group():
    assert exact_accuracy(9, 10) == 0.9
    assert math.isnan(exact_accuracy(0, 0))
    with pytest.raises(ValueError, match="correct=11, count=10"):
        exact_accuracy(11, 10)
    with pytest.raises(ValueError, match="correct=-1"):
        exact_accuracy(-1, 10)
    t = torch.tensor([1, 2, 3])
    out = all_reduce_sum(t)
    assert out.tolist() == [1, 2, 3] and out is not t


def test_evaluate_exact_one_process_a3():
    ds = ToyClassification(10)
    r = evaluate_exact(ds.predictor(wrong=(0,)), ds, batch_size=3)
    assert isinstance(r, ExactEval)
    assert (r.correct, r.count, r.num_samples, r.local_num_samples) == (9, 10, 10, 10)
    assert r.accuracy == 0.9
    assert r.confusion is None and r.miou is None


def test_evaluate_exact_padded_shard_of_one_rank_counts_its_repeat():
    # rank 1 of 3, padded: [1, 4, 7, 0] -> index 0 (wrong) is the padded repeat
    ds = ToyClassification(10)
    r = evaluate_exact(ds.predictor(wrong=(0,)), ds, padded=True, num_replicas=3, rank=1)
    assert (r.correct, r.count, r.local_num_samples) == (3, 4, 4)
    exact = evaluate_exact(ds.predictor(wrong=(0,)), ds, num_replicas=3, rank=1)
    assert (exact.correct, exact.count) == (3, 3)  # [1, 4, 7]


def test_evaluate_exact_shape_mismatch_names_the_shapes():
    ds = ToyClassification(4)
    with pytest.raises(ValueError, match=r"predictions have shape \(2, 1\) but targets \(2,\)"):
        evaluate_exact(lambda x: x[:, None], ds, batch_size=2)


def _baseline(ds, num_classes):
    """Single-process reference, by hand: per-pixel counts over the whole dataset."""
    correct = count = 0
    cm = [[0] * num_classes for _ in range(num_classes)]
    for i in range(len(ds)):
        image, target = ds[i]
        pred = toy_segmenter(image[None], num_classes)[0]
        for t, p in zip(target.reshape(-1).tolist(), pred.reshape(-1).tolist()):
            if t == 255:
                continue
            count += 1
            correct += t == p
            cm[t][p] += 1
    ious = []
    for c in range(num_classes):
        tp = cm[c][c]
        fn = sum(cm[c]) - tp
        fp = sum(cm[t][c] for t in range(num_classes)) - tp
        if tp + fp + fn:
            ious.append(tp / (tp + fp + fn))
    return {"correct": correct, "count": count, "accuracy": correct / count, "cm": cm,
            "miou": sum(ious) / len(ious)}


def test_evaluate_exact_segmentation_one_process_matches_hand_count():
    ds = ToySegmentation(7)
    ref = _baseline(ds, 4)
    r = evaluate_exact(lambda x: toy_segmenter(x, 4), ds, num_classes=4, batch_size=3)
    assert r.confusion.tolist() == ref["cm"]
    assert (r.correct, r.count, r.num_samples) == (ref["correct"], ref["count"], 7)
    assert r.accuracy == ref["accuracy"]
    assert r.miou == pytest.approx(ref["miou"], abs=1e-12)
    # the toy is a real test: some mistakes, some void pixels, mIoU != pixel accuracy
    assert 0.3 < r.accuracy < 0.95 and abs(r.miou - r.accuracy) > 0.01
    assert sum(map(sum, ref["cm"])) < 7 * 6 * 8


# --------------------------------------------------------------------------- across processes

WORKER = textwrap.dedent("""
    import json
    from ddp_lesson.env import cleanup, init_distributed
    from ddp_lesson.evaluation import evaluate_exact
    from ddp_lesson.labs.sampler_eval import ToyClassification, ToySegmentation, toy_segmenter

    env = init_distributed(timeout=60)
    seg = evaluate_exact(lambda x: toy_segmenter(x, 4), ToySegmentation(7), num_classes=4,
                         batch_size=2, device=env.device)
    cls_ds = ToyClassification(7, num_classes=3)
    # batch_size=1: shards of 3, 2, 2 batches; a per-batch collective would hang here
    cls = evaluate_exact(cls_ds.predictor(wrong=(0, 5)), cls_ds, batch_size=1, device=env.device)
    print(json.dumps({
        "seg": [seg.correct, seg.count, seg.num_samples, seg.local_num_samples, seg.accuracy,
                seg.miou, seg.confusion.tolist()],
        "cls": [cls.correct, cls.count, cls.num_samples, cls.local_num_samples, cls.accuracy],
    }))
    if env.world_size == 3:
        from ddp_lesson.labs import sampler_eval
        sampler_eval.main(10)  # notebook 02's cell (tears the group down at the end)
    else:
        cleanup()
""")


@pytest.fixture(scope="module")
def runs():
    """One launch per world size (1, 2, 3); each rank's JSON result."""
    out = {}
    for world in (1, 2, 3):
        res = run_torchrun(code=WORKER, nproc_per_node=world, timeout=120, live=False,
                           backend="gloo")
        out[world] = [json.loads(res.rank_lines(r)[0]) for r in range(world)]
        out[f"lines{world}"] = [res.rank_lines(r)[1:] for r in range(world)]
    return out


@pytest.mark.slow
def test_exact_evaluation_is_identical_to_one_process_at_world_sizes_1_2_3(runs):
    ref = _baseline(ToySegmentation(7), 4)
    for world in (1, 2, 3):
        for rank, got in enumerate(runs[world]):
            correct, count, items, local, acc, miou, cm = got["seg"]
            assert cm == ref["cm"], (world, rank)
            assert (correct, count, items) == (ref["correct"], ref["count"], 7), (world, rank)
            assert acc == ref["accuracy"], (world, rank)
            assert miou == pytest.approx(ref["miou"], abs=1e-12), (world, rank)
            # the same floats on every rank and at every world size, bit for bit
            assert (acc, miou) == tuple(runs[1][0]["seg"][4:6])
            # unpadded shards: rank r evaluated len(range(r, 7, world)) samples
            assert local == len(range(rank, 7, world))


@pytest.mark.slow
def test_exact_classification_accuracy_at_world_sizes_1_2_3(runs):
    # 7 samples, wrong on indices 0 and 5: 5/7 whatever the world size
    for world in (1, 2, 3):
        for rank, got in enumerate(runs[world]):
            correct, count, items, local, acc = got["cls"]
            assert (correct, count, items) == (5, 7, 7), (world, rank)
            assert acc == 5 / 7
            assert local == len(range(rank, 7, world))


@pytest.mark.slow
def test_a3_eval_lab_as_notebook_02_shows_it(runs):
    """ddp_lesson.labs.sampler_eval on 3 ranks: the A3 literals."""
    rank0, rank1, rank2 = runs["lines3"]
    assert rank0 == [
        "padded shard [0, 3, 6, 9] | unpadded shard [0, 3, 6, 9]",
        "N=10, R=3, model wrong on index 0 only",
        "padded DistributedSampler:   10/12 correct = 0.833  (padding repeats counted)",
        "mean of per-rank accuracies: (0.750 + 1.000 + 1.000) / 3 = 0.917",
        "exact (sums all-reduced):    9/10 correct = 0.900",
        "exact equals the single-process accuracy: True",
        "every sample counted exactly once: True",
    ]
    assert rank1 == ["padded shard [1, 4, 7, 0] | unpadded shard [1, 4, 7]"]
    assert rank2 == ["padded shard [2, 5, 8, 1] | unpadded shard [2, 5, 8]"]
    assert runs["lines1"] == [[]] and runs["lines2"] == [[], []]


A10_WORKER = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from ddp_lesson.env import init_distributed
    from ddp_lesson.sampler import DistributedEvalSampler

    env = init_distributed(timeout=3)
    loader = DataLoader(range(10), batch_size=1, sampler=DistributedEvalSampler(range(10)))
    batches = 0
    for batch in loader:
        loss = batch.float().sum()
        dist.all_reduce(loss)   # the mistake: a collective per batch over uneven shards
        batches += 1
    print(f"left the loop after {batches} batches", flush=True)
    time.sleep(30)              # ranks 1, 2 stay alive, so rank 0 waits until the timeout
""")


@pytest.mark.slow
def test_a10_per_batch_collective_over_uneven_shards_times_out_not_hangs():
    with pytest.raises(TorchrunError) as info:
        run_torchrun(code=A10_WORKER, nproc_per_node=3, timeout=90, live=False,
                     backend="gloo")
    err = info.value
    assert err.rank == 0  # rank 0 has 4 batches, ranks 1 and 2 have 3
    assert "timed out" in err.traceback.lower()
    assert err.result.rank_lines(1) == ["left the loop after 3 batches"]
    assert err.result.rank_lines(2) == ["left the loop after 3 batches"]
    assert err.result.rank_lines(0) == []
