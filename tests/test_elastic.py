"""Elastic restart: a worker killed with SIGKILL, torchrun restarts the job, the trainer resumes.

The reference is an uninterrupted 2-rank run; every interrupted run (under
``run_torchrun(max_restarts=1)``) must end with bit-identical model weights (``torch.equal``
on every tensor of the saved state). Cases: a kill right after a checkpoint was written, a kill
mid-epoch between two checkpoints (repeated three times: restarts must be reliable, see the
TORCH_DISABLE_SHARE_RDZV_TCP_STORE note in ``ddp_lesson.launch.launch_env``), a kill inside
the checkpoint write (after the temporary file, before the rename), and two simulated nodes of
one process each against one node of two processes.

Config: 32 samples, 2 ranks, batch 4 -> 4 steps per epoch, 8 in all; checkpoints every 2
steps and at each epoch end, i.e. after global steps 2, 4, 6 and 8.
"""
import os

import pytest
import torch

from ddp_lesson import config, train
from ddp_lesson.launch import launch_env, run_torchrun

BASE = ["--size", "32", "64", "--width", "8", "--num-train", "32", "--num-val", "8", "-b", "4",
        "--epochs", "2", "--checkpoint-every-steps", "2"]


def _train(out, extra=(), **kwargs):
    kwargs.setdefault("nproc_per_node", 2)
    # One intra-op thread in every process of every run (launch_env would give each process
    # cores // nproc_per_node): the thread count changes the order of float sums inside a
    # convolution, so bit-equality between layouts needs the same count.
    kwargs.setdefault("env", dict(os.environ, OMP_NUM_THREADS="1"))
    return run_torchrun("ddp_lesson.train", BASE + ["--out", str(out), *extra], module=True,
                        timeout=120, live=False, backend="gloo", **kwargs)


def _model(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["model"]


def _same(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    _train(out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["global_step"] == 8 and ckpt["epoch"] == 2
    return ckpt["model"]


def test_launcher_disables_the_shared_rendezvous_store():
    assert launch_env({}, None, 2)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # a value the user set on purpose is kept
    assert launch_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, None, 2)[
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_kill_right_after_a_checkpoint_recovers_bit_identical(tmp_path, reference):
    r = _train(tmp_path, ["--simulate-failure-at-step", "2", "--failure-rank", "0"],
               max_restarts=1)
    lines0 = r.rank_lines(0)
    assert "simulated failure: rank 0 kills itself (SIGKILL) after the step at global step 2" \
        in lines0
    assert "[restart 1]" in lines0 and "[restart 1]" in r.rank_lines(1)
    # the checkpoint of step 2 was complete before the kill: nothing is redone
    assert any(line.endswith("epoch 1/2, step 2/4 (global step 2)") for line in lines0)
    assert (tmp_path / "simulated_failure_step2.done").exists()
    assert _same(_model(tmp_path), reference)


@pytest.mark.parametrize("attempt", range(3))
def test_kill_mid_epoch_between_checkpoints_recovers_bit_identical(tmp_path, reference, attempt):
    r = _train(tmp_path, ["--simulate-failure-at-step", "5", "--failure-rank", "1"],
               max_restarts=1)
    assert "simulated failure: rank 1 kills itself (SIGKILL) after the step at global step 5" \
        in r.rank_lines(1)
    assert "[restart 1]" in r.rank_lines(0) and "[restart 1]" in r.rank_lines(1)
    # step 5 is lost; the job goes back to the epoch-end checkpoint of step 4
    assert any(line.endswith("epoch 2/2, step 0/4 (global step 4)") for line in r.rank_lines(0))
    assert _same(_model(tmp_path), reference)


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, reference):
    r = _train(tmp_path, ["--simulate-failure-at-step", "5", "--simulate-failure-during-save"],
               max_restarts=1)
    lines0 = r.rank_lines(0)
    assert ("simulated failure: rank 0 kills itself (SIGKILL) during the checkpoint write at "
            "global step 6") in lines0
    # the write of step 6 never reached the rename: the restart loads step 4's checkpoint
    assert any(line.endswith("epoch 2/2, step 0/4 (global step 4)") for line in lines0)
    # the killed writer's temporary file (complete, never renamed) is swept by the restart
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint.pt.tmp.")]
    assert leftovers == []
    assert _same(_model(tmp_path), reference)


def test_two_nodes_of_one_process_train_the_same_weights(tmp_path, reference):
    r = _train(tmp_path, nproc_per_node=1, nnodes=2)
    assert any(line.startswith("world_size 2 ") for line in r.rank_lines(0))
    assert _same(_model(tmp_path), reference)


def test_failure_rank_outside_the_world_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(BASE + ["--out", str(tmp_path), "--simulate-failure-at-step", "1",
                           "--failure-rank", "1"])
    assert exc.value.code == 2
    assert "--failure-rank 1 is outside [0, 0] (world size 1)" in capsys.readouterr().err


def test_failure_during_save_needs_a_step(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--simulate-failure-during-save"])
    assert "needs --simulate-failure-at-step K >= 1" in capsys.readouterr().err


NOTEBOOK_TWO_NODE_CELL = """
import os
import torch
import torch.distributed as dist
from ddp_lesson.env import init_distributed, cleanup

env = init_distributed(timeout=30)
print(f"node {os.environ['GROUP_RANK']}, local rank {env.local_rank}: "
      f"global rank {env.rank} of {env.world_size}")
x = torch.tensor([float(env.rank + 1)])
dist.all_reduce(x)
print("all_reduce across the two nodes:", x.item())
cleanup()
"""


def test_notebook_two_node_cell():
    """Notebook 06's ``%%torchrun --nnodes 2 --nproc-per-node 1`` cell: node i holds rank i."""
    r = run_torchrun(code=NOTEBOOK_TWO_NODE_CELL, nnodes=2, nproc_per_node=1, timeout=120,
                     live=False, backend="gloo")
    assert r.rank_lines(0) == ["node 0, local rank 0: global rank 0 of 2",
                               "all_reduce across the two nodes: 3.0"]  # 1 + 2
    assert r.rank_lines(1) == ["node 1, local rank 0: global rank 1 of 2",
                               "all_reduce across the two nodes: 3.0"]
