"""Notebook 06's deep dive, section 2: mixed precision and clipping on 2 ranks
(ddp_lesson.labs.amp_clip).

One launch of the lab on 2 gloo processes; every number it prints is checked here against the
JSON it wrote and against values computed independently in this process: the same training
in one process on the global batch (losses, gradient norms), and GradScaler's growth and
backoff rule worked out by hand.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddp_lesson.data import NUM_CLASSES, make_datasets
from ddp_lesson.labs import amp_clip as ac
from ddp_lesson.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, json_lab):
    out = tmp_path_factory.mktemp("amp") / "amp.json"
    return json_lab("ddp_lesson.labs.amp_clip", out, timeout=150)


def _one_process(steps, clip=None, scale=None):
    """The lab's fp32 training on the whole global batch in this process (no DDP, each
    rank's half a forward of its own): the per-step losses and, with ``clip``, the norms
    before clipping."""
    torch.manual_seed(0)
    model = build_model("tiny", num_classes=NUM_CLASSES, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train, _ = make_datasets(ac.GLOBAL_BATCH, 1, (32, 64), seed=0)
    images = torch.stack([train[i][0] for i in range(ac.GLOBAL_BATCH)])
    target = torch.stack([train[i][1] for i in range(ac.GLOBAL_BATCH)])
    count = float((target != 255).sum())
    losses, norms = [], []
    half = ac.GLOBAL_BATCH // 2
    for _ in range(steps):
        opt.zero_grad()
        # two halves through the model, as the 2 ranks do: BatchNorm normalises each with
        # its own 4 images' statistics (the lab has no SyncBatchNorm)
        loss = sum(F.cross_entropy(model(images[i:i + half]), target[i:i + half],
                                   ignore_index=255, reduction="sum")
                   for i in (0, half)) / count
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return losses, norms


def _scales(steps, inf_steps, init, growth, backoff, interval):
    """GradScaler.update's rule by hand: backoff on inf (tracker reset), else grow after
    ``interval`` good steps in a row (torch/amp/grad_scaler.py, _amp_update_scale_)."""
    scale, tracker, out = init, 0, []
    for i in range(1, steps + 1):
        if i in inf_steps:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
        out.append(scale)
    return out


def test_three_precisions_same_training_up_to_rounding(lab):
    lines, _, data = lab
    p = data["precision"]
    one, _ = _one_process(ac.STEPS)
    # fp32 on 2 ranks is one process on the global batch, up to the order of the sums
    assert max(abs(a - b) for a, b in zip(p["fp32"], one)) < 1e-5
    assert p["fp32"][-1] < p["fp32"][0]
    for name in ("bf16", "fp16"):
        assert p[name] != p["fp32"]
        assert max(abs(a - b) for a, b in zip(p[name], p["fp32"])) < ac.TOL
    first, last = f"{one[0]:.2f}", f"{one[-1]:.2f}"
    assert (first, last) == ("2.95", "2.67")
    assert lines[:4] == [
        "1. one model, global batch 8 on 2 ranks, 6 steps, in three precisions",
        f"  fp32: loss {first} -> {last}",
        f"  bf16: loss {first} -> {last}  max |loss - fp32| < 0.001: True  bit-identical to "
        "fp32: False",
        f"  fp16: loss {first} -> {last}  max |loss - fp32| < 0.001: True  bit-identical to "
        "fp32: False",
    ]


def test_one_rank_overflows_every_rank_skips_the_same_step(lab):
    lines, lines1, data = lab
    expected = _scales(ac.SCALER_STEPS, {ac.INJECT_STEP}, 1024.0, 2.0, 0.5, 2)
    assert expected == [1024, 2048, 2048, 4096, 2048, 2048, 4096, 4096]
    by_rank = data["scaler_by_rank"]
    for r, view in enumerate(by_rank):
        assert view["rank"] == r
        assert view["scale_after"] == expected
        assert view["skipped"] == [i + 1 == ac.INJECT_STEP for i in range(ac.SCALER_STEPS)]
        # after the all_reduce the inf is everywhere, and only at that step
        assert view["reduced_finite"] == [i + 1 != ac.INJECT_STEP for i in range(8)]
    # before it, only the injecting rank had one
    assert by_rank[0]["local_finite"] == [True] * 8
    assert by_rank[1]["local_finite"] == [i + 1 != ac.INJECT_STEP for i in range(8)]
    assert by_rank[0]["weights_same"] is True
    # the skipped step did not change the loss of the next one... nor anything else: the
    # losses of steps 5 and 6 are computed from the same weights
    losses = by_rank[0]["losses"]
    assert losses[4] == losses[5] and losses[3] != losses[4]
    scale_line = "  scale after each step: 1024 2048 2048 4096 2048 2048 4096 4096"
    assert lines[4:8] == [
        "2. fp16, GradScaler(init_scale=1024, growth_interval=2); an inf on rank 1 at step 5",
        scale_line,
        "  step 5: own gradient finite True, after all_reduce False; skipped steps [5]",
        "  weights identical on all 2 ranks after 8 steps: True",
    ]
    assert lines1 == [
        scale_line,
        "  step 5: own gradient finite False, after all_reduce False; skipped steps [5]",
        "  norms before clipping bit-identical on every rank: True",
    ]


def test_clipping_after_unscaling_equal_norms(lab):
    lines, _, data = lab
    c = data["clip"]
    # scale is a power of two: the scaled gradients' norm is exactly scale x the true one
    assert c["scales"] == [1024.0] * 4
    assert [a / b for a, b in zip(c["scaled_norms"], c["norms"])] == [1024.0] * 4
    _, norms = _one_process(4, clip=ac.CLIP)
    # fp16 autocast on 2 ranks vs fp32 in one process: the same norms within 1%
    assert all(abs(a - b) <= 1e-2 * b for a, b in zip(c["norms"], norms)), (c["norms"], norms)
    assert all(n > ac.CLIP for n in c["norms"])  # every step was clipped
    assert all(x <= ac.CLIP * (1 + 1e-6) for x in c["clipped_norms"])
    assert c["same_on_every_rank"] is True
    assert lines[8:] == [
        "3. fp16 (scale 1024), clip to 0.25 after unscale_",
        "  norm of scaled grads / true norm: 1024, 1024, 1024, 1024",
        "  total norm before clipping: " + ", ".join(f"{x:.3g}" for x in c["norms"]),
        "  after clipping, at most 0.25: True",
        "  norms before clipping bit-identical on every rank: True",
    ]
    assert all(len(line) + len("[rank 0] ") <= 100 for line in lines)
