"""Resuming at another world size: a run stopped at R processes, finished at R', real torchrun.

The run keeps its micro-batches (``ddp_lesson.layout``): the same groups of samples, dealt
K' = K x R / R' to each of R' ranks per step, so BatchNorm in train mode normalises the same
batches, the global batch and the schedule are unchanged and the optimizer state continues.

* **Bit for bit** where the summation order is the same: R=2, K=1 -> R'=1, K'=2 and R=1, K=2
  -> R'=2, K'=1. The step's gradient is g0 + g1 either way: two ranks' all-reduce adds their
  two gradients (DDP divides each by 2 first and the loss was scaled by 2, both exact), one
  process adds its two micro-batches' in ``.grad``; a sum of two numbers has one order.
* **Within a tolerance** otherwise: R=2, K=2 -> R'=1, K'=4. The two ranks add
  ``(g00 + g10) + (g01 + g11)`` (each rank accumulates its own, then the all-reduce adds the
  ranks), one process ``((g00 + g01) + g10) + g11``: float32 rounding in another order.
* **BatchNorm's running statistics differ** (buffers, not weights): at R=2 DDP gives every rank
  rank 0's buffers at each step, updated by rank 0's micro-batches only; one process updates
  them with every micro-batch, twice per step here. ``num_batches_tracked`` counts it exactly.

Every run has one intra-op thread (``OMP_NUM_THREADS=1``): the thread count changes the order
of float sums inside a convolution. Sizes: 32 samples of 32x64, width 4, batch 4, 2 epochs.
"""
import json
import os
import re

import pytest
import torch

from ddp_lesson import train
from ddp_lesson.launch import run_torchrun
from ddp_lesson.models import build_model

pytestmark = pytest.mark.slow

# R=2, K=1: 16 samples per rank, 4 micro-batches, 4 steps per epoch, 8 in all
BASE = ["--epochs", "2", "--num-train", "32", "--num-val", "4", "-b", "4", "--size", "32", "64",
        "--width", "4"]
PARAMS = [name for name, _ in build_model("deeplab", width=4).named_parameters()]
BN = "backbone.0.1"  # the first BatchNorm layer


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One intra-op thread in this process (the in-process runs) as in the torchrun ones."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DDP_LESSON_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _torchrun(target, args, nproc, cwd, **kwargs):
    return run_torchrun(target, args, nproc_per_node=nproc, timeout=120, live=False,
                        backend="gloo", cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                        **kwargs)


def _trainer(args, nproc, cwd, **kwargs):
    """``torchrun --nproc-per-node nproc -m ddp_lesson.train args``: the same command."""
    return _torchrun("ddp_lesson.train", args, nproc, cwd, module=True, **kwargs)


def _ckpt(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)


def _same(a, b, keys):
    return all(torch.equal(a[k], b[k]) for k in keys)


def _same_optimizer(a, b):
    return a["param_groups"] == b["param_groups"] and list(a["state"]) == list(b["state"]) \
        and all(torch.equal(a["state"][i]["momentum_buffer"], b["state"][i]["momentum_buffer"])
                for i in a["state"])


def _summary(out):
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def _check_resumed_like(ref_out, run_out, steps, bit_identical=True):
    ref, run = _ckpt(ref_out), _ckpt(run_out)
    assert (run["epoch"], run["step_in_epoch"], run["global_step"]) == (2, 0, steps)
    assert run["scheduler"] == ref["scheduler"]  # the schedule's step counter continued
    if bit_identical:
        assert _same(ref["model"], run["model"], PARAMS)
        assert _same_optimizer(ref["optimizer"], run["optimizer"])
        assert _summary(run_out)["step_losses"] == _summary(ref_out)["step_losses"]
    return ref, run


def test_two_processes_stopped_mid_epoch_finish_on_one(tmp_path, capsys):
    """One launch of 2 ranks (uninterrupted and stopped runs); the stopped runs are finished
    by one process, this one (``tests/train/test_train_resize.py``'s 1 -> 2 case and the
    notebooks run the command itself under ``torchrun --nproc-per-node 1``)."""
    script = tmp_path / "two.py"
    script.write_text(TWO)
    _torchrun(str(script), [json.dumps(BASE)], 2, tmp_path)
    # the same command at world size 1: 5 more steps, each two micro-batches of 4
    summary = train.main(BASE + ["--out", str(tmp_path / "run")])
    lines = capsys.readouterr().out.splitlines()
    assert "batch per rank 4  global batch 8 (= 4 x 1 x 2 accumulation steps)" in lines
    assert f"resuming from {tmp_path}/run/checkpoint.pt: epoch 1/2, step 3/4 (global step 3)" \
        in lines
    assert ("world size 2 -> 1: the same micro-batches of 4, 2 per rank and step (was 1)"
            in lines)
    assert "global batch 8 kept; cursor at sample 24 of 32 this epoch" in lines
    ref, run = _check_resumed_like(tmp_path / "ref", tmp_path / "run", 8)
    assert run["cursor"] == {"epoch": 2, "samples": 0, "world_size": 2, "grad_accum_steps": 1,
                             "batch_size": 4}
    assert run["world_size"] == 1 and summary["grad_accum_steps"] == 2
    assert summary["layout"] == {"world_size": 2, "grad_accum_steps": 1}
    # BatchNorm's buffers: rank 0's 8 updates against 3 + 5 x 2 = 13 on one process
    assert ref["model"][f"{BN}.num_batches_tracked"].item() == 8
    assert run["model"][f"{BN}.num_batches_tracked"].item() == 13
    assert not torch.equal(ref["model"][f"{BN}.running_mean"], run["model"][f"{BN}.running_mean"])
    # R=2, K=2 -> R'=1, K'=4: the sum of 4 micro-batches in another order
    summary = train.main(BASE + ["--grad-accum-steps", "2", "--out", str(tmp_path / "run_k2")])
    assert summary["resumed_from"]["global_step"] == 1 and summary["grad_accum_steps"] == 4
    ref2, run2 = _check_resumed_like(tmp_path / "ref_k2", tmp_path / "run_k2", 4, False)
    diff = max((ref2["model"][k] - run2["model"][k]).abs().max().item() for k in PARAMS)
    assert diff < 1e-6, diff  # float32 rounding through 3 steps of SGD (1.5e-8 measured)
    losses = zip(_summary(tmp_path / "ref_k2")["step_losses"], summary["step_losses"])
    assert max(abs(a - b) for a, b in losses) < 1e-6


TWO = r'''
import gc, json, sys
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson import train

env = init_distributed(timeout=60, announce=False)
base = json.loads(sys.argv[1])
train.main(base + ["--out", "ref"])                           # uninterrupted, R=2, K=1
train.main(base + ["--out", "run", "--max-steps", "3"])       # stopped mid-epoch 1
k2 = base + ["--grad-accum-steps", "2"]
train.main(k2 + ["--out", "ref_k2"])                          # R=2, K=2: 2 steps per epoch
train.main(k2 + ["--out", "run_k2", "--max-steps", "1"])
gc.collect()
cleanup()
'''


def test_one_process_stopped_mid_epoch_finishes_on_two(tmp_path):
    # R=1, K=2: 8 micro-batches of 4, 4 steps per epoch; the uninterrupted run and a stop
    flags = BASE + ["--grad-accum-steps", "2"]
    train.main(flags + ["--out", str(tmp_path / "ref")])
    train.main(flags + ["--out", str(tmp_path / "run"), "--max-steps", "3"])
    assert _ckpt(tmp_path / "run")["cursor"]["samples"] == 3 * 8
    resumed = _trainer(flags + ["--out", "run"], 2, tmp_path)
    lines = resumed.rank_lines(0)
    assert "batch per rank 4  global batch 8 (= 4 x 2)" in lines
    assert "world size 1 -> 2: the same micro-batches of 4, 1 per rank and step (was 2)" in lines
    ref, run = _check_resumed_like(tmp_path / "ref", tmp_path / "run", 8)
    # buffers: 16 updates on one process; 3 x 2 + 5 of rank 0's on two
    assert ref["model"][f"{BN}.num_batches_tracked"].item() == 16
    assert run["model"][f"{BN}.num_batches_tracked"].item() == 11
    assert run["world_size"] == 2 and run["cursor"]["world_size"] == 1


def test_a_world_size_that_cannot_share_a_step_exits_2(tmp_path):
    # R=1, K=1: each step is 1 micro-batch, which 2 processes cannot share
    train.main(BASE + ["--out", str(tmp_path / "run"), "--max-steps", "3"])
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    result = _trainer(BASE + ["--out", "run"], 2, tmp_path, check=False)
    assert result.returncode != 0
    # every rank exits with 2 on its own; one the agent ends first (after the first exit) is -15
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.launcher_stderr)
    root = result.launcher_stderr[result.launcher_stderr.index("Root Cause"):]
    assert re.search(r"exitcode\s*:\s*2\b", root), result.launcher_stderr[-2000:]
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    errors = [line for line in result.errors[0].splitlines() if line.strip()]
    assert errors == [
        "error: checkpoint run/checkpoint.pt cannot resume at 2 processes: a step holds K x R "
        "= 1 x 1 = 1 micro-batch (R=1 process, K=1 accumulation step), which R'=2 processes "
        "cannot share: K' = K x R / R' = 1/2 is not a whole number; use 1 process, or pass "
        "--no-resume to start over"]
    assert result.errors[1].strip() == ""  # only rank 0 reports
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before
