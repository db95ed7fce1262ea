"""``python tools/gpucheck.py``, the GPU acceptance run, checked on any machine.

The pure pieces (the plan for a machine's facts, busbw, the README row, the junit and notebook
readers, the summary's judge) with fake device facts; the run loop with fake steps; and, as
processes, the command itself on this machine (on CPU: every GPU step skipped, the JSON file
written), a notebook executed into a scratch folder, the gpu test group's pytest call, the DDP
benchmark's step on gloo and a command cut at its timeout.
"""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpucheck as gc  # noqa: E402  (tools/gpucheck.py: a maintainer's program, not the package's)
from gpucheck import (  # noqa: E402
    NO_CUDA,
    STEPS,
    TIMEOUT_S,
    Context,
    Facts,
    Gpu,
    Planned,
    StepResult,
)

ROOT = Path(__file__).resolve().parents[2]
H100 = Gpu(0, "NVIDIA H100 80GB HBM3", 79.1, (9, 0))
T4 = Gpu(0, "Tesla T4", 14.6, (7, 5))
ROW = re.compile(r"^\| (?P<gpu>[^|]+) \| (?P<torch>[^|]+) \| (?P<date>\d{4}-\d\d-\d\d) "
                 r"\| (?P<result>[^|]+) \|$")


def facts(*gpus: Gpu, bf16: bool | None = None, **kw) -> Facts:
    """Fake facts: these GPUs (renumbered), bf16 native by compute capability unless given."""
    gpus = [Gpu(i, g.name, g.memory_gib, g.capability) for i, g in enumerate(gpus)]
    native = all(g.capability[0] >= 8 for g in gpus) if bf16 is None else bf16
    base = {"torch": "2.13.0+cu128", "cuda": "12.8" if gpus else None, "gpus": gpus,
            "nccl": "2.27.3" if gpus else None, "driver": "570.1" if gpus else None,
            "bf16_native": bool(gpus) and native, "bf16_source": "test",
            "p2p": {f"{i}->{j}": True for i in range(len(gpus)) for j in range(len(gpus))
                    if i != j}}
    return Facts(**{**base, **kw})


def by_name(planned):
    return {p.name: p for p in planned}


# ----------------------------------------------------------------------------- the plan


def test_the_step_limits_add_up_to_eight_minutes_at_most():
    # the steps' limits, and the last one's kill (SIGTERM, then SIGKILL) if it runs over
    assert sum(TIMEOUT_S.values()) + sum(gc.KILL_GRACE_S.values()) <= 8 * 60
    assert STEPS[0] == "environment" and set(STEPS) == set(gc.RUNNERS)


def test_without_cuda_every_gpu_step_is_skipped_with_the_reason():
    planned = gc.plan(facts())
    assert [p.name for p in planned] == list(STEPS)
    assert planned[0].run
    for p in planned[1:]:
        assert not p.run and p.reason == NO_CUDA, p
    assert gc.multi_gpu_not_run(facts()) == [f"every GPU check: {NO_CUDA}"]


def test_one_gpu_nccl_at_world_size_one_and_the_two_process_steps_on_gloo():
    plan = by_name(gc.plan(facts(H100)))
    for name in ("gpu-tests", "train-bf16", "train-fp16", "allreduce-busbw"):
        assert (plan[name].run, plan[name].nproc, plan[name].backend) == (True, 1, "nccl"), name
        assert plan[name].reason == ("1 process and 1 GPU: using nccl, one GPU per process "
                                     "(world size 1: no traffic between GPUs)"), name
    assert (plan["ddp-steps"].nproc, plan["ddp-steps"].backend) == (2, "gloo")
    assert plan["ddp-steps"].reason == "2 processes but 1 GPU: using gloo on CPU"
    assert plan["notebooks"].reason == ("cells of 2 processes but 1 GPU: using gloo on CPU; "
                                        "of 3 processes but 1 GPU: using gloo on CPU")
    not_run = gc.multi_gpu_not_run(facts(H100))
    assert len(not_run) == 6 and all("GPU" in line for line in not_run)


def test_two_and_four_gpus_run_everything_on_nccl():
    for n in (2, 4):
        plan = by_name(gc.plan(facts(*[H100] * n)))
        assert all(p.run for p in plan.values())
        assert {p.backend for name, p in plan.items() if name != "environment"} == {"nccl"}
        assert plan["allreduce-busbw"].nproc == n
        assert plan["train-fp16"].nproc == plan["ddp-steps"].nproc == 2
        assert plan["notebooks"].reason.startswith(
            "cells of 2 processes and 2 GPUs: using nccl" if n == 2 else
            "cells of 2 processes and 4 GPUs: using nccl, one GPU per process; "
            "of 3 processes and 4 GPUs: using nccl")
        assert gc.multi_gpu_not_run(facts(*[H100] * n)) == ([] if n > 2 else [
            "the notebooks' 3-process cells on NCCL (needs 3 GPUs; with fewer, gloo on CPU)"])


def test_cuda_that_cannot_be_read_fails_the_environment_and_skips_the_rest_with_why(tmp_path):
    broken = facts(error="RuntimeError: The NVIDIA driver on your system is too old")
    planned = gc.plan(broken)
    assert {p.reason for p in planned[1:]} == {
        "the GPUs could not be read: RuntimeError: The NVIDIA driver on your system is too old"}
    results = gc.run_steps(planned, broken, Context(tmp_path), say=lambda s: None)
    assert [r.status for r in results] == ["failed"] + ["skipped"] * (len(STEPS) - 1)
    assert results[0].reason.startswith("CUDA is available but RuntimeError: The NVIDIA driver")
    assert "the GPUs could not be read (RuntimeError" in gc.markdown_row(broken, results, "d")


def test_a_t4_skips_bf16_naming_its_compute_capability():
    plan = by_name(gc.plan(facts(T4, T4)))
    assert not plan["train-bf16"].run
    assert "no native bf16 on Tesla T4 (compute capability 7.5" in plan["train-bf16"].reason
    assert plan["train-fp16"].run


def test_no_checkout_no_pytest_and_no_nbconvert_are_reasons_to_skip():
    plan = by_name(gc.plan(facts(H100, H100, checkout=False)))
    for name in ("gpu-tests", "notebooks"):
        assert not plan[name].run and "without the checkout's tests" in plan[name].reason
    assert plan["train-fp16"].run
    plan = by_name(gc.plan(facts(H100, H100, nbconvert=False)))
    assert not plan["notebooks"].run and "nbconvert" in plan["notebooks"].reason
    assert plan["gpu-tests"].run
    plan = by_name(gc.plan(facts(H100, H100, pytest=False)))
    assert plan["gpu-tests"].reason == ("pytest, pytest-xdist or nbval is not installed "
                                        "(pip install -e '.[dev]')")
    assert plan["notebooks"].run


def test_skip_and_quick_leave_steps_out_and_a_wrong_name_is_refused():
    plan = by_name(gc.plan(facts(H100, H100), skip=["notebooks"], quick=True))
    assert plan["notebooks"].reason == "--skip notebooks"
    assert plan["gpu-tests"].reason == "--quick" and not plan["gpu-tests"].run
    assert plan["ddp-steps"].run
    with pytest.raises(ValueError, match=r"cannot skip notebook: the steps that can be skipped "
                       r"are gpu-tests, train-bf16, "):
        gc.plan(facts(), skip=["notebook"])
    with pytest.raises(ValueError, match=r"cannot skip environment: "):
        gc.plan(facts(), skip=["environment"])


# ----------------------------------------------------------------------------- the figures


def test_busbw_is_algbw_times_two_n_minus_one_over_n():
    rows = [{"nprocs": n, "size_bytes": 2**28, "seconds": 0.01} for n in (1, 2, 4, 8)]
    figs = gc.bandwidth_figures(rows)
    algbw = 2**28 / 0.01 / 1e9  # 26.8435456 GB/s
    assert [f["algbw_GBps"] for f in figs] == [round(algbw, 3)] * 4
    # nccl-tests' factor 2(n-1)/n: 0, 1, 1.5, 1.75
    assert [f["busbw_GBps"] for f in figs] == [0.0, 26.844, 40.265, 46.976]


def test_the_bench_rows_busbw_uses_the_same_factor_for_the_nccl_method():
    from ddp_lesson.bench.allreduce import summarise

    row = summarise(4, "nccl", 2**20, [0.002, 0.001, 0.004], iters=1)
    assert row["seconds"] == 0.002
    assert row["busbw_GBps"] == pytest.approx(2**20 / 0.002 / 1e9 * 1.5)


def test_the_bench_refuses_a_method_the_jobs_backend_cannot_run(capsys):
    from ddp_lesson.bench.allreduce import check_methods
    from ddp_lesson.cli import main

    assert check_methods(["nccl"], "nccl") == ["nccl"]
    with pytest.raises(ValueError, match="runs the method nccl only, not gloo, ring"):
        check_methods(["nccl", "gloo", "ring"], "nccl")
    # refused before any process starts (this test is not slow: the guard would fail it)
    assert main(["bench", "allreduce", "--nprocs", "2", "--methods", "nccl",
                 "--backend", "gloo", "--out", "unused.csv"]) == 2
    assert "the method nccl needs --backend nccl; this job runs gloo" in capsys.readouterr().err


def test_the_ddp_bench_passes_no_link_to_its_worker():
    from ddp_lesson.bench.ddp import VARIANTS, _worker_parser, variants, worker_argv
    from ddp_lesson.cli import _parser

    opts = _parser().parse_args(["bench", "ddp", "--no-link"])
    args = worker_argv(opts)
    assert args[-1] == "--no-link" and _worker_parser().parse_args(args[1:]).no_link
    assert "--no-link" not in worker_argv(_parser().parse_args(["bench", "ddp"]))
    assert variants(True) == (("torch", False), ("bucketed", False), ("naive", False))
    assert variants(False) == VARIANTS


def test_junit_counts_reads_pytests_report():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.gpu.test_gpu" name="test_a"/>
      <testcase classname="tests.gpu.test_gpu" name="test_b"><skipped message="no CUDA"/></testcase>
      <testcase classname="tests.gpu.test_gpu" name="test_c"><failure message="x"/></testcase>
      <testcase classname="tests.convert.test_convert" name="test_d"><error message="y"/></testcase>
    </testsuite></testsuites>"""
    assert gc.junit_counts(xml) == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
        "failed_tests": ["tests.gpu.test_gpu::test_c", "tests.convert.test_convert::test_d"]}


def test_notebook_errors_name_the_cell_index_and_the_errors_last_line():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "x"},
        {"cell_type": "code", "outputs": [{"output_type": "stream", "text": "ok"}]},
        {"cell_type": "code", "outputs": [{"output_type": "error", "ename": "TorchrunError",
                                           "evalue": "rank 1 failed\nNCCL error: unhandled"}]},
    ]}
    assert gc.notebook_errors(nb, "04.ipynb") == [
        {"notebook": "04.ipynb", "cell": 2, "error": "NCCL error: unhandled"}]


def test_the_summarys_judge_wants_cuda_the_planned_backend_and_a_finite_loss():
    p = Planned("train-fp16", True, "", 2, "nccl", 40)
    good = {"device": "cuda", "backend": "nccl", "world_size": 2, "global_step": 4,
            "diverged": False}
    assert gc.judge_summary(good, p) is None
    assert gc.judge_summary({**good, "device": "cpu"}, p) == \
        "summary.json has device 'cpu', expected 'cuda'"
    assert gc.judge_summary({**good, "world_size": 1}, p) == \
        "summary.json has world_size 1, expected 2"
    assert "diverged" in gc.judge_summary({**good, "diverged": True}, p)
    assert "no optimizer step" in gc.judge_summary({**good, "global_step": 0}, p)


# ----------------------------------------------------------------------------- the row, the run


def test_detail_lines_name_each_error_each_size_and_each_variant():
    figures = {
        "errors": [{"notebook": "04.ipynb", "cell": 5, "error": "RuntimeError: Tensors must be "
                    "CUDA and dense"}],
        "sizes": gc.bandwidth_figures([{"nprocs": 2, "size_bytes": 2**24, "seconds": 0.001}]),
        "variants": [{"variant": "bucketed", "steps_per_s": 12.345, "steps_per_s_min": 11.0,
                      "steps_per_s_max": 13.0, "ratio_to_torch": 0.98}]}
    assert gc.detail_lines(StepResult("x", "failed", "", figures)) == [
        "  04.ipynb cell 5: RuntimeError: Tensors must be CUDA and dense",
        "  16 MiB, 2 ranks: algbw 16.777 GB/s, busbw 16.777 GB/s",
        "  bucketed: 12.3 steps/s (min 11, max 13), /torch 0.98"]
    assert gc.detail_lines(StepResult("environment", "passed", "", {"gpu_count": 0})) == []



def test_the_row_has_the_readmes_four_cells():
    results = [StepResult("environment", "passed", ""), StepResult("train-bf16", "skipped",
               "no native bf16 on Tesla T4"), StepResult("notebooks", "failed", "1 error")]
    row = gc.markdown_row(facts(T4, T4), results, "2026-12-06")
    m = ROW.match(row)
    assert m, row
    assert m["gpu"] == "2× Tesla T4 (14.6 GiB, sm 7.5); CUDA 12.8, NCCL 2.27.3, driver 570.1"
    assert m["torch"] == "2.13.0+cu128" and m["date"] == "2026-12-06"
    assert m["result"] == ("gpucheck: 1 passed, 1 failed, 1 skipped; failed: notebooks; "
                           "skipped: train-bf16 (no native bf16 on Tesla T4)")
    one = gc.markdown_row(facts(H100), results[:1], "2026-12-06")
    assert one.endswith("; multi-GPU checks not run (one GPU) |")
    assert gc._cell("a | b\nc") == "a \\| b c"


def test_a_failing_or_raising_step_does_not_stop_the_others_and_the_exit_status_is_1(
        tmp_path, monkeypatch, capsys):
    ran = []

    def fine(p, f, ctx):
        ran.append(p.name)
        return StepResult(p.name, "passed", "ok", {"x": 1})

    def boom(p, f, ctx):
        ran.append(p.name)
        raise RuntimeError("CUDA error: out of memory")

    runners = {name: fine for name in STEPS} | {"train-fp16": boom}
    monkeypatch.setattr(gc, "gather_facts", lambda: facts(H100, H100))
    monkeypatch.setattr(gc, "RUNNERS", runners)
    assert gc.main(["--out", str(tmp_path)]) == 1
    assert ran == list(STEPS)
    data = json.loads((tmp_path / "gpucheck.json").read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert steps["train-fp16"] == {"name": "train-fp16", "status": "failed", "reason":
                                   "RuntimeError: CUDA error: out of memory", "figures": {},
                                   "seconds": steps["train-fp16"]["seconds"]}
    assert data["failed"] == ["train-fp16"] and steps["ddp-steps"]["status"] == "passed"
    out = capsys.readouterr().out
    assert "peer access 0->1: True" in out and data["row"] in out.splitlines()


def test_a_step_gets_its_limit_plus_what_the_steps_before_it_left():
    now = [0.0]
    limits = {}

    def step(p, f, ctx):
        limits[p.name] = p.timeout_s
        now[0] += {"environment": 5, "train-fp16": 100}.get(p.name, 10)  # seconds it "took"
        return StepResult(p.name, "passed", "")

    planned = gc.plan(facts(H100, H100), skip=["gpu-tests"])
    gc.run_steps(planned, facts(), Context(Path(".")), {n: step for n in STEPS},
                 say=lambda s: None, clock=lambda: now[0])
    T = TIMEOUT_S
    assert limits["environment"] == T["environment"]
    # gpu-tests skipped: train-bf16 may use its limit and gpu-tests', less what environment took
    assert limits["train-bf16"] == T["environment"] + T["gpu-tests"] + T["train-bf16"] - 5
    # train-fp16 took 100 s, past its own 40: the notebooks get what is left of the sum
    used = 5 + 10 + 100
    assert limits["notebooks"] == sum(T[n] for n in STEPS[:5]) - used
    assert limits["ddp-steps"] == sum(T.values()) - used - 20


def test_bad_arguments_exit_2_naming_the_value(monkeypatch, capsys):
    monkeypatch.setattr(gc, "gather_facts", lambda: facts())
    assert gc.main(["--skip", "nope"]) == 2
    assert "cannot skip nope: the steps that can be skipped are gpu-tests, train-bf16" in \
        capsys.readouterr().err
    assert gc.main(["--parallel", "0"]) == 2
    assert "--parallel must be >= 1, got 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_on_cpu_the_command_skips_every_gpu_step_and_writes_the_json(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools/gpucheck.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "gpucheck.json").read_text())
    assert set(data) == {"command", "date", "facts", "multi_gpu_not_run", "plan", "steps",
                         "failed", "row"}
    assert [s["name"] for s in data["steps"]] == list(STEPS)
    for step in data["steps"]:
        assert set(step) == {"name", "status", "reason", "figures", "seconds"}
        assert step["status"] in gc.STATUSES
        assert step["status"] == ("passed" if step["name"] == "environment" else "skipped")
        if step["status"] == "skipped":
            assert step["reason"] == NO_CUDA
    assert data["facts"]["gpus"] == [] and data["facts"]["torch"] == torch.__version__
    assert data["failed"] == []
    m = ROW.match(data["row"])
    assert m and m["gpu"] == "none (no CUDA device)" and m["torch"] == torch.__version__
    assert "no CUDA device, every GPU step skipped" in m["result"]
    assert proc.stdout.splitlines()[-1] == data["row"]


@pytest.mark.slow
def test_a_notebook_is_executed_into_the_scratch_folder_and_its_errors_named(tmp_path):
    import nbformat

    book = tmp_path / "books" / "t.ipynb"
    book.parent.mkdir()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("print(1)"),
        nbformat.v4.new_code_cell("1 / 0"), nbformat.v4.new_code_cell("print(2)")])
    nbformat.write(nb, book)
    stored = book.read_bytes()
    errors = gc._execute_notebook(book, tmp_path / "scratch", time.monotonic() + 120)
    assert errors == [{"notebook": "t.ipynb", "cell": 2,
                       "error": "ZeroDivisionError: division by zero"}]
    assert book.read_bytes() == stored
    ran = nbformat.read(tmp_path / "scratch" / "t.ipynb", as_version=4)
    # the cells after the error ran too; ipykernel may send "2" and "\n" as two stream messages
    # (its flush timer can fall between the two writes of print), and nbclient keeps them apart
    assert "".join(o.get("text", "") for o in ran.cells[3].outputs) == "2\n"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the call without a CUDA device")
def test_the_gpu_test_step_runs_pytests_gpu_group_and_counts_it(tmp_path):
    p = Planned("gpu-tests", True, "", 2, "gloo", 240)
    result = gc.step_gpu_tests(p, facts(), Context(tmp_path))
    # on CPU every test of the group skips: the step says so rather than passing
    assert result.status == "failed" and result.figures["passed"] == 0
    assert result.figures["skipped"] >= 10 and result.figures["failed_tests"] == []
    assert result.reason == f"no gpu test passed ({result.figures['skipped']} skipped)"


@pytest.mark.slow
def test_the_ddp_step_times_bucketed_against_torch_without_the_link_on_gloo(tmp_path):
    p = Planned("ddp-steps", True, "2 processes but 1 GPU: using gloo on CPU", 2, "gloo", 240)
    result = gc.step_ddp_steps(p, facts(), Context(tmp_path))
    assert result.status == "passed", result.reason
    assert [r["variant"] for r in result.figures["variants"]] == ["torch", "bucketed", "naive"]
    assert result.reason.startswith("BucketedDDP/torch DDP steps/s ")
    assert result.reason.endswith("; 2 processes but 1 GPU: using gloo on CPU")


@pytest.mark.slow
def test_a_command_past_its_timeout_is_ended_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(c.pid)); "
            f"time.sleep(60)")
    t0 = time.monotonic()
    assert gc.run_command([sys.executable, "-c", code], 3, tmp_path / "log") is None
    assert time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    from ddp_lesson.procs import alive

    for _ in range(50):  # the SIGTERM has reached it; let it finish dying
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)


def test_the_readmes_tested_on_table_has_the_rows_shape_and_names_the_command():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Tested on"):text.index("## Layout")]
    assert "python tools/gpucheck.py" in section
    lines = section.splitlines()
    start = lines.index("| GPU | torch | date | result |")
    table = list(itertools.takewhile(lambda ln: ln.startswith("|"), lines[start:]))
    assert table[:2] == ["| GPU | torch | date | result |", "|---|---|---|---|"]
    assert table[2:], "the table has no row"
    for row in table[2:]:
        assert ROW.match(row), row
    # the row the command writes for this machine fits the same table
    assert ROW.match(gc.markdown_row(facts(), [StepResult("environment", "passed", "")],
                                     "2026-12-06"))


def test_docs_gpus_states_the_step_limits_the_module_has():
    text = (ROOT / "docs/gpus.md").read_text()
    section = text[text.index("## The acceptance run"):]
    limits = ", ".join(str(TIMEOUT_S[name]) for name in STEPS)
    prose = " ".join(section.split())
    assert f"add up to {sum(TIMEOUT_S.values())} s ({limits} in the order above)" in prose
    for name in STEPS:
        assert f"| `{name}` |" in section, name


@pytest.mark.slow
def test_the_training_steps_command_runs_the_trainer_and_its_judge_reads_the_summary(tmp_path):
    # on gloo (any machine): the trainer accepts every flag and writes summary.json, and the
    # judge fails the run for what it is, a CPU run
    p = Planned("train-fp16", True, "", 1, "gloo", 240)
    result = gc.step_train_fp16(p, facts(), Context(tmp_path))
    assert result.reason == "summary.json has device 'cpu', expected 'cuda'"
    assert result.status == "failed"
    figs = result.figures
    assert (figs["world_size"], figs["backend"], figs["global_step"]) == (1, "gloo", 8)
    assert figs["diverged"] is False and figs["amp_scale"] == 65536.0
    assert (tmp_path / "train-fp16" / "summary.json").is_file()


@pytest.mark.slow
def test_the_bandwidth_steps_command_reaches_the_bench_which_wants_nccl(tmp_path):
    p = Planned("allreduce-busbw", True, "", 2, "gloo", 120)
    result = gc.step_allreduce_busbw(p, facts(), Context(tmp_path))
    assert result.status == "failed"
    assert result.reason == ("exit status 2: ddp-lesson bench allreduce: error: the method nccl "
                             "needs --backend nccl; this job runs gloo")
