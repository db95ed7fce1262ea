"""ddp_lesson.checkpoint: atomic save, the module. prefix (B12), the rank-0 protocol (B14)."""
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from ddp_lesson import checkpoint as ck
from ddp_lesson.checkpoint import (
    CheckpointError,
    capture_rng_state,
    first_config_mismatch,
    first_state_mismatch,
    load_checkpoint,
    restore_rng_state,
    save_atomic,
    strip_module_prefix,
    unwrap,
)
from ddp_lesson.launch import TorchrunError, run_torchrun

# ---- B12: the module. prefix ---------------------------------------------------------------

@pytest.mark.slow
def test_b12_ddp_keys_carry_the_prefix_and_the_helper_strips_it(world_of_one):
    # world_of_one: a real gloo process group of one rank (torch's DDP needs one)
    torch.manual_seed(0)
    bare = nn.Linear(2, 1)
    ddp = nn.parallel.DistributedDataParallel(bare)
    wrapped = ddp.state_dict()
    assert list(wrapped) == ["module.weight", "module.bias"]
    assert list(strip_module_prefix(wrapped)) == ["weight", "bias"]
    fresh = nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(wrapped, strict=True)
    fresh.load_state_dict(strip_module_prefix(wrapped), strict=True)
    assert torch.equal(fresh.weight, bare.weight)
    # the recommended save path: the unwrapped module's state_dict
    assert unwrap(ddp) is bare
    assert list(unwrap(ddp).state_dict()) == ["weight", "bias"]


def test_b12_prefix_removed_once_and_only_at_the_start():
    sd = {"module.module.weight": 1, "submodule.weight": 2, "module.bias": 3, "plain": 4}
    assert list(strip_module_prefix(sd)) == ["module.weight", "submodule.weight", "bias",
                                             "plain"]
    twice = strip_module_prefix(strip_module_prefix({"module.module.weight": 1}))
    assert list(twice) == ["weight"]


def test_strip_keeps_metadata_so_batchnorm_loads():
    wrapped = nn.Sequential()
    wrapped.module = nn.BatchNorm2d(3)
    sd = wrapped.state_dict()
    assert "module" in sd._metadata
    out = strip_module_prefix(sd)
    assert "" in out._metadata and "module" not in out._metadata
    nn.BatchNorm2d(3).load_state_dict(out)


# ---- atomic save -------------------------------------------------------------------------

def test_save_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "c.pt"
    save_atomic({"a": torch.arange(3)}, str(path))
    save_atomic({"a": torch.arange(5)}, str(path))
    assert torch.equal(torch.load(path)["a"], torch.arange(5))
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_failed_save_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    save_atomic({"a": torch.ones(2)}, str(path))
    before = path.read_bytes()
    # a local lambda cannot be pickled (PicklingError, or AttributeError on Python < 3.14)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_atomic({"f": lambda: 0}, str(path))  # cannot be pickled: fails mid-write
    assert path.read_bytes() == before

    def crash(*args):  # the machine "dies" between the write and the rename
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        save_atomic({"a": torch.zeros(2)}, str(path))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.pt"]


# ---- loading and its errors ---------------------------------------------------------------

def _valid(**over):
    base = {"format": ck.CHECKPOINT_FORMAT, "version": ck.CHECKPOINT_VERSION,
            "model": {"w": torch.zeros(2)}, "optimizer": {}, "scheduler": {}, "epoch": 0,
            "step_in_epoch": 0, "global_step": 0, "sampler": {}, "rng": [], "config": {},
            "world_size": 1}
    base.update(over)
    return base


def test_load_maps_to_the_given_device(tmp_path):
    path = str(tmp_path / "c.pt")
    save_atomic(_valid(), path)
    ckpt = load_checkpoint(path, map_location="cpu")
    assert ckpt["model"]["w"].device.type == "cpu"


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            "truncated",
            r"is not a readable checkpoint \(no zip archive: truncated, "
            r"or not written by torch.save\)",
        ),
        ("text", r"is not a readable checkpoint"),
        ("empty", r"\(0 bytes\) is not a readable checkpoint"),
        (
            "state_dict",
            r"is not a ddp_lesson checkpoint: it holds a dict with keys \['bias', 'weight'\]",
        ),
        ("tensor", r"is not a ddp_lesson checkpoint: it holds a Tensor"),
        ("incomplete", r"is an incomplete checkpoint: missing \['optimizer'"),
        ("version", r"has checkpoint version 99; this package reads version 1"),
        (
            "code",
            r"bytes\) is not a readable checkpoint \(UnpicklingError: Unsupported global: "
            r"GLOBAL datetime.date",
        ),
    ],
)
def test_unusable_files_raise_one_line(tmp_path, kind, message):
    path = tmp_path / "c.pt"
    if kind == "truncated":
        save_atomic(_valid(), str(path))
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        path.write_text("not a checkpoint\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "state_dict":
        torch.save(nn.Linear(2, 1).state_dict(), path)
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)
    elif kind == "incomplete":
        bad = _valid()
        del bad["optimizer"]
        torch.save(bad, path)
    elif kind == "code":  # a zip file whose pickle would import and call arbitrary code
        import datetime

        torch.save(_valid(when=datetime.date(2020, 1, 1)), path)
    else:
        torch.save(_valid(version=99), path)
    with pytest.raises(CheckpointError, match=message) as exc:
        load_checkpoint(str(path))
    assert "\n" not in str(exc.value)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def test_first_state_mismatch_names_the_first_difference():
    model = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    assert first_state_mismatch(model, {"a": torch.ones(2, 3), "b": torch.ones(4)}) is None
    assert first_state_mismatch(model, {"a": torch.zeros(3, 3), "b": torch.zeros(5)}) == \
        "'a' has shape (3, 3) in the checkpoint but (2, 3) in the model"
    assert first_state_mismatch(model, {"a": torch.zeros(2, 3)}) == "the checkpoint lacks 'b'"
    assert first_state_mismatch(model, {**model, "c": torch.zeros(1)}) == \
        "the checkpoint has 'c', which the model does not"


def test_first_config_mismatch():
    saved = {"batch_size": 4, "size": [32, 64], "lr": 0.05}
    assert first_config_mismatch(saved, {"batch_size": 4, "size": (32, 64), "lr": 0.05},
                                 ["batch_size", "size", "lr"]) is None
    assert first_config_mismatch(saved, {"batch_size": 8, "size": (32, 64), "lr": 0.1},
                                 ["size", "batch_size", "lr"]) == \
        "batch_size=4 in the checkpoint but batch_size=8 in this run"


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    state = capture_rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    path = str(tmp_path / "rng.pt")
    save_atomic(state, path)
    torch.rand(10), np.random.rand(10), random.random()  # move every generator on
    restore_rng_state(torch.load(path, weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


# ---- B14: rank 0 writes, the others read only when the file is complete --------------------

B14 = r'''
import json, os, sys, time
import torch
import torch.distributed as dist
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson import checkpoint as ck

env = init_distributed(timeout=4, announce=False)  # the group's timeout: 4 s
path = sys.argv[1]
out = {}
# rank 0 is slow to write; the others call load right after save_checkpoint returns
if env.rank == 0:
    real_save = ck.torch.save
    def slow_save(*a, **k):
        time.sleep(1.0)
        real_save(*a, **k)
    ck.torch.save = slow_save
obj = {"format": ck.CHECKPOINT_FORMAT, "version": ck.CHECKPOINT_VERSION,
       "model": {"w": torch.arange(1000.0)}, "optimizer": {}, "scheduler": {}, "epoch": 1,
       "step_in_epoch": 2, "global_step": 3, "sampler": {}, "rng": [], "config": {},
       "world_size": env.world_size}
ck.save_checkpoint(obj if env.rank == 0 else None, path)
loaded = ck.load_checkpoint(path, map_location=env.device)
out["loaded_sum"] = float(loaded["model"]["w"].sum())
out["temporaries"] = sorted(f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f)
# "does the file exist?" is rank 0's answer on every rank, even where a rank sees otherwise
if env.rank == 1:
    os.path.exists = lambda p: False
out["exists"] = ck.decide_on_rank0(lambda: os.path.exists(path))
# a failed write on rank 0 raises on every rank (nobody waits forever)
try:
    ck.save_checkpoint(obj if env.rank == 0 else None, os.path.join(path, "no", "dir.pt"))
    out["failure"] = None
except OSError as exc:
    out["failure"] = str(exc)
# a write slower than the group's timeout (6 s against 4 s): the others wait for it outside any
# collective, and the group still works afterwards
def sleepy(seconds):
    def hook(tmp):
        time.sleep(seconds)
    return hook
ck.save_checkpoint(obj if env.rank == 0 else None, path, before_replace=sleepy(6.0))
t = torch.ones(1)
dist.all_reduce(t)
out["after_slow_save"] = t.item()
# a write slower than the save's own wait: named on the waiting ranks, which stop there (the
# job is over); rank 0 then finds its peers gone at the save's closing barrier
try:
    ck.save_checkpoint(obj if env.rank == 0 else None, path, before_replace=sleepy(1.5),
                       timeout_s=0.3)
    out["slow"] = None
except TimeoutError as exc:
    out["slow"] = str(exc)
except RuntimeError as exc:
    out["slow"] = "peers gone" if "closed" in str(exc) or "reset" in str(exc) else str(exc)
print(json.dumps(out), flush=True)
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_b14_save_then_load_on_every_rank(tmp_path):
    script = tmp_path / "b14.py"
    script.write_text(B14)
    path = tmp_path / "ckpt" / "checkpoint.pt"
    path.parent.mkdir()
    result = run_torchrun(str(script), [str(path)], nproc_per_node=3, timeout=120, live=False,
                          backend="gloo")
    for rank in range(3):
        out = json.loads(result.rank_lines(rank)[-1])
        assert out["loaded_sum"] == sum(range(1000))
        assert out["temporaries"] == []
        assert out["exists"] is True
        assert out["failure"].startswith("rank 0 could not write checkpoint ")
        assert out["after_slow_save"] == 3.0
        if rank == 0:
            assert out["slow"] == "peers gone"
        else:
            assert out["slow"] == (f"rank {rank} waited 0.3 s for rank 0 to write checkpoint "
                                   f"{path}; it has not finished (raise the wait: "
                                   "timeout_s=..., now 0.3 s)")


# ---- any failure on rank 0 reaches every rank at once (issue 41 item 10) ---------------------

RANK0_FAILS = r'''
import json, os, sys
import torch
import torch.distributed as dist
from ddp_lesson.env import init_distributed
from ddp_lesson import checkpoint as ck

env = init_distributed(timeout=30, announce=False)
path = sys.argv[1]
out = {}
good = {"format": ck.CHECKPOINT_FORMAT, "version": ck.CHECKPOINT_VERSION,
        "model": {"w": torch.arange(10.0)}, "optimizer": {}, "scheduler": {}, "epoch": 1,
        "step_in_epoch": 2, "global_step": 3, "sampler": {}, "rng": [], "config": {},
        "world_size": env.world_size}
ck.save_checkpoint(good if env.rank == 0 else None, path)
before = open(path, "rb").read()

def attempt(key, call):
    try:
        call()
        out[key] = None
    except Exception as exc:  # the default waits (1800 s) would outlast the test's limit
        out[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

# a state torch.save cannot pickle (a lambda): not an OSError
bad = dict(good, schedule=lambda step: 0.1)
attempt("pickling", lambda: ck.save_checkpoint(bad if env.rank == 0 else None, path))
out["previous_kept"] = open(path, "rb").read() == before
out["temporaries"] = sorted(f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f)
# an error while rank 0 builds the state (build=...)
def build():
    raise KeyError("scheduler")
attempt("build", lambda: ck.save_checkpoint(None, path, build=build))
# a check that raises on rank 0
def decide():
    raise ValueError("cannot read the folder")
attempt("decide", lambda: ck.decide_on_rank0(decide))
# the ranks are still in step: a collective works
t = torch.ones(1)
dist.all_reduce(t)
out["after"] = t.item()
print(json.dumps(out), flush=True)
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)  # rank 1 would otherwise wait RANK0_WAIT_S = 1800 s for each answer
def test_any_failure_on_rank0_raises_on_every_rank_at_once(tmp_path):
    script = tmp_path / "rank0_fails.py"
    script.write_text(RANK0_FAILS)
    path = tmp_path / "checkpoint.pt"
    result = run_torchrun(str(script), [str(path)], nproc_per_node=2, timeout=100, live=False,
                          backend="gloo")
    r0, r1 = (json.loads(result.rank_lines(r)[-1]) for r in (0, 1))
    assert r0["pickling"].startswith(("AttributeError: Can't pickle", "PicklingError: Can't"))
    pickling = r0["pickling"].split(": ", 1)[1]
    assert r1["pickling"].startswith(f"Rank0Error: rank 0 failed to write checkpoint {path}: ")
    assert pickling[:30] in r1["pickling"]
    assert r0["build"] == "KeyError: 'scheduler'"
    assert r1["build"] == (f"Rank0Error: rank 0 failed to write checkpoint {path}: KeyError: "
                           "'scheduler' (raised on rank 1 too, so that no rank waits for it)")
    assert r0["decide"] == "ValueError: cannot read the folder"
    assert r1["decide"] == ("Rank0Error: rank 0 failed to check the checkpoint: ValueError: "
                            "cannot read the folder (raised on rank 1 too, so that no rank "
                            "waits for it)")
    for out in (r0, r1):
        assert out["previous_kept"] is True and out["temporaries"] == []
        assert out["after"] == 2.0


RANK0_RAISES = r'''
import sys
import torch
from ddp_lesson.env import init_distributed
from ddp_lesson import checkpoint as ck

env = init_distributed(timeout=30, announce=False)
bad = {"schedule": lambda step: 0.1} if env.rank == 0 else None
ck.save_checkpoint(bad, sys.argv[1])  # uncaught: the run fails
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_run_names_rank_0_not_the_rank_it_told(tmp_path):
    """Rank 1's Rank0Error passes on rank 0's failure: the launcher names rank 0 as the cause,
    whichever of the two exceptions left its program first (its record is marked)."""
    script = tmp_path / "rank0_raises.py"
    script.write_text(RANK0_RAISES)
    with pytest.raises(TorchrunError) as info:
        run_torchrun(str(script), [str(tmp_path / "c.pt")], nproc_per_node=2, timeout=100,
                     live=False, backend="gloo")
    err = info.value
    assert (err.rank, err.consequences) == (0, [1])
    assert "Can't pickle" in err.traceback.splitlines()[-1]
    assert "Rank0Error: rank 0 failed to write checkpoint" in err.result.errors[1]


# ---- default map_location: this rank's device (B25) ------------------------------------------

def test_load_never_passes_map_location_none_to_torch_load(tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    save_atomic(_valid(), path)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("map_location", "<not passed>"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ckpt = load_checkpoint(path)                       # the default: this rank's device
    load_checkpoint(path, map_location=None)           # None means the same
    load_checkpoint(path, map_location="cpu")          # an explicit choice is passed on
    assert seen == ["cpu", "cpu", "cpu"]
    assert ckpt["model"]["w"].device.type == "cpu"


def test_default_map_location_is_cuda_local_rank_when_that_gpu_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert ck.default_map_location({"LOCAL_RANK": "3"}) == "cuda:3"
    assert ck.default_map_location({"LOCAL_RANK": "4"}) == "cpu"   # no GPU 4: stay on CPU
    assert ck.default_map_location({}) == "cpu"                     # not under torchrun
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ck.default_map_location({"LOCAL_RANK": "0"}) == "cpu"


# ---- temporary files left by killed writers (B26) -------------------------------------------

def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_sweep_removes_only_dead_writers_files_of_this_checkpoint(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "checkpoint.pt"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _dead_pid()
        names = [f"checkpoint.pt.tmp.{dead}", f"checkpoint.pt.tmp.{live.pid}",
                 f"checkpoint.pt.tmp.{os.getpid()}",          # this process's own write
                 f"other.pt.tmp.{dead}", "checkpoint.pt.tmp.x1", "checkpoint.pt"]
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        assert ck.sweep_temporaries(str(path)) == [f"checkpoint.pt.tmp.{dead}"]
        assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
        # the job's only writer, before it writes: every other pid's file goes
        assert ck.sweep_temporaries(str(path), only_dead=False) == [
            f"checkpoint.pt.tmp.{live.pid}"]
        assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
    finally:
        live.kill()
        live.wait()
    assert ck.sweep_temporaries(str(tmp_path / "no" / "folder" / "c.pt")) == []


@pytest.mark.slow
def test_a_good_save_sweeps_a_killed_writers_file_but_not_a_live_ones(tmp_path):
    path = tmp_path / "c.pt"
    dead, live = _dead_pid(), os.getppid()
    (tmp_path / f"c.pt.tmp.{dead}").write_bytes(b"almost a whole checkpoint")
    (tmp_path / f"c.pt.tmp.{live}").write_bytes(b"another writer, still at work")
    save_atomic({"a": torch.ones(2)}, str(path))
    assert sorted(os.listdir(tmp_path)) == sorted(["c.pt", f"c.pt.tmp.{live}"])


def test_the_trainer_sweeps_at_start_before_any_write(tmp_path):
    from ddp_lesson import train

    out = tmp_path / "run"
    out.mkdir()
    stale = out / f"checkpoint.pt.tmp.{os.getppid()}"  # a pid that is alive: only the start
    stale.write_bytes(b"x")                           # sweep (all files) can remove it
    keep = out / "notes.tmp.1"
    keep.write_bytes(b"x")
    torch.set_num_threads(1)
    train.main(["--epochs", "1", "--num-train", "4", "--num-val", "2", "-b", "4", "--size", "32",
                "32", "--width", "4", "--out", str(out)])
    assert not stale.exists() and keep.exists()
    assert not [p for p in os.listdir(out) if ".tmp." in p and p != "notes.tmp.1"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cli_kill_during_save_recovers_and_leaves_no_temporary(tmp_path):
    """B26's command: SIGKILL inside the checkpoint write, restart, tmp file gone."""
    import subprocess
    import sys

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DDP_LESSON_BACKEND", None)
    # 16 samples, 2 ranks, batch 4: 2 steps, one epoch; a checkpoint after every step. Rank 0
    # dies inside the write of step 2 (the last); the restart resumes from step 1's checkpoint.
    cmd = [sys.executable, "-m", "ddp_lesson.cli", "train", "--nproc-per-node", "2",
           "--backend", "gloo", "--size", "32", "32", "--width", "4", "--num-train", "16",
           "--num-val", "4", "-b", "4", "--epochs", "1", "--checkpoint-every-steps", "1",
           "--max-restarts", "1", "--simulate-failure-at-step", "2",
           "--simulate-failure-during-save", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert ("simulated failure: rank 0 kills itself (SIGKILL) during the checkpoint write at "
            "global step 2") in text
    assert "(global step 1)" in text  # resumed from the last complete checkpoint
    assert (out / "simulated_failure_step2.done").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=True)["global_step"] == 2
    assert [p for p in os.listdir(out) if p.startswith("checkpoint.pt.tmp.")] == []
