"""The seed re-created and repaired (``ddp_lesson.seedfix``, deep dive 06 · The seed, re-created
and repaired): each step repairs one defect and only it, each version runs or fails on 2 ranks as
the deep dive says, and every line the deep dive prints is the one checked here.

The versions' 2-rank runs are the deep dive's own cells (one job, one launch: the test reads the
stored output and asserts the cell's source; nbval's replay checks that output on a fresh run).
The seed and the repaired program are also launched here directly, without the runner, for
their own exit status and traceback.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from pathlib import Path

import nbformat
import pytest
import torch
from notebook_cells import NOTEBOOKS, StoredRun, cell_with, code_cells, stream_text
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.config import TrainConfig
from ddp_lesson.seedfix import (
    FINAL,
    STEPS,
    VERSIONS,
    as_printed,
    as_printed_error,
    changed_lines,
    code_lines,
    path,
    source,
    step_diff,
)
from ddp_lesson.seedfix.run import (
    NCCL_UNAVAILABLE,
    NO_NCCL,
    _ending,
    nccl_unavailable,
    run_version,
    warnings_in,
)
from ddp_lesson.seedfix.run import main as run_main

NOTEBOOK = "deep/06_the_seed_repaired.ipynb"
NUM_SAMPLES, BATCH, EPOCHS, WORLD = 12, 3, 2, 2  # seed_v0's data set and defaults


def line_of(version: str, text: str) -> int:
    """The number of the only line of ``version``'s file that contains ``text``."""
    found = [i for i, line in enumerate(source(version).splitlines(), 1) if text in line]
    assert len(found) == 1, (version, text, found)
    return found[0]


def module(version: str):
    return importlib.import_module(f"ddp_lesson.seedfix.{version}")


def torch_order(rank: int, epoch: int, n: int = NUM_SAMPLES, world: int = WORLD) -> list[int]:
    sampler = TorchSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


# ----------------------------------------------------------------------------- the steps

def test_every_version_starts_with_its_command_and_imports_from_where_it_says():
    assert VERSIONS == tuple(f"seed_v{k}" for k in range(FINAL + 1))
    assert [s.number for s in STEPS] == list(range(1, FINAL + 1))
    for version in VERSIONS:
        assert source(version).startswith(
            f'"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.seedfix.{version}\n')
    for version in VERSIONS[1:]:  # seed_v0 stops at its class statement
        assert module(version).__file__ == str(path(version))  # a file or made from REPAIRS
    assert [v for v in VERSIONS if path(v).is_file()] == ["seed_v0", "seed_v10"]
    with pytest.raises(ValueError, match="unknown version 'seed_v11'"):
        path("seed_v11")
    for number in (0, FINAL + 1):
        with pytest.raises(ValueError, match=f"step {number} does not exist"):
            step_diff(number)


@pytest.mark.parametrize("step", STEPS, ids=[f"step{s.number}" for s in STEPS])
def test_a_defect_is_there_until_its_step_and_gone_from_then_on(step):
    """Every version before the step has the defect, the step's version and all after it do
    not: so each step repairs its own defect, and no step touches another's."""
    had = [step.defect_in(version) for version in VERSIONS]
    assert had == [k < step.number for k in range(FINAL + 1)]


@pytest.mark.parametrize("step", STEPS, ids=[f"step{s.number}" for s in STEPS])
def test_each_step_changes_only_its_defects_lines(step):
    lines = changed_lines(step.number)
    assert lines, step
    for line in lines:
        assert not line[1:].strip() or re.search(step.touches, line[1:]), (step.number, line)
    # the step's pattern is narrow: it matches few of the repaired program's lines
    final = code_lines(VERSIONS[-1])[1]
    assert sum(bool(re.search(step.touches, line)) for line in final) < len(final) / 4


@pytest.mark.parametrize("number", range(1, FINAL + 1))
def test_a_steps_diff_is_the_two_files_diff_at_their_own_line_numbers(number):
    old = source(VERSIONS[number - 1]).splitlines()
    new = source(VERSIONS[number]).splitlines()
    text = step_diff(number)
    assert text.startswith(f"--- {VERSIONS[number - 1]}.py\n+++ {VERSIONS[number]}.py\n@@ ")
    a = b = 0
    for line in text.splitlines()[2:]:
        m = re.match(r"@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@$", line)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            continue
        if line[0] in " -":
            assert old[a - 1] == line[1:], (number, a, line)
            a += 1
        if line[0] in " +":
            assert new[b - 1] == line[1:], (number, b, line)
            b += 1
    # nothing of a module docstring is in it
    doc_end = code_lines(VERSIONS[number])[0]
    assert all(int(n) > doc_end for n in re.findall(r"^@@ -\d+(?:,\d+)? \+(\d+)", text, re.M))


def test_the_lines_fit_a_diff_within_100_characters():
    for version in VERSIONS:
        assert max(len(line) for line in source(version).splitlines()) <= 99, version


# ----------------------------------------------------------------------------- the code itself

def test_the_seed_as_printed_does_not_compile_and_seed_v0_does():
    printed, v0 = as_printed().splitlines(), source("seed_v0").splitlines()
    differ = [i for i, (x, y) in enumerate(zip(printed, v0), 1) if x != y]
    assert len(printed) == len(v0) and differ == [line_of("seed_v0", "return self.num_samples")]
    nested = line_of("seed_v0", "def __len__")
    assert as_printed_error() == ("IndentationError: expected an indented block after function "
                                  f"definition on line {nested} (line {nested + 1})")
    compile(source("seed_v0"), "seed_v0.py", "exec")


def test_seed_v0_stops_at_its_class_statement_and_the_others_import():
    with pytest.raises(NameError, match="name 'Sampler' is not defined"):
        module("seed_v0")
    for version in VERSIONS[1:]:
        assert inspect.isclass(module(version).DistributedSampler)


def test_the_sampler_has_no_len_until_step_5():
    for k, version in enumerate(VERSIONS[1:], 1):
        sampler = module(version).DistributedSampler(range(NUM_SAMPLES), num_replicas=2, rank=0)
        if k < 5:
            with pytest.raises(TypeError, match="has no len"):
                len(sampler)
        else:
            assert len(sampler) == NUM_SAMPLES // 2


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_repaired_sampler_deals_as_torchs(shuffle):
    ours = module("seed_v10").DistributedSampler
    for n in range(0, 14):
        for world in range(1, 6):
            for rank in range(world):
                for epoch in range(3):
                    a = ours(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=3)
                    b = TorchSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                     seed=3)
                    a.set_epoch(epoch)
                    b.set_epoch(epoch)
                    assert list(a) == list(b) and len(a) == len(b), (n, world, rank, epoch)


def test_padding_once_fails_exactly_when_the_padding_exceeds_the_samples():
    seed_v9 = module("seed_v9").DistributedSampler
    for n in range(1, 14):
        for world in range(1, 8):
            padding = math.ceil(n / world) * world - n
            assert (padding > n) == (n < world / 2)  # docs/seed.md's condition
            sampler = seed_v9(range(n), num_replicas=world, rank=0)
            if padding > n:
                with pytest.raises(AssertionError):
                    list(sampler)
            else:
                assert list(sampler) == list(TorchSampler(range(n), world, 0, seed=0))
            if world == 2:
                assert padding <= 1  # two processes never show it


def test_the_declared_defaults_are_the_trainers():
    cfg = TrainConfig()
    text = source("seed_v4")
    for flag, value in (("--lr", cfg.lr), ("--momentum", cfg.momentum),
                        ("--weight-decay", cfg.weight_decay)):
        m = re.search(rf'add_argument\("{flag}", default=([^,]+),', text)
        assert m and float(m.group(1)) == value, flag
    assert (cfg.lr, cfg.momentum, cfg.weight_decay) == (0.05, 0.9, 1e-4)  # the deep dive's words


def test_the_legacy_flag_would_have_put_every_rank_on_gpu_0():
    text = source("seed_v6")
    assert 'add_argument("--local_rank", default=0,' in text
    assert 'device = torch.device("cuda", args.local_rank)' in text
    assert 'device = torch.device("cuda", local_rank)' in source("seed_v7")


def test_the_data_set_has_void_pixels_and_19_classes():
    from ddp_lesson.data import SyntheticCityscapes
    from ddp_lesson.models import build_model

    targets = torch.stack([SyntheticCityscapes(NUM_SAMPLES, size=(32, 64))[i][1]
                           for i in range(NUM_SAMPLES)])
    assert (targets == 255).any() and targets[targets != 255].max() <= 18
    assert build_model("deeplab", width=8).classifier.out_channels == 19


# ----------------------------------------------------------------------------- the runner

def test_the_runner_reports_argparse_and_a_crash_in_one_line(capsys):
    ending = run_version("seed_v3", ["--lr", "0.05"])
    assert ending == "exited 2: seed_v3.py: error: unrecognized arguments: --lr 0.05"
    ending = run_version("seed_v0")
    line = line_of("seed_v0", "class DistributedSampler(Sampler):")
    assert ending == f"crashed at seed_v0.py:{line}: NameError: name 'Sampler' is not defined"
    assert capsys.readouterr().out.splitlines() == [
        "exited 2: seed_v3.py: error: unrecognized arguments: --lr 0.05", ending]
    assert run_version("seed_v10", ["--help"]) == "finished"
    with pytest.raises(SystemExit, match="unknown version 'seed_v99'"):
        run_main(["seed_v99"])
    with pytest.raises(SystemExit, match="usage"):
        run_main([])


def test_the_runner_reads_python_and_torch_warning_lines():
    text = (
        "/venv/torch/distributed/distributed_c10d.py:1849: UserWarning: Attempted to get default "
        "timeout for nccl backend, but NCCL support is not compiled\n"
        "  timeout = _get_default_timeout(backend)\n"
        "[rank0]:[W1202 09:45:26.057461614 reducer.cpp:1529] Warning: find_unused_parameters="
        "True was specified in DDP constructor, but did not find any unused parameters in the "
        "forward pass. (function operator())\n"
        "[rank0]:[W1202 09:45:27.1 reducer.cpp:1529] Warning: find_unused_parameters=True was "
        "specified in DDP constructor, but again\n"
        "Traceback (most recent call last):\n")
    assert warnings_in(text) == [
        ("distributed_c10d.py", "Attempted to get default timeout for nccl backend"),
        ("reducer.cpp", "find_unused_parameters=True was specified in DDP constructor")]
    assert warnings_in("RuntimeError: no warning here\n") == []


def test_the_runner_says_no_nccl_in_one_line_whatever_the_build():
    """A CPU build and a CUDA build without a GPU word the failure differently (and raise
    different classes; 2.14 and 2.15 differ too): the ending is the same line for all."""
    c10d = (Path(torch.__file__).parent / "distributed" / "distributed_c10d.py").read_text()
    assert f'raise RuntimeError("{NCCL_UNAVAILABLE[0]}")' in c10d      # the CPU build's words
    # 2.15's words for a CUDA build without a GPU are in the same file, where this torch has them
    assert NCCL_UNAVAILABLE[2] not in c10d or f'raise RuntimeError("{NCCL_UNAVAILABLE[2]}")' in c10d
    line = line_of("seed_v1", 'dist.init_process_group(backend="nccl")')
    for exc in (RuntimeError(NCCL_UNAVAILABLE[0]), ValueError(NCCL_UNAVAILABLE[1]),
                RuntimeError(NCCL_UNAVAILABLE[2])):
        # raised from seed_v1.py's init_process_group line, as a run raises it
        at_line = compile("\n" * (line - 1) + "raise exc", str(path("seed_v1")), "exec")
        with pytest.raises((RuntimeError, ValueError)) as raised:
            exec(at_line, {"exc": exc})
        assert nccl_unavailable(raised.value)
        assert _ending(raised.value, "", "seed_v1") == f"crashed at seed_v1.py:{line}: {NO_NCCL}"
    other = RuntimeError("NCCL error: unhandled system error")      # not this case: as it is
    assert not nccl_unavailable(other)
    assert _ending(other, "", "seed_v1") == f"crashed: RuntimeError: {other}"


# ----------------------------------------------------------------------------- the deep dive

def _cell_source(k: int) -> str:
    return ("%%torchrun --nproc-per-node 2 --quiet\nfrom ddp_lesson.seedfix.run import "
            f'run_version\n\nrun_version("seed_v{k}")')


def _crash(k: int, text: str, error: str) -> str:
    return f"crashed at seed_v{k}.py:{line_of(f'seed_v{k}', text)}: {error}"


FIND_UNUSED = "warning (reducer.cpp): find_unused_parameters=True was specified in DDP constructor"


def expected_lines(k: int, rank: int) -> list[str]:
    """What the deep dive says a 2-rank CPU run of ``seed_v{k}`` prints on ``rank``."""
    if k == 0:
        return [_crash(0, "class DistributedSampler(Sampler):",
                       "NameError: name 'Sampler' is not defined")]
    if k in (1, 2):
        nccl = _crash(k, 'dist.init_process_group(backend="nccl")', NO_NCCL)
        hidden = "warning (distributed_c10d.py): Attempted to get default timeout for nccl backend"
        return [nccl] if k == 1 else [hidden, nccl]
    local = [f"local rank {rank if k >= 7 else 0}, device cpu"]
    if k == 3:
        return local + [_crash(3, "args.lr", "AttributeError: 'Namespace' object has no "
                                             "attribute 'lr'")]
    if k == 4:
        return local + [_crash(4, "len(train_loader)", "TypeError: object of type "
                                                       "'DistributedSampler' has no len()")]
    steps = [f"{math.ceil(NUM_SAMPLES / WORLD / BATCH)} steps per epoch"]
    if k == 5:
        return local + steps + [f"epoch 0: samples {torch_order(rank, 0)}", FIND_UNUSED,
                                _crash(5, "loss = criterion(", "IndexError: Target 255 is out of "
                                                               "bounds.")]
    epochs = [f"epoch {e}: samples {torch_order(rank, e if k >= 8 else 0)}" for e in range(EPOCHS)]
    return local + steps + epochs + ([FIND_UNUSED] if k < 9 else []) + ["finished"]


@pytest.mark.parametrize("k", range(FINAL))
def test_each_versions_run_shows_its_defect_and_the_last_repair(k):
    run = StoredRun(NOTEBOOK, f'run_version("seed_v{k}")', _cell_source(k))
    assert sorted(run.ranks) == [0, 1] and run.other == []
    for rank in (0, 1):
        assert run.rank_lines(rank) == expected_lines(k, rank), (k, rank)


def test_step_2s_warning_is_the_cpu_builds_and_the_replay_leaves_it_out():
    """Only a build without NCCL warns about NCCL's default timeout (torch's source), so the
    stored line (a CPU build's run) is left out of nbval's comparison by one sanitize entry,
    which removes that line and nothing else."""
    import torch.distributed.distributed_c10d as c10d
    from nbval.plugin import get_sanitize_patterns

    src = inspect.getsource(c10d._get_default_timeout)
    assert "if not isinstance(default_pg_nccl_timeout, timedelta):" in src
    assert "Attempted to get default timeout for nccl backend" in src
    constants = inspect.getsource(importlib.import_module("torch.distributed.constants"))
    assert "default_pg_nccl_timeout = None" in constants   # where NCCL is not compiled
    root = Path(__file__).resolve().parents[2]
    patterns = get_sanitize_patterns((root / "tests" / "nbval_sanitize.cfg").read_text())
    run = StoredRun(NOTEBOOK, 'run_version("seed_v2")', _cell_source(2))
    for rank in (0, 1):
        text = "".join(f"[rank {rank}] {line}\n" for line in run.rank_lines(rank))
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        assert text == f"[rank {rank}] {expected_lines(2, rank)[1]}\n"


def test_the_runs_show_set_epoch_as_a_new_order_with_disjoint_shares():
    for k, same in ((6, True), (8, False)):
        run = StoredRun(NOTEBOOK, f'run_version("seed_v{k}")', _cell_source(k))
        orders = {r: [line for line in run.rank_lines(r) if line.startswith("epoch")]
                  for r in (0, 1)}
        for epoch in range(EPOCHS):
            shares = [json.loads(orders[r][epoch].split("samples ")[1]) for r in (0, 1)]
            assert sorted(shares[0] + shares[1]) == list(range(NUM_SAMPLES))
        assert all((o[0].split(": ")[1] == o[1].split(": ")[1]) == same for o in orders.values())


def test_the_padding_cell_on_three_ranks():
    source_ = ('%%torchrun --nproc-per-node 3 --backend gloo --quiet\nimport torch.distributed as '
               'dist\nfrom ddp_lesson.seedfix import print_shard\n\ndist.init_process_group('
               '"gloo")\nprint_shard("seed_v9", num_samples=1)\nprint_shard("seed_v10", '
               'num_samples=1)\ndist.barrier()  # no rank leaves while another is still '
               'joining (init has no barrier)\ndist.destroy_process_group()')
    run = StoredRun(NOTEBOOK, "print_shard(", source_)
    line = line_of("seed_v9", "assert len(indices) == self.total_size")
    for rank in range(3):
        assert run.rank_lines(rank) == [
            f"seed_v9: AssertionError at seed_v9.py:{line}: assert len(indices) == "
            "self.total_size",
            f"seed_v10: samples {torch_order(rank, 0, n=1, world=3)}"]
    assert torch_order(0, 0, n=1, world=3) == [0]


def test_the_deep_dive_prints_the_seed_whole_and_every_diff():
    assert stream_text(NOTEBOOK, 'print(source("seed_v0")') == source("seed_v0")
    for number in range(1, FINAL + 1):
        cell = cell_with(NOTEBOOK, f"print(step_diff({number})")
        assert cell.source == f'print(step_diff({number}), end="")'
        assert stream_text(NOTEBOOK, cell.source) == step_diff(number)
    shown = [c for c in code_cells(NOTEBOOK) if c.source.startswith("print(step_diff(")]
    assert len(shown) == FINAL


def test_the_deep_dives_kernel_cells():
    assert stream_text(NOTEBOOK, "print(as_printed_error())") == as_printed_error() + "\n"
    cell = cell_with(NOTEBOOK, 'run_version("seed_v3", ["--lr", "0.05"])')
    assert cell.source == 'ending = run_version("seed_v3", ["--lr", "0.05"])'
    outputs = cell.outputs
    stdout = "".join(o.text for o in outputs if o.get("name") == "stdout")
    stderr = "".join(o.text for o in outputs if o.get("name") == "stderr")
    assert stdout == "exited 2: seed_v3.py: error: unrecognized arguments: --lr 0.05\n"
    assert stderr.startswith("usage: seed_v3.py") and stderr.endswith("--lr 0.05\n")  # argparse's
    lines = stream_text(NOTEBOOK, "for step in STEPS:").splitlines()
    assert len(lines) == FINAL
    for step, line in zip(STEPS, lines):
        removed = sum(c.startswith("-") for c in changed_lines(step.number))
        added = sum(c.startswith("+") for c in changed_lines(step.number))
        assert line == f"step {step.number:2d}: -{removed} +{added}  {step.title}"


def test_the_prose_says_what_the_code_and_the_runs_show():
    cells = nbformat.read(NOTEBOOKS / NOTEBOOK, as_version=4).cells
    prose = " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == "markdown")
    assert f"Both ranks stop at line {line_of('seed_v0', 'class DistributedSampler')}," in prose
    per_rank = NUM_SAMPLES // WORLD
    assert (f"{NUM_SAMPLES} samples on {WORLD} ranks are {per_rank} each, "
            f"{per_rank // BATCH} steps of {BATCH}.") in prose
    assert "(default -100)" in prose and "there are 19 classes" in prose
    assert inspect.signature(torch.nn.CrossEntropyLoss).parameters["ignore_index"].default == -100
    assert "0.05, 0.9, 1e-4" in prose  # test_the_declared_defaults_are_the_trainers
    assert "(2 epochs, no DataLoader workers)" in prose
    v0 = source("seed_v0")
    assert 'add_argument("--epochs", default=2,' in v0 and '"--workers", default=0,' in v0
    assert "The explicit 60 s timeout" in prose and "timedelta(seconds=60)" in source("seed_v3")


# ----------------------------------------------------------------------------- direct runs

@pytest.fixture(scope="module")
def direct_runs():
    """The seed and the repaired program, each launched as itself on 2 ranks (no runner)."""
    from ddp_lesson.launch import run_torchrun_many

    jobs = {name: dict(target=f"ddp_lesson.seedfix.{name}", module=True, nproc_per_node=2,
                       timeout=180, check=False) for name in ("seed_v0", f"seed_v{FINAL}")}
    return run_torchrun_many(jobs, label="seed runs")


@pytest.mark.slow
def test_the_seed_fails_on_its_own_with_the_traceback(direct_runs):
    run = direct_runs["seed_v0"]
    assert run.returncode != 0
    for rank in (0, 1):
        assert "NameError: name 'Sampler' is not defined" in run.errors[rank]
        assert run.outputs[rank] == ""


@pytest.mark.slow
def test_the_repaired_program_runs_on_its_own_without_a_warning(direct_runs):
    run = direct_runs[f"seed_v{FINAL}"]
    assert run.returncode == 0, run.errors
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for rank in (0, 1):
        device = f"cuda:{rank}" if gpus >= 2 else "cpu"
        lines = expected_lines(FINAL, rank)[:-1]  # "finished" is the runner's
        lines[0] = f"local rank {rank}, device {device}"
        assert run.outputs[rank].splitlines() == lines
        assert "Warning" not in run.errors[rank], run.errors[rank]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_gpus_the_repaired_program_takes_a_gpu_per_rank():
    from ddp_lesson.launch import run_torchrun

    nproc = min(2, torch.cuda.device_count())
    run = run_torchrun(f"ddp_lesson.seedfix.seed_v{FINAL}", module=True, nproc_per_node=nproc,
                       timeout=240)
    for rank in range(nproc):
        assert run.outputs[rank].splitlines()[0] == f"local rank {rank}, device cuda:{rank}"
        assert "epoch 1: samples" in run.outputs[rank]
