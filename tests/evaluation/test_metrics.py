"""Confusion matrix and mIoU: hand-computed values, and exactness across world sizes (gloo)."""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ddp_lesson.env import all_reduce_sum
from ddp_lesson.metrics import confusion_matrix, miou_from_confusion

# A 2x3 "image", 3 classes, one void pixel (255) that the model labelled 0.
#   target  0 0 1      pred  0 1 1
#           1 2 255          2 2 0
# Counted (true, pred) pairs: (0,0) (0,1) (1,1) (1,2) (2,2); the void pixel counts nowhere.
TARGET = torch.tensor([[0, 0, 1], [1, 2, 255]])
PRED = torch.tensor([[0, 1, 1], [2, 2, 0]])
CM = [[1, 1, 0],
      [0, 1, 1],
      [0, 0, 1]]
# IoU_c = TP / (row_c + col_c - TP):
#   class 0: 1 / (2 + 1 - 1) = 1/2
#   class 1: 1 / (2 + 2 - 1) = 1/3
#   class 2: 1 / (1 + 2 - 1) = 1/2
# mIoU = (1/2 + 1/3 + 1/2) / 3 = 4/9; pixel accuracy = 3 correct / 5 counted = 3/5.


def test_confusion_matrix_hand_example():
    cm = confusion_matrix(PRED, TARGET, num_classes=3)
    assert cm.dtype == torch.int64
    assert cm.tolist() == CM


def test_ignore_pixels_excluded():
    cm = confusion_matrix(PRED, TARGET, num_classes=3)
    assert int(cm.sum()) == 5  # 6 pixels, one of them void
    assert int(cm[:, 0].sum()) == 1  # the void pixel predicted as 0 is not a false positive
    # Changing what the model says on a void pixel changes nothing.
    other = PRED.clone()
    other[1, 2] = 2
    assert torch.equal(confusion_matrix(other, TARGET, 3), cm)
    # A custom ignore_index works the same way.
    assert confusion_matrix(torch.tensor([0, 1]), torch.tensor([0, 7]), 2,
                            ignore_index=7).tolist() == [[1, 0], [0, 0]]


def test_miou_hand_example():
    miou, per_class, acc = miou_from_confusion(torch.tensor(CM))
    assert per_class.tolist() == pytest.approx([1 / 2, 1 / 3, 1 / 2], abs=1e-15)
    assert miou == pytest.approx(4 / 9, abs=1e-15)
    assert acc == pytest.approx(3 / 5, abs=1e-15)


def test_absent_class_excluded_from_mean():
    # Same pixels with 4 classes: class 3 is neither in target nor prediction -> NaN, and the
    # mean stays 4/9 (it would be 1/3 if the absent class counted as 0).
    cm = confusion_matrix(PRED, TARGET, num_classes=4)
    miou, per_class, acc = miou_from_confusion(cm)
    assert math.isnan(per_class[3])
    assert miou == pytest.approx(4 / 9, abs=1e-15)
    assert acc == pytest.approx(3 / 5, abs=1e-15)


def test_class_only_predicted_counts_as_zero():
    # target 0 0, pred 0 3 (4 classes): class 0 IoU = 1/(2+1-1) = 1/2; class 3 was predicted
    # but never true: IoU 0/(0+1-0) = 0, and it counts; classes 1 and 2 are absent (NaN).
    # mIoU = (1/2 + 0) / 2 = 1/4; pixel accuracy 1/2.
    cm = confusion_matrix(torch.tensor([0, 3]), torch.tensor([0, 0]), 4)
    miou, per_class, acc = miou_from_confusion(cm)
    assert per_class[0] == 0.5 and per_class[3] == 0.0
    assert math.isnan(per_class[1]) and math.isnan(per_class[2])
    assert miou == 0.25 and acc == 0.5


def test_empty_matrix_is_nan():
    miou, per_class, acc = miou_from_confusion(torch.zeros(3, 3, dtype=torch.int64))
    assert math.isnan(miou) and math.isnan(acc) and per_class.isnan().all()


def test_counts_add_over_batches():
    # Summing per-batch matrices equals one matrix over everything: the property that makes
    # the cross-rank sum exact.
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 5, (6, 4, 4), generator=g)
    target[target == 4] = 255
    pred = torch.randint(0, 4, (6, 4, 4), generator=g)
    whole = confusion_matrix(pred, target, 4)
    parts = sum(confusion_matrix(pred[i:i + 2], target[i:i + 2], 4) for i in range(0, 6, 2))
    assert torch.equal(whole, parts)


def test_errors_show_numbers():
    with pytest.raises(ValueError, match=r"target has label 3, outside \[0, 2\]"):
        confusion_matrix(torch.tensor([0]), torch.tensor([3]), 3)
    with pytest.raises(ValueError, match=r"pred has label -1"):
        confusion_matrix(torch.tensor([-1]), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match=r"pred shape \(2,\) != target shape \(3,\)"):
        confusion_matrix(torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"\(C, C\), got shape \(2, 3\)"):
        miou_from_confusion(torch.zeros(2, 3))


def test_all_reduce_without_group_is_a_copy():
    cm = torch.tensor(CM)
    out = all_reduce_sum(cm)
    assert torch.equal(out, cm) and out is not cm


# ---------------------------------------------------------------------------------------
# Multi-process (gloo): the all-reduced matrix over DistributedEvalSampler shards equals the
# single-process matrix on a 7-sample set (7 splits unevenly over 2 and 3 ranks).

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from ddp_lesson.env import all_reduce_sum
    from ddp_lesson.metrics import confusion_matrix, miou_from_confusion
    from ddp_lesson.sampler import DistributedEvalSampler, DistributedSampler

    C, N = 5, 7
    g = torch.Generator().manual_seed(123)
    targets = torch.randint(0, C + 1, (N, 6, 8), generator=g)
    targets[targets == C] = 255                       # some void pixels
    preds = torch.randint(0, C, (N, 6, 8), generator=g)  # a fixed "model output" per sample
    dataset = [(i, preds[i], targets[i]) for i in range(N)]

    def shard_cm(sampler):
        cm = torch.zeros(C, C, dtype=torch.int64)
        seen = []
        for idx, p, t in DataLoader(dataset, batch_size=2, sampler=sampler):
            cm += confusion_matrix(p, t, C)
            seen += idx.tolist()
        return cm, seen

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local, seen = shard_cm(DistributedEvalSampler(dataset, num_replicas=world, rank=rank))
    total = all_reduce_sum(local)
    all_seen = [None] * world
    dist.all_gather_object(all_seen, seen)
    # torch's padded sampler, for contrast: it repeats samples to even out the shards.
    from torch.utils.data.distributed import DistributedSampler as TorchSampler
    padded = all_reduce_sum(shard_cm(TorchSampler(dataset, world, rank, shuffle=False))[0])
    if rank == 0:
        single = confusion_matrix(preds, targets, C)
        json.dump({"world": world, "total": total.tolist(), "single": single.tolist(),
                   "local_is_part": not torch.equal(local, total),
                   "seen": all_seen, "padded_equal": torch.equal(padded, single),
                   "miou": miou_from_confusion(total)[0],
                   "miou_single": miou_from_confusion(single)[0]}, open(sys.argv[1], "w"))
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduced_confusion_equals_single_process(tmp_path, world_size):
    """Multi-process (gloo, torchrun): exact equality, every sample on exactly one rank."""
    script = tmp_path / "cm_check.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DDP_LESSON_BACKEND="gloo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(world_size), str(script), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world"] == world_size
    assert res["total"] == res["single"]
    assert res["miou"] == res["miou_single"]
    assert res["local_is_part"]
    # Interleaved shards range(rank, 7, R), no padding: each sample exactly once.
    assert res["seen"] == [list(range(r, 7, world_size)) for r in range(world_size)]
    assert sorted(i for shard in res["seen"] for i in shard) == list(range(7))
    # 7 samples do not split evenly over 2 or 3 ranks, so the padded sampler double-counts.
    assert not res["padded_equal"]
