"""The GPU acceptance run: one command a maintainer runs on a GPU machine, unedited.

    python tools/gpucheck.py                       # every step, at most 8 minutes
    python tools/gpucheck.py --quick               # without the gpu tests and the notebooks
    python tools/gpucheck.py --skip notebooks --out runs/gpucheck

It prints what it found (GPUs with name, memory, compute capability; torch, CUDA, NCCL, cuDNN,
the driver from ``nvidia-smi``; native bfloat16; peer-to-peer access between GPU pairs), then
runs these steps, each in a subprocess with its own limit (:data:`TIMEOUT_S`, 460 s in all; what a
step leaves of its limit goes to the steps after it, :func:`run_steps`):

==================  ==============================================================================
``environment``     the facts above, as figures
``gpu-tests``       ``pytest -m gpu -n 0 tests/gpu tests/convert`` in the checkout (skipped, with
                    the reason, where the package is installed without its tests)
``train-bf16``      ``ddp-lesson train --amp bf16`` for one epoch on a small synthetic set, on
                    min(2, GPUs) processes (NCCL); skipped where the GPU lacks native bfloat16
``train-fp16``      the same with ``--amp fp16`` (a GradScaler per process)
``notebooks``       every core notebook executed (not replayed) with ``nbconvert --execute`` into
                    ``OUT/notebooks/``, never over the stored files; each cell that raised is named
``allreduce-busbw`` NCCL all-reduce at world size = GPUs, 1 to 256 MiB, by ``ddp-lesson bench
                    allreduce --methods nccl``: algbw and busbw = algbw x 2(n-1)/n
                    (nccl-tests, doc/PERFORMANCE.md; :func:`ddp_lesson.cost_model.bus_factor`)
``ddp-steps``       steps/s of BucketedDDP against torch's DDP on the series' model, by
                    ``ddp-lesson bench ddp --no-link`` on 2 processes
==================  ==============================================================================

The 2-process steps follow the series' backend rule (:func:`ddp_lesson.env.choose_backend`):
with one GPU they run on gloo on CPU and say so; the training runs use min(2, GPUs) processes, so
one GPU runs NCCL at world size 1. What a single GPU cannot check is listed under
``multi_gpu_not_run``. A failing step never stops the others.

Writes ``OUT/gpucheck.json`` (the facts; per step: name, status ``passed|failed|skipped``,
reason, figures, seconds; the Markdown row) and prints the row for the README's "Tested on"
table. Exit status 1 when a step failed, 2 on bad arguments, else 0 (skipped steps are no
failure). Without a CUDA device every GPU step is skipped with the reason "no CUDA device".
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ddp_lesson.env import choose_backend

#: Each step's limit in seconds, in the order the steps run; the sum is the whole run's bound.
TIMEOUT_S = {"environment": 20, "gpu-tests": 120, "train-bf16": 40, "train-fp16": 40,
             "notebooks": 165, "allreduce-busbw": 30, "ddp-steps": 45}
#: What ending a command at its limit may add: SIGTERM, then SIGKILL (see :func:`run_command`).
KILL_GRACE_S = {"SIGTERM": 10, "SIGKILL": 5}
STEPS = tuple(TIMEOUT_S)
#: The steps ``--quick`` leaves out (the two longest).
QUICK_SKIPS = ("gpu-tests", "notebooks")
STATUSES = ("passed", "failed", "skipped")
#: The trainer's flags for a small run: one epoch of 32 synthetic 32x64 images, width 8.
TRAIN_SMALL = ("--size", "32", "64", "--width", "8", "--num-train", "32", "--num-val", "8",
               "-b", "4", "--epochs", "1", "--no-resume")
#: All-reduce sizes (KiB) for the bandwidth step: 1, 16 and 256 MiB.
BUSBW_SIZES_KIB = (1024, 16384, 262144)
ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: ``memory_gib`` is total memory in GiB, ``capability`` (major, minor)."""

    index: int
    name: str
    memory_gib: float
    capability: tuple[int, int]


@dataclass
class Facts:
    """What this machine has. ``p2p`` maps ``"i->j"`` to ``can_device_access_peer(i, j)``;
    ``error`` says why CUDA, though available, could not be read (then ``gpus`` is empty)."""

    torch: str
    cuda: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    nccl: str | None = None
    cudnn: int | None = None
    driver: str | None = None
    bf16_native: bool = False
    bf16_source: str = ""
    p2p: dict[str, bool] = field(default_factory=dict)
    error: str | None = None
    checkout: bool = True
    pytest: bool = True
    nbconvert: bool = True


@dataclass(frozen=True)
class Planned:
    """A step as planned: run it (``reason`` says on what) or skip it (``reason`` says why)."""

    name: str
    run: bool
    reason: str
    nproc: int = 0
    backend: str = ""
    timeout_s: float = 0.0


@dataclass
class StepResult:
    """One step's outcome, as written to the JSON file."""

    name: str
    status: str
    reason: str
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


# ----------------------------------------------------------------------------- the facts


def _cuda_facts(torch) -> dict:
    """Everything torch says about the GPUs; only called where CUDA is available."""
    count = torch.cuda.device_count()
    gpus = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, p.name, round(p.total_memory / 2**30, 1), (p.major, p.minor)))
    try:  # a tuple (major, minor, patch[, suffix]): torch/cuda/nccl.py, version()
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # a build without NCCL
        nccl = f"unknown ({type(exc).__name__})"
    # torch/cuda/__init__.py, is_bf16_supported: compute capability >= 8 is native; without
    # including_emulation=False it also answers True where a bf16 tensor can merely be created
    # (it asks the current device, cuda:0: the capability rule covers the others)
    bf16 = all(g.capability[0] >= 8 for g in gpus)
    source = "compute capability >= 8 on every GPU (torch's rule in is_bf16_supported)"
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        bf16 = bf16 and bool(torch.cuda.is_bf16_supported(including_emulation=False))
        source = "torch.cuda.is_bf16_supported(including_emulation=False), every GPU sm >= 8"
    p2p = {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
           for i in range(count) for j in range(count) if i != j}
    return {"gpus": gpus, "nccl": nccl, "cudnn": torch.backends.cudnn.version(),
            "bf16_native": bf16, "bf16_source": source, "p2p": p2p}


def _driver() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi``, or None where it is missing."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown (nvidia-smi: {type(exc).__name__})"
    return out.strip().splitlines()[0] if out.strip() else None


def gather_facts() -> Facts:
    """This machine's facts (CUDA initialised in this process; no process group)."""
    import importlib.util

    import torch

    facts = Facts(torch=torch.__version__, cuda=torch.version.cuda,
                  checkout=(ROOT / "tests/gpu/test_gpu.py").is_file()
                  and (ROOT / "notebooks").is_dir(),
                  pytest=all(importlib.util.find_spec(m) is not None
                             for m in ("pytest", "xdist", "nbval")),
                  nbconvert=importlib.util.find_spec("nbconvert") is not None)
    if torch.cuda.is_available():
        try:  # a driver too old for this build fails here, not in a step
            for key, value in _cuda_facts(torch).items():
                setattr(facts, key, value)
        except Exception as exc:
            facts.gpus, facts.error = [], f"{type(exc).__name__}: {exc}"[:200]
        facts.driver = _driver()
    return facts


def fact_lines(facts: Facts) -> list[str]:
    """The facts as short lines, one fact each."""
    lines = [f"torch {facts.torch}, CUDA {facts.cuda or 'none (CPU build)'}"]
    if facts.error:
        return [*lines, f"GPUs: could not be read: {facts.error}"]
    if not facts.gpus:
        return [*lines, f"GPUs: none: {NO_CUDA}"]
    lines.append(f"GPUs: {len(facts.gpus)}")
    lines += [f"  cuda:{g.index} {g.name}, {g.memory_gib:g} GiB, compute capability "
              f"{g.capability[0]}.{g.capability[1]}" for g in facts.gpus]
    lines += [f"NCCL {facts.nccl}", f"cuDNN {facts.cudnn}",
              f"driver {facts.driver or 'unknown (no nvidia-smi)'}",
              f"bf16 native: {facts.bf16_native} ({facts.bf16_source})"]
    if facts.p2p:
        lines += [f"peer access {pair}: {ok}" for pair, ok in facts.p2p.items()]
    else:
        lines.append("peer access: not applicable (one GPU)")
    return lines


# ----------------------------------------------------------------------------- the plan


def _plan_one(name: str, facts: Facts) -> Planned:
    """Whether ``name`` can run here, on how many processes and which backend."""
    gpus = len(facts.gpus)
    t = TIMEOUT_S[name]
    if name == "environment":
        return Planned(name, True, "facts gathered in this process", timeout_s=t)
    if not gpus:
        return Planned(name, False, f"the GPUs could not be read: {facts.error}"
                       if facts.error else NO_CUDA)
    if name in ("gpu-tests", "notebooks") and not facts.checkout:
        return Planned(name, False, "the package is installed without the checkout's tests "
                       "and notebooks: run it from a clone of the repository")
    if name == "gpu-tests" and not facts.pytest:
        return Planned(name, False, "pytest, pytest-xdist or nbval is not installed "
                       "(pip install -e '.[dev]')")
    if name == "notebooks" and not facts.nbconvert:
        return Planned(name, False, "nbconvert is not installed (pip install -e '.[dev]')")
    if name == "train-bf16" and not facts.bf16_native:
        return Planned(name, False, f"no native bf16 on {facts.gpus[0].name} (compute "
                       f"capability {'.'.join(map(str, facts.gpus[0].capability))}; "
                       f"{facts.bf16_source} is False)")
    if name == "notebooks":  # their cells start 2 or 3 processes, each by the rule
        (backend, why2), (_, why3) = (choose_backend(n, "auto", gpus) for n in (2, 3))
        return Planned(name, True, f"cells of {why2}; of {why3}", 2, backend, t)
    # the gpu tests and the training runs: min(2, GPUs) processes, NCCL, as tests/gpu does
    nproc = {"allreduce-busbw": gpus, "ddp-steps": 2}.get(name, min(2, gpus))
    backend, why = choose_backend(nproc, "auto", gpus)
    if backend == "nccl" and nproc == 1:
        why += " (world size 1: no traffic between GPUs)"
    return Planned(name, True, why, nproc, backend, t)


def plan(facts: Facts, skip=(), quick: bool = False) -> list[Planned]:
    """Every step of :data:`STEPS`, planned for ``facts``; ``skip`` and ``quick`` leave steps
    out with that reason. Raises ValueError for a name in ``skip`` that is not a step after
    ``environment``."""
    unknown = sorted(set(skip) - set(STEPS[1:]))  # the facts are always gathered
    if unknown:
        raise ValueError(f"cannot skip {', '.join(unknown)}: the steps that can be skipped are "
                         f"{', '.join(STEPS[1:])}")
    out = []
    for name in STEPS:
        if name in skip:
            out.append(Planned(name, False, f"--skip {name}"))
        elif quick and name in QUICK_SKIPS:
            out.append(Planned(name, False, "--quick"))
        else:
            out.append(_plan_one(name, facts))
    return out


def multi_gpu_not_run(facts: Facts) -> list[str]:
    """The checks this machine cannot make: all of them without a GPU, those that need 2 GPUs
    or more with one, the notebooks' 3-process cells on NCCL with two."""
    if not facts.gpus:
        return [f"every GPU check: {facts.error or NO_CUDA}"]
    if len(facts.gpus) >= 3:
        return []
    three = "the notebooks' 3-process cells on NCCL (needs 3 GPUs; with fewer, gloo on CPU)"
    if len(facts.gpus) == 2:
        return [three]
    return ["NCCL all-reduce between 2 GPUs and its bus bandwidth (needs 2 GPUs)",
            "BucketedDDP vs torch's DDP on NCCL (needs 2 GPUs; with one, gloo on CPU)",
            "peer-to-peer access between GPUs (needs 2 GPUs)",
            "the notebooks' 2-process cells on NCCL (with one GPU: gloo on CPU, the rule)",
            "the gpu tests' 2-rank NCCL cases (they run at world size min(2, GPUs))", three]


# ----------------------------------------------------------------------------- running commands


def run_command(cmd: list[str], timeout_s: float, log: Path, cwd: Path | None = None,
                env: dict | None = None) -> int | None:
    """Run ``cmd`` with stdout and stderr into ``log``; its exit status, None at the timeout.

    At the timeout the command's process group gets SIGTERM (torchrun then stops its workers,
    which sit in sessions of their own), and SIGKILL 10 s later if it is still there.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, KILL_GRACE_S["SIGTERM"]),
                               (signal.SIGKILL, KILL_GRACE_S["SIGKILL"])):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None


def last_line(log: Path) -> str:
    """The log's last non-empty line, at most 100 characters."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:100] if lines else "(no output)"


def _failed_run(rc: int | None, p: Planned, log: Path) -> str:
    if rc is None:
        return f"timed out after {p.timeout_s:g} s (log: {log.name})"
    return f"exit status {rc}: {last_line(log)}"


# ----------------------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Context:
    """Where a step writes (``out``) and the checkout it runs from (``root``)."""

    out: Path
    root: Path = ROOT
    parallel: int = 3


def step_environment(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """The facts, as figures."""
    figures = asdict(facts)
    figures["gpu_count"] = len(facts.gpus)
    if facts.error:
        return StepResult(p.name, "failed", f"CUDA is available but {facts.error}", figures)
    return StepResult(p.name, "passed", p.reason, figures)


def junit_counts(xml_text: str) -> dict:
    """Counts from pytest's ``--junitxml`` report: passed, failed, errors, skipped, and the
    failed tests' names (``file::name``)."""
    root = ET.fromstring(xml_text)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": []}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            counts["failed_tests"].append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def step_gpu_tests(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """``pytest -m gpu -n 0 tests/gpu tests/convert`` in the checkout, counted from its junit."""
    report, log = ctx.out / "gpu-tests.xml", ctx.out / "gpu-tests.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "tests/gpu", "tests/convert",
           "-q", f"--junitxml={report}"]
    rc = run_command(cmd, p.timeout_s, log, cwd=ctx.root)
    if rc is None or not report.is_file():
        return StepResult(p.name, "failed", _failed_run(rc, p, log))
    counts = junit_counts(report.read_text())
    bad = counts["failed"] + counts["errors"]
    if bad or rc != 0:
        names = ", ".join(counts["failed_tests"][:3]) or last_line(log)
        return StepResult(p.name, "failed", f"{bad} failed (exit status {rc}): {names}", counts)
    if counts["passed"] == 0:
        return StepResult(p.name, "failed", f"no gpu test passed ({counts['skipped']} skipped)",
                          counts)
    return StepResult(p.name, "passed", f"{counts['passed']} passed, {counts['skipped']} "
                      f"skipped; {p.reason}", counts)


#: The summary.json fields a training step records.
SUMMARY_FIELDS = ("world_size", "backend", "device", "global_step", "final_train_loss",
                  "diverged", "val_miou", "amp_scale", "samples_per_s", "wall_s")


def judge_summary(summary: dict, planned: Planned) -> str | None:
    """What is wrong with a training run's summary, or None: it ran on CUDA with the planned
    backend and world size, took a step and did not diverge."""
    want = {"device": "cuda", "backend": planned.backend, "world_size": planned.nproc}
    for key, value in want.items():
        if summary.get(key) != value:
            return f"summary.json has {key} {summary.get(key)!r}, expected {value!r}"
    if not summary.get("global_step"):
        return "summary.json records no optimizer step"
    if summary.get("diverged"):
        return "the loss is not finite (diverged)"
    return None


def _train(p: Planned, ctx: Context, amp: str) -> StepResult:
    out, log = ctx.out / p.name, ctx.out / f"{p.name}.log"
    cmd = [sys.executable, "-m", "ddp_lesson.cli", "train", "--nproc-per-node", str(p.nproc),
           "--backend", p.backend, "--amp", amp, "--out", str(out), *TRAIN_SMALL]
    rc = run_command(cmd, p.timeout_s, log, cwd=ctx.root)
    path = out / "summary.json"
    if rc != 0 or not path.is_file():
        return StepResult(p.name, "failed", _failed_run(rc, p, log))
    summary = json.loads(path.read_text())
    figures = {k: summary.get(k) for k in SUMMARY_FIELDS}
    figures["skipped_steps"] = len(summary.get("skipped_steps") or [])
    problem = judge_summary(summary, p)
    return StepResult(p.name, "failed" if problem else "passed", problem or p.reason, figures)


def step_train_bf16(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """``ddp-lesson train --amp bf16``, one small epoch; its summary.json's figures."""
    return _train(p, ctx, "bf16")


def step_train_fp16(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """``ddp-lesson train --amp fp16``, one small epoch; its summary.json's figures."""
    return _train(p, ctx, "fp16")


def notebook_errors(nb: dict, name: str) -> list[dict]:
    """Each code cell of an executed notebook (nbformat 4, as JSON) that raised: the notebook,
    the cell's index among all cells (0-based) and the error's last line."""
    errors = []
    for index, cell in enumerate(nb.get("cells", [])):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            if output.get("output_type") == "error":
                text = f"{output.get('ename', '')}: {output.get('evalue', '')}".strip()
                errors.append({"notebook": name, "cell": index,
                               "error": text.splitlines()[-1][:100]})
    return errors


def _execute_notebook(path: Path, scratch: Path, deadline: float) -> list[dict]:
    """Execute one notebook into ``scratch`` (its cells' errors kept, not fatal)."""
    target, log = scratch / f"{path.stem}.ipynb", scratch / f"{path.stem}.log"
    if deadline - time.monotonic() < 5:
        return [{"notebook": path.name, "cell": None, "error": "not started: the step's limit "
                 "was reached"}]
    cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", str(path),
           "--output-dir", str(scratch), "--output", path.stem,
           "--ExecutePreprocessor.allow_errors=True", "--ExecutePreprocessor.timeout=300",
           "--ExecutePreprocessor.kernel_name=python3"]
    rc = run_command(cmd, deadline - time.monotonic(), log, cwd=path.parent)
    if rc is None:
        return [{"notebook": path.name, "cell": None, "error": "timed out (step's limit)"}]
    if rc != 0 or not target.is_file():
        return [{"notebook": path.name, "cell": None, "error": f"nbconvert exit status {rc}: "
                 + last_line(log)}]
    return notebook_errors(json.loads(target.read_text()), path.name)


def step_notebooks(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """Every core notebook executed into ``OUT/notebooks/`` (the stored files untouched),
    ``ctx.parallel`` at a time; each cell that raised is reported."""
    books = sorted((ctx.root / "notebooks").glob("*.ipynb"))
    scratch = ctx.out / "notebooks"
    scratch.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + p.timeout_s
    with concurrent.futures.ThreadPoolExecutor(max(1, ctx.parallel)) as pool:
        found = list(pool.map(lambda b: _execute_notebook(b, scratch, deadline), books))
    errors = [e for per_book in found for e in per_book]
    figures = {"notebooks": [b.name for b in books], "errors": errors}
    if errors:
        first = errors[0]
        return StepResult(p.name, "failed", f"{len(errors)} error(s); first: {first['notebook']}"
                          f" cell {first['cell']}: {first['error']}", figures)
    return StepResult(p.name, "passed", f"{len(books)} notebooks, no cell raised; {p.reason}",
                      figures)


def bandwidth_figures(rows: list[dict]) -> list[dict]:
    """The all-reduce rows of ``ddp-lesson bench allreduce`` as figures: size, median time,
    algbw and busbw in GB/s (1 GB = 1e9 bytes), busbw = algbw x 2(n-1)/n (nccl-tests,
    doc/PERFORMANCE.md): 0 at world size 1, where no byte crosses a link."""
    from ddp_lesson.cost_model import bus_factor

    out = []
    for r in sorted(rows, key=lambda r: r["size_bytes"]):
        algbw = r["size_bytes"] / r["seconds"] / 1e9
        out.append({"nprocs": r["nprocs"], "size_bytes": r["size_bytes"],
                    "seconds": r["seconds"], "algbw_GBps": round(algbw, 3),
                    "busbw_GBps": round(algbw * bus_factor(r["nprocs"]), 3)})
    return out


def step_allreduce_busbw(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """NCCL all-reduce bandwidth at world size = GPUs, by ``ddp-lesson bench allreduce``."""
    from ddp_lesson.bench.allreduce import read_results

    csv, log = ctx.out / "allreduce.csv", ctx.out / "allreduce-busbw.log"
    cmd = [sys.executable, "-m", "ddp_lesson.cli", "bench", "allreduce", "--nprocs",
           str(p.nproc), "--methods", "nccl", "--backend", p.backend, "--sizes-kib",
           ",".join(map(str, BUSBW_SIZES_KIB)), "--repeats", "3", "--out", str(csv),
           "--figure", "none", "--timeout", str(p.timeout_s)]
    rc = run_command(cmd, p.timeout_s, log, cwd=ctx.root)
    if rc != 0 or not csv.is_file():
        return StepResult(p.name, "failed", _failed_run(rc, p, log))
    sizes = bandwidth_figures([r for r in read_results(csv) if r["method"] == "nccl"])
    if not sizes:
        return StepResult(p.name, "failed", f"no nccl row in {csv.name}")
    top = sizes[-1]
    return StepResult(p.name, "passed", f"busbw {top['busbw_GBps']:g} GB/s at "
                      f"{top['size_bytes'] // 2**20} MiB; {p.reason}", {"sizes": sizes})


def step_ddp_steps(p: Planned, facts: Facts, ctx: Context) -> StepResult:
    """BucketedDDP against torch's DDP, steps/s, by ``ddp-lesson bench ddp --no-link``."""
    from ddp_lesson.bench.ddp import read_results

    csv, log = ctx.out / "ddp.csv", ctx.out / "ddp-steps.log"
    cmd = [sys.executable, "-m", "ddp_lesson.cli", "bench", "ddp", "--nprocs", str(p.nproc),
           "--backend", p.backend, "--no-link", "--repeats", "3", "--steps", "4", "--warmup",
           "1", "--out", str(csv), "--figure", "none", "--timeout", str(p.timeout_s)]
    rc = run_command(cmd, p.timeout_s, log, cwd=ctx.root)
    if rc != 0 or not csv.is_file():
        return StepResult(p.name, "failed", _failed_run(rc, p, log))
    keep = ("variant", "steps_per_s", "steps_per_s_min", "steps_per_s_max", "ratio_to_torch")
    rows = [{k: r[k] for k in keep} for r in read_results(csv) if not r["link"]]
    by = {r["variant"]: r for r in rows}
    if "bucketed" not in by or "torch" not in by:
        return StepResult(p.name, "failed", f"no bucketed or torch row in {csv.name}")
    return StepResult(p.name, "passed", f"BucketedDDP/torch DDP steps/s "
                      f"{by['bucketed']['ratio_to_torch']:.3g}; {p.reason}",
                      {"variants": rows, "backend": p.backend, "nprocs": p.nproc})


RUNNERS = {"environment": step_environment, "gpu-tests": step_gpu_tests,
           "train-bf16": step_train_bf16, "train-fp16": step_train_fp16,
           "notebooks": step_notebooks, "allreduce-busbw": step_allreduce_busbw,
           "ddp-steps": step_ddp_steps}


# ----------------------------------------------------------------------------- run and report


def detail_lines(result: StepResult) -> list[str]:
    """The figures worth a line each under a step's line: each notebook cell that raised, the
    bandwidth per size, the steps/s per DDP variant."""
    f = result.figures
    lines = [f"  {e['notebook']} cell {e['cell']}: {e['error']}" for e in f.get("errors", [])]
    lines += [f"  {r['size_bytes'] / 2**20:g} MiB, {r['nprocs']} ranks: algbw "
              f"{r['algbw_GBps']:g} GB/s, busbw {r['busbw_GBps']:g} GB/s"
              for r in f.get("sizes", [])]
    lines += [f"  {r['variant']}: {r['steps_per_s']:.3g} steps/s (min {r['steps_per_s_min']:.3g}"
              f", max {r['steps_per_s_max']:.3g}), /torch {r['ratio_to_torch']:.3g}"
              for r in f.get("variants", [])]
    return [line[:100] for line in lines]


def run_steps(planned: list[Planned], facts: Facts, ctx: Context, runners=None,
              say=print, clock=time.monotonic, start: float | None = None) -> list[StepResult]:
    """Run each planned step in order, one line each; a step that raises is a failed step,
    and the next one runs all the same.

    Step k must end by the sum of the limits (:data:`TIMEOUT_S`) of steps 1..k, counted from
    ``start`` (default: now): what a skipped or quick step leaves of its limit goes to the
    steps after it, and the whole never runs past the sum. ``clock`` gives seconds (monotonic).
    """
    runners = RUNNERS if runners is None else runners
    results = []
    deadline = clock() if start is None else start
    for p in planned:
        deadline += TIMEOUT_S[p.name]
        if not p.run:
            result = StepResult(p.name, "skipped", p.reason)
        else:
            p = replace(p, timeout_s=round(max(1.0, deadline - clock()), 1))
            t0 = clock()
            try:
                result = runners[p.name](p, facts, ctx)
            except Exception as exc:  # a step's own bug must not stop the others
                result = StepResult(p.name, "failed", f"{type(exc).__name__}: {exc}"[:200])
            result.seconds = round(clock() - t0, 1)
        results.append(result)
        say(f"{result.name:<16} {result.status:<7} {result.reason}"[:300])
        for line in detail_lines(result):
            say(line)
    return results


def _cell(text: str) -> str:
    """A Markdown table cell: one line, ``|`` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def gpu_cell(facts: Facts) -> str:
    """The "GPU" cell: count x name (memory, compute capability), CUDA, NCCL, driver."""
    if not facts.gpus:
        return "none (no CUDA device)"
    names: dict[str, list[Gpu]] = {}
    for g in facts.gpus:
        names.setdefault(g.name, []).append(g)
    kinds = ", ".join(f"{len(gs)}× {name} ({gs[0].memory_gib:g} GiB, sm "
                      f"{gs[0].capability[0]}.{gs[0].capability[1]})"
                      for name, gs in names.items())
    return (f"{kinds}; CUDA {facts.cuda}, NCCL {facts.nccl}, "
            f"driver {facts.driver or 'unknown'}")


def result_cell(facts: Facts, results: list[StepResult]) -> str:
    """The "result" cell: counts by status, the failed steps named, the skipped ones' reasons."""
    by = {s: [r for r in results if r.status == s] for s in STATUSES}
    head = ", ".join(f"{len(by[s])} {s}" for s in STATUSES)
    if facts.error:
        return f"gpucheck: {head}: the GPUs could not be read ({facts.error})"
    if not facts.gpus:
        return f"gpucheck: {head}: no CUDA device, every GPU step skipped"
    parts = [f"gpucheck: {head}"]
    if by["failed"]:
        parts.append("failed: " + ", ".join(r.name for r in by["failed"]))
    if by["skipped"]:
        parts.append("skipped: " + ", ".join(f"{r.name} ({r.reason})" for r in by["skipped"]))
    if len(facts.gpus) < 2:
        parts.append("multi-GPU checks not run (one GPU)")
    return "; ".join(parts)


def markdown_row(facts: Facts, results: list[StepResult], date: str) -> str:
    """The README's "Tested on" row: ``| GPU | torch | date | result |``."""
    cells = (gpu_cell(facts), facts.torch, date, result_cell(facts, results))
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def report(facts: Facts, planned: list[Planned], results: list[StepResult],
           date: str) -> dict:
    """The JSON file's content."""
    return {"command": "python tools/gpucheck.py", "date": date,
            "facts": asdict(facts), "multi_gpu_not_run": multi_gpu_not_run(facts),
            "plan": [asdict(p) for p in planned],
            "steps": [asdict(r) for r in results],
            "failed": [r.name for r in results if r.status == "failed"],
            "row": markdown_row(facts, results, date)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/gpucheck.py",
        description="The GPU acceptance run: facts, the gpu tests, the trainer under bf16 and "
        "fp16, every core notebook executed, NCCL bus bandwidth, BucketedDDP vs torch's DDP. "
        f"At most {sum(TIMEOUT_S.values())} s; writes OUT/gpucheck.json and prints the README's "
        "'Tested on' row.")
    p.add_argument("--out", default="runs/gpucheck",
                   help="folder for the JSON file, logs, runs and executed notebooks "
                   "(default runs/gpucheck)")
    p.add_argument("--quick", action="store_true",
                   help=f"leave out {' and '.join(QUICK_SKIPS)} (the two longest steps)")
    p.add_argument("--skip", action="append", default=[], metavar="STEP",
                   help=f"leave a step out (repeatable): {', '.join(STEPS[1:])}")
    p.add_argument("--parallel", type=int, default=max(1, min(9, (os.cpu_count() or 2) // 2)),
                   help="notebooks executed at once (default: half the CPU cores, at most 9)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The acceptance run; 0 when no step failed, 1 when one did, 2 on bad arguments."""
    opts = parser().parse_args(argv)
    if opts.parallel < 1:
        print(f"gpucheck: error: --parallel must be >= 1, got {opts.parallel}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    facts = gather_facts()
    gather_s = time.monotonic() - t0
    try:
        planned = plan(facts, opts.skip, opts.quick)
    except ValueError as exc:
        print(f"gpucheck: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(fact_lines(facts)), flush=True)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out.resolve(), ROOT, opts.parallel)
    results = run_steps(planned, facts, ctx, say=lambda s: print(s, flush=True), start=t0)
    results[0].seconds = round(results[0].seconds + gather_s, 1)  # the facts are step 1's
    for line in multi_gpu_not_run(facts):
        print(f"not run: {line}")
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    data = report(facts, planned, results, date)
    (out / "gpucheck.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out / 'gpucheck.json'}")
    print("the README's 'Tested on' row:")
    print(data["row"])
    return 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
