"""Elastic restart: a worker killed with SIGKILL, torchrun restarts the job, the trainer resumes.

The reference is an uninterrupted 2-rank run; every interrupted run (under
``run_torchrun(max_restarts=1)``) must end with bit-identical model weights (``torch.equal``
on every tensor of the saved state). Cases: a kill right after a checkpoint was written, a kill
mid-epoch between two checkpoints (three runs: restarts must be reliable, see the
TORCH_DISABLE_SHARE_RDZV_TCP_STORE note in ``ddp_lesson.launch.launch_env``), a kill inside
the checkpoint write (after the temporary file, before the rename), two simulated nodes of one
process each against one node of two processes, and a node lost for good under
``--nnodes 1:2`` (the survivor finishes the run alone, with the same weights).

Where notebook 07 or its deep dive runs the very same job (the third mid-epoch kill, the kill
inside the write, the two-node cell, the lost node), the test reads the notebook's stored output
instead of launching it again: the suite's nbval replay runs that cell and fails unless it
prints exactly what is stored, so the same values are checked on a fresh run either way.

Config: 32 samples, 2 ranks, batch 4 -> 4 steps per epoch, 8 in all; checkpoints every 2
steps and at each epoch end, i.e. after global steps 2, 4, 6 and 8.
"""
import os

import pytest
import torch
from notebook_cells import cell_with, stored_run, stream_text

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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(2))
def test_kill_mid_epoch_between_checkpoints_recovers_bit_identical(tmp_path, reference, attempt):
    r = _train(tmp_path, ["--simulate-failure-at-step", "5", "--failure-rank", "1"],
               max_restarts=1)
    _assert_mid_epoch_recovery(r.rank_lines(0), r.rank_lines(1))
    assert _same(_model(tmp_path), reference)


def _assert_mid_epoch_recovery(lines0, lines1):
    assert "simulated failure: rank 1 kills itself (SIGKILL) after the step at global step 5" \
        in lines1
    assert "[restart 1]" in lines0 and "[restart 1]" in lines1
    # step 5 is lost; the job goes back to the epoch-end checkpoint of step 4
    assert any(line.endswith("epoch 2/2, step 0/4 (global step 4)") for line in lines0)


def _notebook_job(name: str, extra: list[str]) -> None:
    """Notebook 07 starts the job ``name`` (``ddp_lesson.labs.restart_jobs``) with this test
    file's BASE and ``extra``, one restart allowed (so its stored output answers for the same
    run as the tests here)."""
    from ddp_lesson.labs import restart_jobs

    assert "runs = run_jobs()" in cell_with(NB, "commands()").source
    assert restart_jobs.TINY == BASE
    assert restart_jobs.JOBS[name] == (1, extra)
    assert restart_jobs.JOBS["reference"] == (0, [])


def test_notebook_kill_mid_epoch_recovers_bit_identical():
    """The same run a third time: notebook 07's ``killed`` cell as stored (nbval replays it)."""
    _notebook_job("killed", ["--simulate-failure-at-step", "5", "--failure-rank", "1"])
    ranks, other = stored_run(NB, "story(killed)")
    _assert_mid_epoch_recovery(ranks[0], ranks[1])
    assert other == ["same weights as the uninterrupted run: True"]


def test_kill_during_checkpoint_write_keeps_previous_checkpoint():
    """Notebook 07's ``torn`` cell as stored (nbval replays it): rank 0, the writer, killed
    once the temporary file of step 6 is complete, before the rename."""
    _notebook_job("torn", ["--simulate-failure-at-step", "5", "--simulate-failure-during-save"])
    ranks, other = stored_run(NB, "story(torn)")
    assert ("simulated failure: rank 0 kills itself (SIGKILL) during the checkpoint write at "
            "global step 6") in ranks[0]
    # the write of step 6 never reached the rename: the restart loads step 4's checkpoint
    assert any(line.endswith("epoch 2/2, step 0/4 (global step 4)") for line in ranks[0])
    assert "[restart 1]" in ranks[0] and "[restart 1]" in ranks[1]
    # the killed writer's temporary file (complete, never renamed) is swept by the restart
    assert other == ["temporary files left by the killed writer: 0",
                     "same weights as the uninterrupted run: True"]


@pytest.mark.slow
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


NB = "07_failures_and_multinode.ipynb"
TORCH = os.path.dirname(torch.__file__)


def test_notebook_two_node_cell_names_the_missing_rank():
    """Notebook 07's ``%%torchrun --nnodes 2 --nproc-per-node 1`` cell as stored (nbval replays
    it): node i holds rank i; monitored_barrier on gloo names rank 1, which never came."""
    cell = cell_with(NB, "monitored_barrier").source
    assert cell.startswith("%%torchrun --nnodes 2 --nproc-per-node 1\n")
    ranks, other = stored_run(NB, "monitored_barrier")
    common = ["GLOO_SOCKET_IFNAME = lo", "all_reduce across the two nodes: 3.0"]  # 1 + 2
    assert ranks[0] == ["node 0, local rank 0: global rank 0 of 2", *common,
                        "monitored_barrier: [Rank 0]: Rank 1 failed to pass "
                        "monitoredBarrier in 3000 ms"]  # timeout=timedelta(seconds=3)
    assert ranks[1] == ["node 1, local rank 0: global rank 1 of 2", *common,
                        "rank 1 never reached the barrier; rank 0 let it go"]
    assert other == ["[torchrun] 2 processes and no GPU: using gloo on CPU"]


DEEP = "deep/07_restart_trap_and_stores.ipynb"


def test_lost_node_shrinks_the_world_and_the_survivor_finishes_the_run():
    """Elastic ``--nnodes 1:2``, the ``lost_node`` cell of notebook 07's deep dive as stored
    (nbval replays it): node 1's agent dies after step 6; node 0 restarts alone (WORLD_SIZE 1),
    resumes the checkpoint written by 2 processes with their micro-batches, 2 per step, and
    ends with the weights of an uninterrupted 2-process run (docs/pitfalls.md C8)."""
    from ddp_lesson.labs.restart_jobs import TINY

    setup = " ".join(cell_with(DEEP, "def train(").source.split())  # the same job as here
    assert 'args=TINY + ["--out", f"runs/nb07/{out}", *extra]' in setup and TINY == BASE
    cell = cell_with(DEEP, "--simulate-node-loss").source
    assert 'ELASTIC = ["--nnodes", "1:2", ' in cell and "max_restarts=1" in cell
    assert 'train("uninterrupted", live=False)' in cell  # the reference: 2 processes, no stop
    ranks, other = stored_run(DEEP, "--simulate-node-loss")
    assert ranks[1] == ["simulated failure: rank 1 kills its torchrun agent and itself "
                        "(SIGKILL) after the step at global step 6: node lost"]
    path = "runs/nb07/lost_node/checkpoint.pt"
    assert ranks[0] == [
        "world_size 2  backend gloo  device cpu", "[restart 1]",
        "world_size 1  backend gloo  device cpu",
        f"resuming from {path}: epoch 2/2, step 2/4 (global step 6)",
        "world size 2 -> 1: the same micro-batches of 4, 2 per rank and step (was 1)",
        "global batch 8 kept; cursor at sample 16 of 32 this epoch"]
    assert other == ["the job's exit code: -9 (node 1's agent, SIGKILLed)",
                     "finished by 1 process at global step 8 | the layout kept: 2 x 1",
                     "weights bit-identical to the uninterrupted run: True",
                     "BatchNorm running means the same: False"]


def test_node_loss_needs_a_step(capsys):
    with pytest.raises(SystemExit):
        config.parse_config(["--simulate-node-loss"])
    assert "--simulate-node-loss needs --simulate-failure-at-step K >= 1" in capsys.readouterr().err


def _torch_src(rel):
    with open(os.path.join(TORCH, rel)) as f:
        return f.read()


def test_restart_trap_is_in_torchs_source():
    """Notebook 07's explanation of the restart trap, line by line in torch's source: the
    agent's store is kept across rounds, the workers connect to it without a per-attempt
    prefix, and the process group's keys carry no restart count."""
    dyn = _torch_src("distributed/elastic/rendezvous/dynamic_rendezvous.py")
    assert "self._shared_tcp_store_server: dist.Store | None = None" in dyn
    assert 'return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"' in dyn
    rdzv = _torch_src("distributed/rendezvous.py")
    assert ("We create a new TCPStore for every retry so no need to add prefix for each "
            "attempt.") in rdzv
    c10d = _torch_src("distributed/distributed_c10d.py")
    assert 'store = PrefixStore("default_pg", store)' in c10d
    assert 'PrefixStore(f"{group_name}/", store)' in c10d
    assert 'PrefixStore(f"{device}/", prefix_store)' in c10d
    assert "RESTART_COUNT" not in c10d + rdzv
    agent = _torch_src("distributed/elastic/agent/server/local_elastic_agent.py")
    assert '"TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store)' in agent


def test_gloo_full_mesh_keys_are_the_ranks():
    """The keys gloo's full-mesh connect writes and reads: ``0/<rank>`` (the same in every
    attempt), recorded by a store that logs each call; two ranks in two threads."""
    import datetime
    import threading

    import torch.distributed as dist

    calls = []

    class Recording(dist.Store):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            calls.append(("set", key))
            return self.inner.set(key, value)

        def get(self, key):
            calls.append(("get", key))
            return self.inner.get(key)

        def wait(self, keys, *timeout):
            return self.inner.wait(keys, *timeout)

    base = dist.HashStore()
    groups = {}

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(Recording(base), rank, 2,
                                             datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(groups) == [0, 1]
    assert sorted(k for op, k in calls if op == "set") == ["0/0", "0/1"]
    assert sorted(set(k for op, k in calls if op == "get")) == ["0/0", "0/1"]


def test_notebook_prints_the_commands_it_runs():
    """Notebook 07's first cell prints the torchrun commands of the three runs it starts."""
    from ddp_lesson.labs.restart_jobs import commands

    assert stream_text(NB, "commands()") == "\n".join(commands()) + "\n"
    assert commands()[2:4] == [
        "torchrun --nproc-per-node 2 --max-restarts 1 -m ddp_lesson.train $TINY "
        "--out runs/nb07/killed", "    --simulate-failure-at-step 5 --failure-rank 1"]


def test_without_docstring_keeps_the_code_only():
    from ddp_lesson.checkpoint import atomic_write
    from ddp_lesson.labs.restart_jobs import without_docstring

    code = without_docstring(atomic_write)
    assert '"""' not in code and code.startswith("def atomic_write(path: str,")
    assert "    os.replace(tmp, path)\n" in code and code.endswith("    return path\n")
    assert without_docstring(lambda: 1).lstrip().startswith("assert without_docstring(lambda")
