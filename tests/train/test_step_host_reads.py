"""A training step reads nothing to the host (issue 40): no per-step CUDA synchronisation.

``float(tensor)``, ``int(tensor)``, ``.item()``, ``.tolist()``, ``.cpu()`` on a CUDA tensor wait
for every kernel queued before them; one per step stalls the CPU that should be queueing the
next step's work. Here the host reads are made to raise inside one ``train_step`` (on CPU: the
calls are what is tested, not their cost), and the step's numbers are compared, bit for bit,
with the host-reading rule it replaced: ``scale = world_size / max(count, 1.0)`` as a Python
float, the loss sums added as Python floats.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_lesson.data import IGNORE_INDEX
from ddp_lesson.train import Precision, train_step

HOST_READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__index__", "__bool__")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Every host read of a tensor raises inside the block."""
    def forbid(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read Tensor.{name} inside a training step")
        return read

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, forbid(name))
        yield


def _toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))


def _micro_batches():
    g = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 6, 7, generator=g)
    target = torch.randint(0, 5, (4, 6, 7), generator=g)
    target[0, :5] = IGNORE_INDEX
    target[3, :, :2] = IGNORE_INDEX
    return [(images[:2], target[:2]), (images[2:], target[2:])]


def _host_reading_step(model, opt, micro_batches, world_size):
    """The rule as it was, reading the count and the sums to the host: the reference."""
    count = sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)
    scale = world_size / max(float(count), 1.0)
    opt.zero_grad(set_to_none=True)
    sums = []
    for images, target in micro_batches:
        s = F.cross_entropy(model(images).float(), target, ignore_index=IGNORE_INDEX,
                            reduction="sum")
        sums.append(s.detach())
        (s * scale).backward()
    opt.step()
    return float(sum(s.item() for s in sums)), count


@pytest.mark.parametrize("world_size", [1, 3])
def test_train_step_reads_nothing_to_the_host(monkeypatch, world_size):
    batches = _micro_batches()
    ref_model = _toy()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    model = copy.deepcopy(ref_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_sum, ref_count = _host_reading_step(ref_model, ref_opt, batches, world_size)
    with no_host_reads(monkeypatch):
        with pytest.raises(AssertionError, match="host read Tensor.item"):
            torch.ones(()).item()  # the guard is on
        loss_sum, count = train_step(model, opt, batches, world_size)
    assert isinstance(loss_sum, torch.Tensor) and loss_sum.dtype == torch.float64
    assert count.dtype == torch.int64 and count.device == batches[0][1].device
    assert float(loss_sum) == ref_sum
    assert int(count) == ref_count == 4 * 6 * 7 - 5 * 7 - 6 * 2
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_a_step_with_bf16_autocast_and_clipping_reads_nothing_to_the_host(monkeypatch):
    """Clipping keeps the norm on the device; Precision.grad_norm is a 0-d tensor."""
    batches = _micro_batches()
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    precision = Precision("bf16", "cpu", clip_grad_norm=0.2)
    with no_host_reads(monkeypatch):
        train_step(model, opt, batches, 2, scheduler=sched, precision=precision)
    grads_norm = precision.grad_norm
    assert isinstance(grads_norm, torch.Tensor) and grads_norm.dim() == 0
    assert float(grads_norm) > 0.2  # above the limit: this step was clipped


def test_train_step_refuses_no_micro_batch():
    model = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="at least 1 micro-batch, got 0"):
        train_step(model, opt, [], 2)


@pytest.mark.slow
def test_the_trainers_steps_read_nothing_to_the_host(world_of_one, monkeypatch, tmp_path):
    """Trainer.step (the fit loop's per-step call) under the same guard, on a group of one
    with torch's DDP and fp32 clipping; the epoch's flush then reads the sums and norms once."""
    from ddp_lesson import train
    from ddp_lesson.config import parse_config
    from ddp_lesson.env import read_env

    cfg = parse_config(["--epochs", "1", "--num-train", "8", "--num-val", "2", "-b", "2",
                        "--size", "32", "64", "--model", "tiny", "--width", "8", "--workers",
                        "0", "--clip-grad-norm", "1.0", "--out", str(tmp_path / "run")])
    trainer = train.Trainer(cfg, read_env())
    groups = [group for _, group, _ in trainer.batches(0, 0)][:3]
    with no_host_reads(monkeypatch):
        results = [trainer.step(group) for group in groups]
    assert all(isinstance(s, torch.Tensor) and isinstance(c, torch.Tensor) for s, c in results)
    trainer._flush_losses()  # one read for the three steps: the sums over ranks, the norms
    assert [(r.loss_sum, r.pixel_count) for r in trainer.step_log] == [
        (float(s), float(c)) for s, c in results]
    assert all(isinstance(r.grad_norm, float) and r.grad_norm > 0 for r in trainer.step_log)
