"""The training entry point: config and flags, derived values, and real runs (1 and 2 processes)."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader

import ddp_lesson.train as train
from ddp_lesson.config import TrainConfig, build_parser, derived_values, parse_config
from ddp_lesson.sampler import DistributedSampler

# ---- config and flags --------------------------------------------------------------------

def test_defaults():
    cfg = parse_config([])
    assert cfg == TrainConfig()
    assert (cfg.epochs, cfg.batch_size, cfg.workers) == (6, 8, 0)
    assert (cfg.num_train, cfg.num_val, cfg.size, cfg.width) == (1024, 128, (64, 128), 16)
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.seed) == (0.05, 0.9, 1e-4, 0)
    assert (cfg.model, cfg.backend, cfg.data_root, cfg.out) == ("deeplab", "auto", None,
                                                               "runs/main")
    assert cfg.timeout_s == 120 and cfg.local_rank is None


def test_bucket_cap_left_to_torch_unless_given():
    """Issue 40: an explicit cap turns off torch's small first bucket (``_BucketCapacityConfig``
    in torch's ``distributed.py``), so the trainer passes None unless --bucket-cap-mb is given."""
    assert parse_config([]).bucket_cap_mb is None
    assert parse_config(["--bucket-cap-mb", "25"]).bucket_cap_mb == 25.0
    help_text = " ".join(build_parser().format_help().split())
    assert ("unset: torch's default, 1 MB for the first bucket sent (the last layers') and 25 "
            "MB") in help_text   # torch's rebuilt buckets: test_trainer_wraps_torchs_ddp_...
    assert "default 25" not in help_text


@pytest.mark.slow
def test_trainer_wraps_torchs_ddp_with_torchs_default_buckets(world_of_one):
    import types

    import torch
    import torch.distributed as dist

    from ddp_lesson.core.bucketed_ddp import ddp_buckets
    from ddp_lesson.models import build_model

    cfg, env = parse_config([]), types.SimpleNamespace(distributed=True, local_rank=0)
    caps = {}
    for cap in (cfg.bucket_cap_mb, 25.0):
        model = build_model(cfg.model, width=cfg.width)
        ddp = train.wrap_model(model, "torch", env, torch.device("cpu"), cap)
        caps[cap] = ddp._bucket_config.first_bucket_bytes_cap
        seen: list = []
        index = {id(p): i for i, p in enumerate(model.parameters())}
        ddp.register_comm_hook((seen, index), _record_bucket)
        for _ in range(2):  # torch rebuilds its buckets before the 2nd forward
            seen.clear()
            ddp(torch.randn(1, 3, *cfg.size)).sum().backward()
        caps[cap] = (caps[cap], len(seen))
        bucketed = train.wrap_model(build_model(cfg.model, width=cfg.width), "bucketed", env,
                                    torch.device("cpu"), cap)
        nbytes = [p.numel() * 4 for p in model.parameters()]
        theirs = [ids for _, ids in sorted(seen)]
        assert bucketed.bucket_indices == ddp_buckets(nbytes, cap)
        # the same parameters in each bucket as torch after its rebuild; inside a bucket torch
        # recorded a convolution's or BatchNorm's weight before its bias (reverse registration
        # order: bias first), so only the layout inside the flat bucket differs
        assert [sorted(b) for b in bucketed.bucket_indices] == [sorted(b) for b in theirs], cap
        assert bucketed.bucket_indices != theirs
    # the series' model (1.1 MiB): torch's default, two buckets; an explicit 25 MiB: one
    assert caps == {None: (dist._DEFAULT_FIRST_BUCKET_BYTES, 2), 25.0: (25 * 2**20, 1)}


def _record_bucket(state, bucket):
    """A comm hook that records each bucket's parameter indices and leaves its gradients."""
    import torch

    seen, index = state
    seen.append((bucket.index(), [index[id(p)] for p in bucket.parameters()]))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_seed_flag_names():
    # The seed's spellings, including the three it read but never declared.
    cfg = parse_config(["--epochs", "3", "-b", "4", "-j", "2", "--lr", "0.1",
                        "--momentum", "0.8", "--weight-decay", "0.001"])
    assert (cfg.epochs, cfg.batch_size, cfg.workers) == (3, 4, 2)
    assert (cfg.lr, cfg.momentum, cfg.weight_decay) == (0.1, 0.8, 0.001)
    cfg = parse_config(["--batch-size", "5", "--workers", "1"])
    assert (cfg.batch_size, cfg.workers) == (5, 1)


def test_new_flags():
    cfg = parse_config(["--backend", "gloo", "--seed", "7", "--out", "x/y", "--data-root", "/d",
                        "--num-train", "10", "--num-val", "3", "--size", "32", "48",
                        "--model", "tiny", "--width", "8", "--timeout-s", "30"])
    assert (cfg.backend, cfg.seed, cfg.out, cfg.data_root) == ("gloo", 7, "x/y", "/d")
    assert (cfg.num_train, cfg.num_val, cfg.size) == (10, 3, (32, 48))
    assert (cfg.model, cfg.width, cfg.timeout_s) == ("tiny", 8, 30.0)


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local-rank=1"], ["--local_rank", "1"]])
def test_legacy_local_rank_accepted(argv):
    assert parse_config(argv).local_rank == 1


def test_every_field_is_a_flag_with_a_note():
    parser = build_parser()
    dests = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(TrainConfig):
        assert f.name in dests, f.name
        assert dests[f.name].help and dests[f.name].help == f.metadata["help"]
        assert dests[f.name].default == f.default
    text = parser.format_help()
    for flag in ("-b", "--batch-size", "-j", "--workers", "--lr", "--momentum",
                 "--weight-decay", "--local_rank", "--local-rank", "--backend", "--out",
                 "--grad-accum-steps", "--lr-scaling", "--base-batch", "--sync-bn", "--ddp",
                 "--checkpoint-every-steps", "--no-resume", "--max-steps", "--drop-last"):
        assert flag in text


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["-b", "0"], "-b/--batch-size must be >= 1, got 0"),
    (["-j", "-1"], "-j/--workers must be >= 0, got -1"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--num-train", "0"], "--num-train must be >= 1, got 0"),
    (["--num-val", "0"], "--num-val must be >= 1, got 0"),
    (["--size", "4", "64"], "--size must be two numbers H W, each >= 16, got (4, 64)"),
    (["--width", "0"], "--width must be >= 1, got 0"),
    (["--timeout-s", "0"], "--timeout-s must be > 0, got 0.0"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
])
def test_validation_errors_show_numbers(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_of_the_second_version():
    cfg = parse_config(["--grad-accum-steps", "4", "--lr-scaling", "sqrt", "--base-batch", "64",
                        "--lr-schedule", "poly", "--drop-last", "--sync-bn", "--ddp", "bucketed",
                        "--checkpoint-every-steps", "10", "--no-resume", "--max-steps", "7"])
    assert (cfg.grad_accum_steps, cfg.lr_scaling, cfg.base_batch, cfg.lr_schedule) == \
        (4, "sqrt", 64, "poly")
    assert (cfg.drop_last, cfg.sync_bn, cfg.ddp) == (True, True, "bucketed")
    assert (cfg.checkpoint_every_steps, cfg.no_resume, cfg.max_steps) == (10, True, 7)
    d = TrainConfig()
    assert (d.grad_accum_steps, d.lr_scaling, d.base_batch, d.lr_schedule) == \
        (1, "none", 16, "constant")
    assert (d.drop_last, d.sync_bn, d.ddp, d.checkpoint_every_steps, d.no_resume,
            d.max_steps) == (False, False, "torch", 0, False, 0)


def test_ignore_index_is_the_data_modules():
    import ddp_lesson.data

    assert train.IGNORE_INDEX is ddp_lesson.data.IGNORE_INDEX == 255


def test_config_checks_on_construction():
    with pytest.raises(ValueError, match="epochs must be >= 1, got -2"):
        TrainConfig(epochs=-2)


# ---- derived values ----------------------------------------------------------------------

def test_derived_values_default_on_two_ranks():
    d = derived_values(TrainConfig(), world_size=2)
    assert d == {"world_size": 2, "batch_size": 8, "global_batch": 16, "samples_per_rank": 512,
                 "samples_per_epoch": 1024, "steps_per_epoch": 64, "grad_accum_steps": 1,
                 "micro_batches_per_epoch": 64, "effective_lr": 0.05}


def test_derived_values_with_drop_last_and_accumulation():
    # drop_last: N // R per rank, the loader drops the short batch; K micro-batches per step
    cfg = TrainConfig(num_train=35, batch_size=4, drop_last=True, grad_accum_steps=2)
    d = derived_values(cfg, world_size=2)
    assert d["samples_per_rank"] == 17 and d["micro_batches_per_epoch"] == 17 // 4 == 4
    assert d["steps_per_epoch"] == 2 and d["global_batch"] == 4 * 2 * 2
    data = list(range(35))
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, drop_last=True)
        loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
        assert len(loader) == d["micro_batches_per_epoch"]


@pytest.mark.parametrize("num_train, world_size, batch_size", [
    (32, 2, 4), (33, 2, 8), (7, 3, 2), (5, 1, 8), (2, 3, 1), (256, 2, 8)])
def test_steps_per_epoch_matches_the_loader(num_train, world_size, batch_size):
    # ceil(ceil(N / R) / B) on every rank: the sampler pads, so all ranks step equally often.
    cfg = TrainConfig(num_train=num_train, batch_size=batch_size)
    d = derived_values(cfg, world_size)
    assert d["steps_per_epoch"] == math.ceil(math.ceil(num_train / world_size) / batch_size)
    assert d["global_batch"] == batch_size * world_size
    data = list(range(num_train))
    for rank in range(world_size):
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank)
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=False)
        assert len(loader) == d["steps_per_epoch"]
        assert len(sampler) == d["samples_per_rank"]


def test_derived_values_printed_in_notebook_05():
    cfg = TrainConfig()
    assert [(derived_values(cfg, r)["global_batch"], derived_values(cfg, r)["steps_per_epoch"])
            for r in (1, 2, 4)] == [(8, 128), (16, 64), (32, 32)]
    main_run = parse_config(["--epochs", "4", "--num-train", "512", "--size", "48", "96"])
    d = derived_values(main_run, 2)
    assert (d["global_batch"], d["steps_per_epoch"], 4 * d["steps_per_epoch"]) == (16, 32, 128)
    small = parse_config(["--num-train", "64", "-b", "4"])
    assert derived_values(small, 2)["steps_per_epoch"] == 8
    assert derived_values(parse_config(["--num-train", "64"]), 1)["steps_per_epoch"] == 8


def test_docstring_starts_with_the_torchrun_command():
    first = train.__doc__.strip().splitlines()[0]
    assert first.startswith("torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train")


# ---- real runs ---------------------------------------------------------------------------

TINY = ["--epochs", "1", "--num-train", "32", "--num-val", "8", "-b", "4",
        "--size", "32", "64", "--width", "8", "--out", "out"]


def _run(cmd, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DDP_LESSON_BACKEND", None)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((cwd / "out" / "summary.json").read_text())
    return proc, summary


def _check_summary(s, world_size, batch_size=4):
    assert s["world_size"] == world_size
    assert s["backend"] == "gloo" and s["device"] == "cpu"
    assert s["epochs"] == 1 and s["batch_size"] == batch_size
    assert s["global_batch"] == batch_size * world_size
    assert s["steps_per_epoch"] == math.ceil(math.ceil(32 / world_size) / batch_size)
    assert math.isfinite(s["final_train_loss"]) and s["final_train_loss"] > 0
    assert 0.0 <= s["val_miou"] <= 1.0
    assert 0.0 <= s["val_pixel_accuracy"] <= 1.0
    assert len(s["per_class_iou"]) == 19
    assert all(v is None or 0.0 <= v <= 1.0 for v in s["per_class_iou"])
    assert s["samples_per_s"] > 0 and s["wall_s"] > 0
    assert s["config"]["num_train"] == 32 and s["torch"]


@pytest.mark.slow
def test_single_process_run(tmp_path):
    """One plain process (no torchrun): world size 1, no process group, no DDP wrapper."""
    proc, s = _run([sys.executable, "-m", "ddp_lesson.train", *TINY, "--local_rank=0"], tmp_path)
    _check_summary(s, world_size=1)
    assert "note: --local_rank=0 is the legacy" in proc.stdout
    assert "epoch 1/1  train_loss " in proc.stdout
    assert "wrote out/summary.json" in proc.stdout
    assert "lr 0.05 (--lr 0.05 at base global batch 16, --lr-scaling none)\n" in proc.stdout
    assert "schedule constant  no DDP wrapper (1 process)\n" in proc.stdout
    assert len(s["step_losses"]) == s["steps_per_epoch"] == 8
    assert (tmp_path / "out" / "checkpoint.pt").is_file()
    # a finished run's checkpoint counts epochs *completed* (notebook 06 prints it so)
    import torch

    ckpt = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]) == (1, 0, 8)


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestMultiProcess:
    """Multi-process: the README's main command, a real 2-rank gloo job under torchrun."""

    def test_two_process_training_run(self, tmp_path):
        proc, s = _run([sys.executable, "-m", "ddp_lesson.cli", "train", "--nproc-per-node", "2",
                        *TINY], tmp_path)
        _check_summary(s, world_size=2)
        out = proc.stdout
        # the CLI shows what to type without this package, then runs exactly that
        assert out.splitlines()[0] == (
            "equivalent command: torchrun --standalone --nproc-per-node 2 "
            "-m ddp_lesson.train " + " ".join(TINY)
        )
        # Rank 0 alone prints: each line once.
        assert out.count("world_size 2  backend gloo  device cpu\n") == 1
        assert sum(line.startswith("backend choice: 2 processes") for line in out.splitlines()) \
            == 1
        assert "batch per rank 4  global batch 8 (= 4 x 2)\n" in out
        assert "steps per epoch 4  samples per epoch 32 (16 per rank)\n" in out
        assert out.count("epoch 1/1  train_loss ") == 1
        assert out.count("wrote out/summary.json") == 1
        assert out.count("lr 0.05 (--lr 0.05 at base global batch 16, --lr-scaling none)\n") == 1
        assert out.count("schedule constant  ddp torch\n") == 1
        assert "Traceback" not in proc.stderr


def test_a_diverged_run_still_writes_its_summary(tmp_path):
    """A NaN loss (too large a learning rate) must not crash the run at its very end."""
    from ddp_lesson.report import write_json_atomic

    path = tmp_path / "summary.json"
    write_json_atomic(str(path), {"final_train_loss": float("nan"), "diverged": True,
                                  "step_losses": [1.0, float("inf"), None],
                                  "history": [{"train_loss": float("-inf")}]})
    assert json.loads(path.read_text()) == {"final_train_loss": None, "diverged": True,
                                            "step_losses": [1.0, None, None],
                                            "history": [{"train_loss": None}]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left
