"""Bad input to the main job: one line naming the values, a non-zero exit, no traceback, and
any checkpoint already in --out left byte for byte as it was.

Most cases run the trainer's ``main`` in this process (a single process, no torchrun); the
multi-rank cases (more ranks than samples, a bad checkpoint seen by every rank) share one
3-rank torchrun launch. ``cli.preflight`` (what a launcher can run before starting processes)
is checked on the same cases.
"""
import json
import os

import pytest
import torch

from ddp_lesson import cli, config, train
from ddp_lesson.launch import run_torchrun

TINY = ["--epochs", "1", "--num-train", "8", "--num-val", "2", "-b", "4", "--size", "32", "64",
        "--width", "4"]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch, tmp_path):
    # An empty working folder: a test that leaves --out at its default (runs/main) must not meet
    # the checkpoint the README's quickstart wrote there, nor leave a folder behind.
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "DDP_LESSON_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fails(argv, capsys) -> str:
    """Run the trainer; assert exit status 2 and exactly one stderr line; return that line."""
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A real finished run's checkpoint (width 4, batch 4)."""
    out = tmp_path_factory.mktemp("good")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    train.main(TINY + ["--out", str(out)])
    torch.set_num_threads(before)
    return out / "checkpoint.pt"


# ---- flags -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["-b", "0"], "-b/--batch-size must be >= 1, got 0"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
    (["--grad-accum-steps", "0"], "--grad-accum-steps must be >= 1, got 0"),
    (["--checkpoint-every-steps", "-1"], "--checkpoint-every-steps must be >= 0, got -1"),
    (["--lr-scaling", "cubic"], "argument --lr-scaling: invalid choice: 'cubic'"),
    # mixed precision, clipping and bucket flags
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8' (choose from 'off', 'bf16', 'fp16')"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number > 0 (leave the flag "
                                "out for no clipping), got 0.0"),
    (["--clip-grad-norm", "-1.5"], "--clip-grad-norm must be a finite number > 0 (leave the "
                                   "flag out for no clipping), got -1.5"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a finite number > 0"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be a finite number > 0, got 0.0"),
    (["--bucket-cap-mb", "-4"], "--bucket-cap-mb must be a finite number > 0, got -4.0"),
    (["--bucket-cap-mb", "1e308"], "--bucket-cap-mb 1e+308 MiB is more bytes than a float holds"),
    (["--ddp", "naive", "--bucket-cap-mb", "5"],
     "--bucket-cap-mb 5 needs --ddp torch or bucketed: NaiveDDP has no buckets"),
    (["--ddp", "naive", "--static-graph"],
     "--static-graph needs --ddp torch: ddp_lesson's naive wrapper does not implement it"),
    (["--ddp", "bucketed", "--static-graph"],
     "--static-graph needs --ddp torch: ddp_lesson's bucketed wrapper does not implement it"),
    (["--static-graph", "--grad-accum-steps", "2"],
     "--static-graph with --grad-accum-steps 2: torch's DDP fails in its first no_sync() backward "
     "(expect_autograd_hooks_ INTERNAL ASSERT, seen in torch 2.13); drop --static-graph or use "
     "--grad-accum-steps 1"),
    (["--ddp", "bucketed", "--gradient-as-bucket-view"],
     "--gradient-as-bucket-view needs --ddp torch: ddp_lesson's bucketed wrapper does not"),
])
def test_bad_flags(argv, message, capsys):
    line = _fails(argv, capsys)
    assert line.startswith("python -m ddp_lesson.train: error: ") and message in line


STATIC_NO_SYNC = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
m = DDP(nn.Linear(2, 1), static_graph=True)
try:
    with m.no_sync():
        m(torch.ones(4, 2)).sum().backward()
    m(torch.ones(4, 2)).sum().backward()
    print("ok")
except RuntimeError as e:
    print(str(e).split(" at ")[0])
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_static_graph_with_no_sync_fails_in_torch_as_the_refusal_says():
    """Why ``--static-graph --grad-accum-steps 2`` is refused: torch's DDP itself fails with
    ``static_graph=True`` when its first backward runs inside ``no_sync()`` (huggingface/
    accelerate#3679; pytorch/pytorch PR #187732). If a torch release fixes it, this fails:
    then allow the combination with equal weights to the run without the flag."""
    from ddp_lesson.launch import run_torchrun

    result = run_torchrun(code=STATIC_NO_SYNC, nproc_per_node=2, backend="gloo", timeout=120,
                          live=False)
    assert [result.rank_lines(r) for r in (0, 1)] == [
        ["expect_autograd_hooks_ INTERNAL ASSERT FAILED"]] * 2


def test_bf16_where_the_device_cannot_do_it(monkeypatch, capsys, tmp_path):
    """bf16 autocast runs on CPU in torch 2.13; where it cannot (here: said so by a patched
    torch), the job stops at start, before any process group, with one line."""
    monkeypatch.setattr(torch.amp.autocast_mode, "is_autocast_available", lambda device: False)
    line = _fails(TINY + ["--amp", "bf16", "--out", str(tmp_path)], capsys)
    assert line == "error: --amp bf16: autocast is not available on device type 'cpu'"
    assert not (tmp_path / "checkpoint.pt").exists()
    with pytest.raises(config.TrainInputError, match="^--amp bf16: autocast is not available"):
        cli.preflight(TINY + ["--amp", "bf16", "--out", str(tmp_path)], world_size=2)
    # the launcher refuses it before starting any process
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("processes started"))
    assert cli.main(["train", "--nproc-per-node", "2", "--amp", "bf16"]) == 2
    assert capsys.readouterr().err == ("ddp-lesson train: error: --amp bf16: autocast is not "
                                       "available on device type 'cpu'\n")
    monkeypatch.undo()
    # a GPU without bfloat16 (e.g. before Ampere): named, with the way out
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    monkeypatch.setattr(torch.amp.autocast_mode, "is_autocast_available", lambda device: True)
    assert train.amp_unavailable("bf16", "cuda") == ("--amp bf16: this GPU (Tesla V100) does not "
                                                    "support bfloat16; use --amp fp16")
    assert train.amp_unavailable("fp16", "cuda") is None


def test_bf16_guard_refuses_an_emulating_gpu_like_a_t4(monkeypatch):
    """A T4 (7.5) makes bfloat16 tensors, so ``is_bf16_supported()`` is True there by default
    (emulation); the guard asks ``including_emulation=False`` and refuses it (issue 40)."""
    calls = []

    def t4_is_bf16_supported(including_emulation=True):  # torch 2.13's rule for a 7.5 GPU
        calls.append(including_emulation)
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", t4_is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    monkeypatch.setattr(torch.amp.autocast_mode, "is_autocast_available", lambda device: True)
    assert train.amp_unavailable("bf16", "cuda") == ("--amp bf16: this GPU (Tesla T4) does not "
                                                    "support bfloat16; use --amp fp16")
    assert calls == [False]
    assert train.amp_unavailable("fp16", "cuda") is None
    # an A100 (8.0): accepted
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert train.amp_unavailable("bf16", "cuda") is None


def test_flag_errors_come_before_any_process(capsys, monkeypatch):
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("processes started"))
    for args, message in (
            (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number > 0"),
            (["--ddp", "naive", "--static-graph"], "--static-graph needs --ddp torch"),
            (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be a finite number > 0")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["train", "--nproc-per-node", "2", *args])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


# ---- backend and process counts ----------------------------------------------------------

def test_unknown_backend_from_the_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DDP_LESSON_BACKEND", "mpi")
    line = _fails(TINY + ["--out", str(tmp_path)], capsys)
    assert line == "error: backend 'mpi' is not one of auto, gloo, nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_cuda(capsys, tmp_path):
    line = _fails(TINY + ["--backend", "nccl", "--out", str(tmp_path)], capsys)
    assert line == "error: nccl needs one GPU per process: 1 process but 0 GPUs visible"


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has 4 GPUs")
def test_more_local_ranks_than_gpus_with_nccl(monkeypatch, capsys, tmp_path):
    # what rank 0 of a 4-process torchrun job sees (checked before any process group exists)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "4"),
                        ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    line = _fails(TINY + ["--backend", "nccl", "--out", str(tmp_path)], capsys)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert line == (f"error: nccl needs one GPU per process: 4 processes but {gpus} "
                    f"GPU{'s' if gpus != 1 else ''} visible")


def test_world_size_zero(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "0")
    line = _fails(TINY + ["--out", str(tmp_path)], capsys)
    assert line == "error: WORLD_SIZE must be >= 1, got 0"


@pytest.mark.parametrize("n", ["0", "-2"])
def test_cli_nproc_per_node_not_positive(n, capsys):
    assert cli.main(["train", "--nproc-per-node", n]) == 2
    assert (
        capsys.readouterr().err
        == f"ddp-lesson train: error: --nproc-per-node must be >= 1, got {n}\n"
    )


@pytest.mark.parametrize("args, message", [
    (["--backend", "nccl"], "nccl needs one GPU per process: 2 processes but 0 GPUs visible"),
    (["--num-train", "2", "--drop-last", "--nproc-per-node", "3"],
     "no training steps: 2 training samples on 3 ranks with --drop-last give each rank 0 samples"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["DDP_LESSON_BACKEND=foo"], "backend 'foo' is not one of auto, gloo, nccl"),
    (["DDP_LESSON_BACKEND=nccl"], "nccl needs one GPU per process: 2 processes but 0 GPUs visible"),
])
def test_cli_refuses_bad_input_before_starting_processes(args, message, capsys, monkeypatch):
    import torch

    for a in [a for a in args if a.startswith("DDP_LESSON_BACKEND=")]:
        monkeypatch.setenv("DDP_LESSON_BACKEND", a.split("=", 1)[1])
        args = [x for x in args if x != a]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("processes started"))
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddp-lesson train: error: " + message) and err.count("\n") == 1


def test_epoch_without_steps_is_refused_before_the_run():
    # 2 samples, 3 ranks, --drop-last: every rank would get 0 samples (docs/pitfalls.md A7)
    with pytest.raises(config.TrainInputError,
                       match=r"^no training steps: 2 training samples on 3 ranks with "
                             r"--drop-last give each rank 0 samples; use at most 2 ranks"):
        cli.preflight(["--num-train", "2", "--drop-last"], world_size=3)
    with pytest.raises(config.TrainInputError,
                       match=r"^no training steps: 10 training samples on 2 ranks give 5 per "
                             r"rank, fewer than one batch of 8 with --drop-last"):
        cli.preflight(["--num-train", "10", "--drop-last", "-b", "8"], world_size=2)


# ---- data folder -------------------------------------------------------------------------

def _wrong_layout(root):
    (root / "leftImg8bit" / "train" / "aachen").mkdir(parents=True)
    (root / "leftImg8bit" / "train" / "aachen" / "aachen_000000_000019_leftImg8bit.png")\
        .write_bytes(b"")


@pytest.mark.parametrize("case, message", [
    ("missing", r"error: --data-root '{root}': Cityscapes root {root} does not exist; expected "
                r"{root}/leftImg8bit/train/<city>/"),
    ("empty", r"error: --data-root '{root}': no folder {root}/leftImg8bit/train for split "
              r"'train'; expected"),
    ("wrong_layout", r"error: --data-root '{root}': image {root}/leftImg8bit/train/aachen/"
                     r"aachen_000000_000019_leftImg8bit.png has no label file: expected "
                     r"{root}/gtFine/train/aachen/aachen_000000_000019_gtFine_labelIds.png"),
])
def test_bad_data_root(case, message, tmp_path, capsys):
    root = tmp_path / "cityscapes"
    if case != "missing":
        root.mkdir()
    if case == "wrong_layout":
        _wrong_layout(root)
    line = _fails(TINY + ["--data-root", str(root), "--out", str(tmp_path / "o")], capsys)
    assert line.startswith(message.format(root=root).replace("\\", "")), line
    with pytest.raises(config.TrainInputError):
        cli.preflight(TINY + ["--data-root", str(root), "--out", str(tmp_path / "o")], 2)


# ---- output folder and checkpoints -------------------------------------------------------

def test_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = _fails(TINY + ["--out", str(blocker)], capsys)
    assert line == f"error: --out '{blocker}' cannot be written: File exists"
    line = _fails(TINY + ["--out", str(blocker / "sub")], capsys)
    assert line == f"error: --out '{blocker / 'sub'}' cannot be written: Not a directory"
    assert blocker.read_text() == "x"


def _bad_file(kind, out, good_checkpoint):
    path = out / "checkpoint.pt"
    out.mkdir(exist_ok=True)
    if kind == "truncated":
        data = good_checkpoint.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif kind == "text":
        path.write_text("hello\n")
    elif kind == "state_dict":
        torch.save({"weight": torch.zeros(2)}, path)
    return path


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            "truncated",
            "bytes) is not a readable checkpoint (no zip archive: truncated, or not written by "
            "torch.save)",
        ),
        (
            "text",
            "bytes) is not a readable checkpoint (no zip archive: truncated, or not written by "
            "torch.save)",
        ),
        (
            "state_dict",
            "is not a ddp_lesson checkpoint: it holds a dict with keys ['weight'], "
            "without format='ddp_lesson.checkpoint'",
        ),
    ],
)
def test_truncated_or_foreign_file_at_out(kind, message, tmp_path, good_checkpoint, capsys):
    path = _bad_file(kind, tmp_path / "o", good_checkpoint)
    before = path.read_bytes()
    line = _fails(TINY + ["--out", str(tmp_path / "o")], capsys)
    assert line.startswith(f"error: {path} (") or line.startswith(f"error: {path} is")
    assert message in line
    assert line.endswith("; move it away or pass --no-resume to start over")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path / "o")) == ["checkpoint.pt"]


@pytest.mark.parametrize("flags, message", [
    (["--width", "8"], "does not fit this model: 'backbone.0.0.weight' has shape (4, 3, 3, 3) "
                       "in the checkpoint but (8, 3, 3, 3) in the model"),
    (["--model", "tiny"], "does not fit this model: the checkpoint lacks 'features.0.0.weight'"),
    (["-b", "2"], "does not match this run: batch_size=4 in the checkpoint but batch_size=2 "
                  "in this run"),
    (["--lr", "0.1", "--seed", "3"], "does not match this run: seed=0 in the checkpoint but "
                                     "seed=3 in this run"),
])
def test_checkpoint_of_another_model_or_config(flags, message, tmp_path, good_checkpoint,
                                               capsys):
    out = tmp_path / "o"
    out.mkdir()
    path = out / "checkpoint.pt"
    path.write_bytes(good_checkpoint.read_bytes())
    before = path.read_bytes()
    argv = TINY + flags + ["--out", str(out)]
    line = _fails(argv, capsys)
    assert line.startswith(f"error: checkpoint {path} ") and message in line, line
    assert line.endswith("resume with the same settings, or pass --no-resume to start over")
    assert path.read_bytes() == before
    with pytest.raises(config.TrainInputError, match="does not"):
        cli.preflight(argv, world_size=1)
    # the checkpoint is fine for the run that wrote it
    assert cli.preflight(TINY + ["--out", str(out)], world_size=1).width == 4


def test_world_size_of_the_checkpoint(tmp_path, good_checkpoint):
    """Another world size resumes when it can share each step's K x R micro-batches; the
    refusal names R, K and R' (the run itself: tests/train/test_train_resize.py)."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(good_checkpoint.read_bytes())
    with pytest.raises(config.TrainInputError) as exc:
        cli.preflight(TINY + ["--out", str(out)], world_size=2)
    assert str(exc.value) == (
        f"checkpoint {out}/checkpoint.pt cannot resume at 2 processes: a step holds K x R = "
        "1 x 1 = 1 micro-batch (R=1 process, K=1 accumulation step), which R'=2 processes "
        "cannot share: K' = K x R / R' = 1/2 is not a whole number; use 1 process, or pass "
        "--no-resume to start over")


def _stopped(out, flags):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    train.main(flags + ["--out", str(out), "--max-steps", "1"])
    torch.set_num_threads(before)
    return out / "checkpoint.pt"


def test_another_world_size_that_divides_k_x_r(tmp_path):
    # 16 samples, B=4, K=2 on 1 process: 4 micro-batches, 2 steps; stopped after the first
    flags = TINY + ["--num-train", "16", "--grad-accum-steps", "2"]
    path = _stopped(tmp_path, flags)
    assert cli.preflight(flags + ["--out", str(tmp_path)], world_size=2).grad_accum_steps == 2
    with pytest.raises(config.TrainInputError, match=r"cannot resume at 3 processes: a step "
                       r"holds K x R = 2 x 1 = 2 micro-batches .* use 1 or 2 processes, or"):
        cli.preflight(flags + ["--out", str(tmp_path)], world_size=3)
    # 12 samples: 3 micro-batches, the last step holds 1, which 2 processes cannot share
    short = TINY + ["--num-train", "12", "--grad-accum-steps", "2"]
    _stopped(tmp_path / "short", short)
    with pytest.raises(config.TrainInputError) as exc:
        cli.preflight(short + ["--out", str(tmp_path / "short")], world_size=2)
    assert str(exc.value) == (
        f"checkpoint {tmp_path}/short/checkpoint.pt cannot resume at 2 processes: the epoch's "
        "last step holds 1 micro-batch (3 per rank and epoch at R=1, K=2), which R'=2 "
        "processes cannot share; use 1 process, or pass --no-resume to start over")
    # --sync-bn: BatchNorm's statistics span the ranks' micro-batches of the same moment
    sync = flags + ["--sync-bn"]
    _stopped(tmp_path / "sync", sync)
    with pytest.raises(config.TrainInputError, match=r"cannot resume at 2 processes: with "
                       r"--sync-bn BatchNorm's statistics span the micro-batches of the R=1 "
                       r"ranks at the same moment"):
        cli.preflight(sync + ["--out", str(tmp_path / "sync")], world_size=2)
    assert path.exists()


# ---- several ranks -------------------------------------------------------------------------

MULTI = r'''
import contextlib, io, json, sys
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson import train

env = init_distributed(timeout=60, announce=False)
cases = json.loads(sys.argv[1])
res = {}
for name, argv in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
    res[name] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(res))
import gc
gc.collect()  # free DDP wrappers (reference cycles) before the process group goes
cleanup()
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_exits_and_only_rank_0_reports(tmp_path, good_checkpoint):
    truncated = _bad_file("truncated", tmp_path / "trunc", good_checkpoint)
    before = truncated.read_bytes()
    cases = {
        "no_steps": ["--num-train", "2", "--drop-last", "--out", str(tmp_path / "a")],
        "truncated": TINY + ["--out", str(tmp_path / "trunc")],
        "data_root": TINY + ["--data-root", str(tmp_path / "nowhere"), "--out",
                             str(tmp_path / "b")],
    }
    script = tmp_path / "multi.py"
    script.write_text(MULTI)
    result = run_torchrun(str(script), [json.dumps(cases)], nproc_per_node=3, timeout=120,
                          live=False, backend="gloo")
    per_rank = {r: json.loads(result.rank_lines(r)[-1]) for r in range(3)}
    for name in cases:
        for rank in range(3):
            assert per_rank[rank][name]["code"] == 2, (name, rank)
        assert [l for l in per_rank[0][name]["stderr"].splitlines() if l.strip()][0]\
            .startswith("error: ")
        assert len(per_rank[0][name]["stderr"].strip().splitlines()) == 1
        assert per_rank[1][name]["stderr"] == per_rank[2][name]["stderr"] == ""
    assert per_rank[0]["no_steps"]["stderr"].strip() == (
        "error: no training steps: 2 training samples on 3 ranks with --drop-last give each "
        "rank 0 samples; use at most 2 ranks or no --drop-last")
    assert "is not a readable checkpoint" in per_rank[0]["truncated"]["stderr"]
    assert truncated.read_bytes() == before


SUMMARY_FAILS = r'''
import json, os, sys
from ddp_lesson.env import init_distributed
from ddp_lesson import train

env = init_distributed(timeout=60, announce=False)
try:
    train.main(json.loads(sys.argv[1]))
    print(json.dumps(None), flush=True)
except Exception as exc:  # kept alive, as a persistent rank or a caller that catches would be
    print(json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_summary_write_on_rank_0_raises_on_every_rank(tmp_path):
    """Issue 41 item 10: rank 0 cannot write summary.json (a folder is in the way). Rank 1
    hears of it from rank 0 (before: it waited in a barrier until rank 0's process ended,
    then failed with gloo's "Connection closed by peer", or for ever if rank 0 lived on)."""
    out = tmp_path / "run"
    (out / "summary.json").mkdir(parents=True)
    script = tmp_path / "summary_fails.py"
    script.write_text(SUMMARY_FAILS)
    result = run_torchrun(str(script), [json.dumps(TINY + ["--out", str(out)])],
                          nproc_per_node=2, timeout=100, live=False, backend="gloo")
    r0, r1 = (json.loads(result.rank_lines(r)[-1]) for r in (0, 1))
    assert r0.startswith("IsADirectoryError: ")
    # rank 0's exception, its first 160 characters
    assert r1.startswith(f"Rank0Error: rank 0 failed to write {out / 'summary.json'}: {r0[:120]}")
    assert r1.endswith(" (raised on rank 1 too, so that no rank waits for it)")


@pytest.mark.parametrize("nproc, cores, expected", [
    (2, 2, None),
    (1, 8, None),
    (16, 2, "16 processes on 2 CPU cores: each gets 1/8 of a core, every step waits on the "
            "slowest"),
    (3, 2, "3 processes on 2 CPU cores: each gets about 1/1.5 of a core, every step waits on the "
           "slowest"),
])
def test_more_cpu_processes_than_cores_gets_one_warning_line(nproc, cores, expected):
    assert cli.oversubscription_warning(nproc, cores) == expected


def test_cli_warns_once_before_starting_more_gloo_processes_than_cores(capsys, monkeypatch):
    """16 gloo processes on 2 cores: torchrun still starts (the run is legal), after one warning
    line naming both numbers; nothing is said on a GPU node's NCCL run (not checked here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    started = []
    monkeypatch.setattr(cli, "_run_forwarding_signals", lambda cmd, env: started.append(cmd) or 0)
    assert cli.main(["train", "--nproc-per-node", "16", *TINY]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == ["ddp-lesson train: warning: 16 processes on 2 CPU cores: each gets "
                                "1/8 of a core, every step waits on the slowest"]
    assert started and "--nproc-per-node" in started[0]
