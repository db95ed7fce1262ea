"""Gradient accumulation (B4), loss reduction (B5) and learning-rate scaling (B7) in the trainer.

One 2-rank torchrun launch checks the trainer's step functions
(``accumulate_gradients``, ``train_step``) against torch's DDP and a single-process baseline
computed in the same process; the learning-rate rule needs no process group.
"""
import json
import math

import pytest

from ddp_lesson.config import TrainConfig, derived_values, parse_config
from ddp_lesson.gradients import scale_lr as scaled_lr
from ddp_lesson.launch import run_torchrun

CHECK = r'''
import copy, json
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson.train import accumulate_gradients, train_step

env = init_distributed(timeout=60, announce=False)
R, r = env.world_size, env.rank
out = {}

class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
    def forward(self, g):
        return g * self.w  # d/dw = g: the micro-batch's gradient is the input itself

# -- B4: local micro-batch gradients rank0 [1, 3], rank1 [1, 6]; accumulation 2
grads = [[1.0, 3.0], [1.0, 6.0]][r]
model = DDP(Scalar())
accumulate_gradients(model, [torch.tensor(g) for g in grads], lambda m, g: m(g))
out["b4_correct"] = model.module.w.grad.item()
model.module.w.grad = None
# the buggy order: sync on the first micro-batch, no_sync on the last
model(torch.tensor(grads[0])).backward()
with model.no_sync():
    model(torch.tensor(grads[1])).backward()
out["b4_buggy"] = model.module.w.grad.item()

# -- B5: w = 1, prediction w * x, target 0, squared error; rank0 x=[1,2], rank1 x=[3,4]
x = torch.tensor([[1.0, 2.0], [3.0, 4.0]][r])
for reduction in ("mean", "sum"):
    lin = DDP(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        lin.module.weight.fill_(1.0)
    pred = lin(x[:, None]).squeeze(1)
    F.mse_loss(pred, torch.zeros_like(pred), reduction=reduction).backward()
    out[f"b5_{reduction}"] = lin.module.weight.grad.item()
lin = DDP(nn.Linear(1, 1, bias=False))
with torch.no_grad():
    lin.module.weight.fill_(1.0)
pred = lin(x[:, None]).squeeze(1)
(F.mse_loss(pred, torch.zeros_like(pred)) * R).backward()  # the "mean x R" mistake
out["b5_mean_times_r"] = lin.module.weight.grad.item()

# -- the trainer's step: accumulation K on R ranks == one step on the K x R x B batch in one
#    process; and R=2, B=2 == one process with B=4 (B7). A BatchNorm-free segmentation toy,
#    targets with void (255) pixels spread unevenly, so a per-rank mean would differ.
def toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))

g = torch.Generator().manual_seed(1)
images = torch.randn(8, 3, 6, 7, generator=g)
target = torch.randint(0, 5, (8, 6, 7), generator=g)
target[0, :5] = 255
target[5, :, :2] = 255

def reference(batches_per_step):
    m = toy()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for idx in batches_per_step:
        opt.zero_grad()
        F.cross_entropy(m(images[idx]), target[idx], ignore_index=255).backward()
        opt.step()
    return m

def distributed(micro_batches_per_step):
    m = DDP(toy())
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for micro in micro_batches_per_step:
        train_step(m, opt, [(images[i], target[i]) for i in micro], R)
    return m.module

def max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))

# two steps; step s uses samples 4s..4s+3 of the global batch... on rank r, micro-batches of 1
steps = [[0, 1, 2, 3], [4, 5, 6, 7]]
ref = reference(steps)
mine = [[[s[2 * r]], [s[2 * r + 1]]] for s in steps]          # K=2 micro-batches of B=1
out["accum_vs_one_process"] = max_diff(distributed(mine), ref)
mine = [[[s[2 * r], s[2 * r + 1]]] for s in steps]            # K=1, B=2 per rank
out["r2b2_vs_one_process_b4"] = max_diff(distributed(mine), ref)
out["params_moved"] = max_diff(ref, toy())
print(json.dumps(out))
import gc
gc.collect()  # free DDP wrappers (reference cycles) before the process group goes
cleanup()
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("accum") / "check.py"
    path.write_text(CHECK)
    res = run_torchrun(str(path), nproc_per_node=2, timeout=120, live=False, backend="gloo")
    return {r: json.loads(res.rank_lines(r)[-1]) for r in range(2)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_b4_sync_on_the_last_micro_batch(results):
    # correct: (1 + 3 + 1 + 6) / 2 = 5.5 on both ranks; buggy order: 4.0 and 7.0
    assert results[0]["b4_correct"] == results[1]["b4_correct"] == 5.5
    assert (results[0]["b4_buggy"], results[1]["b4_buggy"]) == (4.0, 7.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_b5_mean_matches_one_process_and_sum_is_off_by_r(results):
    for out in results.values():
        assert out["b5_mean"] == 15.0      # single process: 2 * mean(x^2) = 15
        assert out["b5_sum"] == 30.0       # single process: 60, i.e. 60 / R
        assert out["b5_mean_times_r"] == 30.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_accumulation_equals_one_step_on_the_larger_batch(results):
    for out in results.values():
        assert out["params_moved"] > 1e-3  # the comparison is not vacuous
        assert out["accum_vs_one_process"] < 1e-6
        assert out["r2b2_vs_one_process_b4"] < 1e-6


# ---- learning-rate scaling (no process group) --------------------------------------------

def test_b7_linear_scaling_value():
    # base lr 0.1 at batch 256, R=4, B=128 -> global 512 -> 0.2; no extra division by R
    assert scaled_lr(0.1, 256, 4 * 128, "linear") == pytest.approx(0.2)
    assert scaled_lr(0.1, 256, 512, "sqrt") == pytest.approx(0.1 * math.sqrt(2))
    assert scaled_lr(0.1, 256, 512, "none") == 0.1
    with pytest.raises(
        ValueError, match="lr scaling rule 'cubic' is not one of none, linear, sqrt"
    ):
        scaled_lr(0.1, 256, 512, "cubic")


def test_derived_global_batch_and_effective_lr():
    cfg = parse_config(["--lr", "0.1", "--base-batch", "256", "--lr-scaling", "linear",
                        "-b", "128"])
    d = derived_values(cfg, world_size=4)
    assert d["global_batch"] == 512 and d["effective_lr"] == pytest.approx(0.2)
    cfg = TrainConfig(batch_size=2, grad_accum_steps=4, num_train=100, lr_scaling="linear",
                      base_batch=16, lr=0.05)
    d = derived_values(cfg, world_size=2)
    assert d["global_batch"] == 2 * 2 * 4
    assert d["micro_batches_per_epoch"] == math.ceil(50 / 2) == 25
    assert d["steps_per_epoch"] == math.ceil(25 / 4) == 7
    assert d["effective_lr"] == pytest.approx(0.05)


# ---- a step the fp16 GradScaler skips does not consume the schedule (issue 41 item 12) -------

def test_a_skipped_fp16_step_leaves_the_learning_rate_schedule_where_it_was():
    """Step 1's gradients are inf (the logits multiplied by inf): GradScaler skips the
    optimizer's step. The scheduler must not step either: the first real step runs with the
    schedule's first value, and torch does not warn that the scheduler stepped first.
    torch 2.13's GradScaler runs on CPU (``GradScaler("cpu").is_enabled()``)."""
    import warnings

    import torch

    from ddp_lesson.train import Precision, train_step

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 2, 1)
    factor = torch.ones(())

    def model(images):
        return conv(images) * factor

    opt = torch.optim.SGD(conv.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    applied = []  # the learning rate of each optimizer step that ran
    opt.register_step_pre_hook(lambda o, *_: applied.append(o.param_groups[0]["lr"]))
    precision = Precision("fp16", "cpu")
    assert precision.scaler.is_enabled()
    batch = [(torch.randn(1, 3, 2, 2), torch.tensor([[[0, 1], [1, 0]]]))]
    skipped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for inf in (True, False, False):
            factor.fill_(math.inf if inf else 1.0)
            train_step(model, opt, batch, 1, sched, precision=precision)
            skipped.append(precision.skipped)
    assert skipped == [True, False, False]
    assert applied == [1.0, 0.5]  # was [0.5, 0.25]: the skipped step consumed 1.0
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.25
    assert precision.scaler.get_scale() == 2.0 ** 15  # 2^16 halved once, for the skip
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
