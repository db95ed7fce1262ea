"""The conversion of notebook 05: the single-process script and its DDP version agree, the diff
the notebook shows is the files' diff, and exercise 05.1's checker names each missing piece.

The DDP script's 2-rank run is the notebook's own cell (one job, one launch: the test reads the
stored output and asserts the cell's source); the single-process script runs here.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from notebook_cells import StoredRun, cell_with, code_cells
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_lesson.convert import DDP as DDP_FILE
from ddp_lesson.convert import SINGLE, ConversionDiff, conversion_hunks
from ddp_lesson.exercises import reference
from ddp_lesson.exercises.catalog import ex_05_1_convert_loop as ex
from ddp_lesson.exercises.core import run_candidates

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "05_your_script_data_parallel.ipynb"
DDP_CELL = ("%torchrun --nproc-per-node 2 -m ddp_lesson.convert.ddp --out runs/nb05/ddp")

# A raising or hanging candidate costs one collective timeout; keep it short here.
os.environ.setdefault("DDP_LESSON_CHECK_TIMEOUT_S", "4")


# ----------------------------------------------------------------------------- the scripts

def _run_single(tmp_path, *args) -> list[str]:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ddp_lesson.convert.single", "--out",
                           str(tmp_path), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.slow
def test_the_ddp_run_ends_where_the_single_process_run_ends(tmp_path):
    single = _run_single(tmp_path)
    run = StoredRun(NOTEBOOK, "-m ddp_lesson.convert.ddp", DDP_CELL)
    rank0, rank1 = run.rank_lines(0), run.rank_lines(1)
    # the losses, the clipped gradient norm and the weights' fingerprint, to 4 decimals
    for line in single:
        assert line in rank0, (line, rank0)
    fingerprint = next(line for line in single if line.startswith("weights:"))
    assert fingerprint in rank1 and "saved and reloaded checkpoint.pt (epoch 2)" in rank1
    assert not any(line.startswith("epoch") for line in rank1)  # rank 0 logs, once
    assert any("gloo" in line or "nccl" in line for line in run.other)


def test_the_notebook_compares_both_checkpoints_within_its_tolerance():
    text = "".join(o.get("text", "") for o in cell_with(NOTEBOOK, "max |Δ|").outputs
                   if o.get("output_type") == "stream")
    assert "max |Δ| below 1e-06: True" in text
    assert "same parameter names: True" in text


def test_the_prose_quotes_the_stored_numbers():
    """The numbers the Markdown quotes are those the cells printed."""
    cells = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4).cells
    prose = " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == "markdown")
    single = "".join(o.get("text", "") for o in cell_with(NOTEBOOK, "convert.single import main")
                     .outputs if o.get("output_type") == "stream")
    assert "epoch 0: mean loss 1.6491" in single and "epoch 2: mean loss 1.1102" in single
    assert "from about 1.65 to 1.11" in prose
    assert "last step's gradient norm: 1.5609" in single
    assert "gradient norm, 1.56, was above 1" in prose
    removed, added = ConversionDiff().changed_lines()
    assert f"{removed} lines replaced by {added}" in prose
    epochs, steps = 3, 64 // 16
    assert f"within 1e-6 over {epochs * steps} steps" in prose


@pytest.mark.slow
def test_the_single_script_is_deterministic_and_saves_a_loadable_checkpoint(tmp_path):
    first = _run_single(tmp_path / "a")
    assert first == _run_single(tmp_path / "b")
    state = torch.load(tmp_path / "a" / "checkpoint.pt")
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices: NCCL, one GPU per rank")
def test_on_two_gpus_the_ddp_script_ends_where_one_gpu_ends(tmp_path):
    from ddp_lesson.launch import run_torchrun

    _run_single(tmp_path / "single")
    runs = {}
    for name, extra in (("ddp", []), ("fp16", ["--fp16"])):
        runs[name] = run_torchrun("ddp_lesson.convert.ddp", ["--out", str(tmp_path / name), *extra],
                                  module=True, nproc_per_node=2, timeout=240)
        assert "saved and reloaded checkpoint.pt (epoch 2)" in runs[name].outputs[1]
    single = torch.load(tmp_path / "single" / "checkpoint.pt", map_location="cpu")["model"]
    ddp = torch.load(tmp_path / "ddp" / "checkpoint.pt", map_location="cpu")["model"]
    assert max((single[k] - ddp[k]).abs().max().item() for k in single) < 1e-5


# ----------------------------------------------------------------------------- the diff

def test_the_diff_is_the_files_diff_without_the_docstrings():
    import difflib

    hunks = conversion_hunks()
    single, ddp = SINGLE.read_text(), DDP_FILE.read_text()
    full = "".join(difflib.unified_diff(single.splitlines(True), ddp.splitlines(True), n=0))
    for hunk in hunks:
        assert hunk in full
    added = "".join(line[1:] for h in hunks for line in h.splitlines(True) if line[0] == "+")
    for piece in ("init_process_group", "torch.cuda.set_device(local_rank)",
                  "device_ids=[local_rank]", "DistributedSampler", "set_epoch", "pin_memory",
                  "non_blocking", "dist.all_reduce(mean)", "dist.barrier()",
                  "map_location=device", "destroy_process_group", "model.module.state_dict()"):
        assert piece in added, piece
    assert '"""' not in "".join(hunks)  # the docstrings are left out
    # what does not change: the step itself, the clipping on the averaged gradients, AMP
    for same in ("clip_grad_norm_", "scaler.unscale_(opt)", "scaler.step(opt)"):
        assert same not in "".join(hunks) and same in single and same in ddp


def test_the_notebook_shows_every_hunk():
    diff = ConversionDiff()
    shown = "".join(o.get("text", "") for c in _cells_with("diff.show(")
                    for o in c.outputs if o.get("output_type") == "stream")
    assert all(h in shown for h in diff.hunks)
    assert "hunks not shown: 0" in "".join(
        o.get("text", "") for o in cell_with(NOTEBOOK, "diff.unshown()").outputs
        if o.get("output_type") == "stream")


def _cells_with(marker):
    return [c for c in code_cells(NOTEBOOK) if marker in c.source]


def test_show_refuses_text_no_hunk_has(capsys):
    diff = ConversionDiff()
    with pytest.raises(LookupError, match="no hunk"):
        diff.show("no such line anywhere")
    diff.show("set_epoch")
    assert "+        sampler.set_epoch(epoch)" in capsys.readouterr().out
    assert len(diff.unshown()) == len(diff.hunks) - 1


def test_every_runnable_module_starts_with_its_command():
    assert SINGLE.read_text().startswith('"""python -m ddp_lesson.convert.single ')
    assert DDP_FILE.read_text().startswith(
        '"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.convert.ddp ')


# ----------------------------------------------------------------------------- exercise 05.1

def test_the_given_loop_is_the_checkers_reference():
    model, data = ex._model(), ex.Recorded()
    saved = []
    real = torch.save
    torch.save = lambda obj, f, *a, **k: saved.append(obj)
    try:
        losses = ex.train_single(model, data, ex.EPOCHS, 2 * ex.BATCH, ex.LR, ex.PATH)
    finally:
        torch.save = real
    ref = ex.reference_run(2)
    assert losses == pytest.approx(ref["losses"], rel=1e-6)
    got = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert got.tolist() == pytest.approx(ref["weights"], abs=1e-6)
    assert len(saved) == 1 and "0.weight" in saved[0]


def _loop(ddp, loader, sampler, opt, epochs, set_epoch=True):
    """The training loop the wrong answers share; returns each rank's own epoch losses."""
    losses = []
    for epoch in range(epochs):
        if set_epoch and sampler is not None:
            sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        losses.append(total / steps)
    return losses


def _reduced(losses):
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def no_sampler(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp = DDP(model)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    losses = _reduced(_loop(ddp, loader, None, torch.optim.SGD(ddp.parameters(), lr=lr), epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def no_set_epoch(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs, set_epoch=False))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def no_ddp(model, dataset, epochs, batch_size, lr, checkpoint_path):
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    losses = _reduced(_loop(model, loader, sampler, torch.optim.SGD(model.parameters(), lr=lr),
                            epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def loss_not_reduced(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    losses = _loop(ddp, loader, sampler, torch.optim.SGD(ddp.parameters(), lr=lr), epochs)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses  # what `if rank == 0: print(loss)` shows: rank 0's shard only


def unshuffled(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def every_rank_saves(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    torch.save(model.state_dict(), checkpoint_path)
    return losses


def wrapper_keys(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    if dist.get_rank() == 0:
        torch.save(ddp.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def barrier_on_rank0_only(model, dataset, epochs, batch_size, lr, checkpoint_path):
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
        dist.barrier()  # inside the if: rank 1 never joins it
    return losses


def scaled_lr(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """The linear scaling rule applied: lr x R."""
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr * dist.get_world_size())
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def split_batch(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """batch_size taken as the global batch and cut by the world size."""
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size // dist.get_world_size(), sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = _reduced(_loop(ddp, loader, sampler, opt, epochs))
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def all_reduced_loss(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """The loss all-reduced and divided by R before backward ("the global loss")."""
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            dist.all_reduce(loss)
            loss = loss / dist.get_world_size()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        losses.append(total / steps)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return losses


def halved_log(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """The logged losses averaged over a constant 2 ranks."""
    ddp, sampler = DDP(model), DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    t = torch.tensor(_loop(ddp, loader, sampler, opt, epochs), dtype=torch.float64)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)
    dist.barrier()
    return (t / 2).tolist()


def by_hand(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """Correct, written differently: no DDP wrapper (gradients averaged by hand after
    backward), the sampler told its rank, the losses gathered as objects."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        mine = []
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            mine.append(loss.item())
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        losses.append(sum(sum(m) for m in everyone) / sum(len(m) for m in everyone))
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, checkpoint_path)
    dist.barrier()
    return losses


WRONG = [no_sampler, no_set_epoch, unshuffled, no_ddp, loss_not_reduced, every_rank_saves,
         wrapper_keys, scaled_lr, split_batch, all_reduced_loss, halved_log,
         barrier_on_rank0_only]


@pytest.fixture(scope="module")
def verdicts():
    """One launch: the reference, the other correct answer, then every wrong answer (the one
    that hangs last but one: its rank 0 times out and the next candidate gets a fresh group)."""
    found = run_candidates("05.1", [reference("05.1"), by_hand, *WRONG])
    return dict(zip(["reference", "by_hand"] + [f.__name__ for f in WRONG], found))


@pytest.mark.slow
def test_05_1_accepts_two_correct_answers_written_differently(verdicts):
    assert verdicts["reference"].passed, verdicts["reference"]
    assert verdicts["by_hand"].passed, verdicts["by_hand"]
    assert str(verdicts["reference"]).startswith("PASSED 05.1")


@pytest.mark.slow
@pytest.mark.parametrize("name, words", [
    ("no_sampler", "each read all 24 samples in epoch 0"),
    ("no_set_epoch", "call sampler.set_epoch(epoch)"),
    ("unshuffled", "in index order, unshuffled"),
    ("no_ddp", "ranks 0 and 1 end with different weights"),
    ("loss_not_reduced", "that is rank 0's own shard only"),
    ("every_rank_saves", "ranks 0, 1, 2 each wrote the checkpoint"),
    ("wrapper_keys", "keys start with 'module.'"),
    ("barrier_on_rank0_only", "rank 0 at"),
    ("scaled_lr", "they are those of learning rate 0.6 = lr x 3. Keep the learning rate given"),
    ("split_batch", "rank 0's model saw batches of 1 samples; batch_size = 4 is the per-rank "
                    "batch already"),
    ("all_reduced_loss", "they are those of learning rate 0.06667 = lr / 3, gradients 3 times "
                         "too small"),
    ("halved_log", "that is the sum over the 3 ranks divided by 2. Divide by "
                   "dist.get_world_size()"),
])
def test_05_1_names_the_missing_piece(verdicts, name, words):
    verdict = verdicts[name]
    assert not verdict.passed
    assert words in verdict.problems[0], verdict.problems


@pytest.mark.slow
def test_05_1_a_collective_only_rank_0_reaches_is_named_not_hung(verdicts):
    text = verdicts["barrier_on_rank0_only"].problems[0]
    assert re.search(r"rank 0 at .*line \d+", text), text
    assert "ranks 1, 2 finished" in text
    assert json.dumps(text)  # a verdict, not a hang
