"""Helpers shared by the test files: stored-notebook readers and the lab fixtures.

Notebook readers live in ``tests/notebook_cells.py`` (a plain module: ``notebooks/conftest.py``
would shadow a ``from conftest import ...``).

``json_lab``: :func:`run_json_lab` (a lab that writes its results as JSON to ``--out``).

Lab fixtures (``zero_lab``, ``fsdp_lab``): world sizes 2 and 3 (3 catches uneven splits); each
yields ``(world_size, rank 0's printed lines)``. World size 3 is one torchrun launch per test
module; world size 2 is the run notebook 08's (or its deep dive's) ``%%torchrun`` cell makes
(``main([])`` on 2 processes), read from its stored output: the suite's nbval replay runs that
cell and fails unless it prints exactly what is stored, so the same lines are checked on a fresh
run either way.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

# The shared helpers (notebook_cells, gpt_reference, sampler_reference) live beside this file and
# the tests sit in folders below it: put this folder on sys.path whatever pytest's import mode.
HELPERS = str(Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


def lab_rank0_lines(module: str, world_size: int, timeout: float = 120) -> list[str]:
    """Run ``module``'s ``main()`` under torchrun on ``world_size`` processes; rank 0's lines."""
    from ddp_lesson.launch import run_torchrun

    r = run_torchrun(code=f"from {module} import main; main()",
                     nproc_per_node=world_size, timeout=timeout, live=False)
    return r.rank_lines(0)


def run_json_lab(module: str, out, timeout: float = 120):
    """Run lab ``module`` (``--out OUT``) on 2 gloo processes; ``(rank 0's lines, rank 1's
    lines, the JSON the lab wrote to out)``."""
    import json

    from ddp_lesson.launch import run_torchrun

    result = run_torchrun(module, ["--out", str(out)], module=True, nproc_per_node=2,
                          timeout=timeout, live=False, backend="gloo")
    with open(out) as f:
        data = json.load(f)
    return result.rank_lines(0), result.rank_lines(1), data


@pytest.fixture(scope="session")
def json_lab():
    """:func:`run_json_lab`, for a test module's own lab fixture."""
    return run_json_lab


def notebook07_or_launch(module: str, world_size: int) -> list[str]:
    """Rank 0's lines of ``module``'s ``main()`` on ``world_size`` processes: the stored run
    for 2 (ZeRO: notebook 08; FSDP: its deep dive ``deep/08_fsdp2_and_model_parallelism``; the
    cell is exactly ``from MODULE import main`` / ``main([])`` under ``%%torchrun
    --nproc-per-node 2``), a torchrun launch otherwise."""
    if world_size != 2:
        return lab_rank0_lines(module, world_size)
    from notebook_cells import lab_cell, stored_run

    nb = ("deep/08_fsdp2_and_model_parallelism.ipynb" if module.endswith("fsdp_tinygpt")
          else "08_beyond_ddp_zero_fsdp.ipynb")
    lab_cell(nb, module)
    ranks, _ = stored_run(nb, f"from {module} import main")
    return ranks[0]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def zero_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.zero_check`` (ZeRO-1 against DDP+AdamW)."""
    return request.param, notebook07_or_launch("ddp_lesson.labs.zero_check", request.param)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def fsdp_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.fsdp_tinygpt`` (FSDP2 against DDP)."""
    return request.param, notebook07_or_launch("ddp_lesson.labs.fsdp_tinygpt", request.param)


# ----------------------------------------------------------------------------- world of one
# A gloo process group never lives in a pytest process: torch 2.13's gloo teardown can deadlock
# there. destroy_process_group() joins the group's worker thread while holding the GIL, and that
# thread, dropping a finished work whose saved thread-local state holds a Python object, waits
# for the GIL (py-spy and gdb on a hung worker: ``pthread_join`` in the main thread,
# ``gil_scoped_acquire`` under ``~ThreadLocalState`` / ``~AsyncWork`` in ``pt_gloo_runloop``).
# A long-lived pytest process gathers such state: after tests/ddp/test_compile_ddp.py's
# in-process tests, tests/models/test_models.py hung in 1 of 3 runs, and pytest-timeout's signal
# cannot reach a main thread blocked in C. So a test that needs a group asks for
# ``world_of_one``: the test then runs alone in a fresh ``python -m pytest`` (a 120 s limit), and
# the pytest process itself refuses ``init_process_group`` with the reason.

OWN_PROCESS_ENV = "DDP_LESSON_TEST_OWN_PROCESS"
OWN_PROCESS_TIMEOUT_S = 120
_IN_OWN_PROCESS = os.environ.get(OWN_PROCESS_ENV) == "1"
_OWN_PROCESS = pytest.StashKey[bool]()  # set on a test that must run in a process of its own


def _refuse_process_group(*args, **kwargs):
    raise RuntimeError("init_process_group in the pytest process: ask for the world_of_one "
                       "fixture instead (tests/conftest.py says why: a gloo teardown there "
                       "can deadlock)")


if not _IN_OWN_PROCESS:
    import torch.distributed as _dist

    if _dist.is_available():
        _dist.init_process_group = _refuse_process_group


@pytest.fixture
def world_of_one(request, tmp_path):
    """A gloo process group of one rank (``FileStore`` in ``tmp_path``), in a process of its own.

    In the pytest process it sets nothing up: the test is marked to run alone in a fresh
    ``python -m pytest NODEID`` (see the comment above), where this fixture makes the group and
    destroys it after the test."""
    if not _IN_OWN_PROCESS:
        request.node.stash[_OWN_PROCESS] = True
        yield None
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run a ``world_of_one`` test alone in a fresh pytest process; fail with its output."""
    if _IN_OWN_PROCESS or not pyfuncitem.stash.get(_OWN_PROCESS, False):
        return None
    import subprocess

    # without the suite's addopts (xdist, nbval): one test, and ~2 CPU-s less to start
    cmd = [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "--no-header", "-o",
           "addopts=", "-p", "no:xdist", "-p", "no:nbval", "-p", "no:cacheprovider"]
    env = {**os.environ, OWN_PROCESS_ENV: "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        run = subprocess.run(cmd, cwd=pyfuncitem.config.rootpath, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=OWN_PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{pyfuncitem.nodeid} in its own process outlived "
                    f"{OWN_PROCESS_TIMEOUT_S} s:\n{(e.stdout or '')[-3000:]}", pytrace=False)
    if run.returncode != 0 or " passed" not in run.stdout:
        pytest.fail(f"{pyfuncitem.nodeid} in its own process (exit {run.returncode}):\n"
                    f"{run.stdout[-6000:]}", pytrace=False)
    return True


# ----------------------------------------------------------------------------- the quick tier
# Each test file marks its slow tests (pytest.mark.slow); tests/tiers.py's guard fails a test not
# marked slow that starts a process. `pytest -m "not slow"` is the quick tier (CONTRIBUTING.md).

import tiers  # noqa: E402  (found through the sys.path entry above)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        path = getattr(item, "path", None)
        if path is not None and tiers.reads_notebooks(path):
            item.add_marker(pytest.mark.notebook)


def _guarded(item):
    """The process guard for a test below tests/ not marked slow; a no-op otherwise."""
    below_tests = tiers.TESTS in Path(item.path).resolve().parents
    if not below_tests or item.get_closest_marker("slow") is not None:
        return contextlib.nullcontext()
    return tiers.no_process_starts(item.nodeid, lambda msg: pytest.fail(msg, pytrace=False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item) as guard:
        result = yield
    _fail_if_swallowed(item, guard)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item) as guard:
        result = yield
    _fail_if_swallowed(item, guard)
    return result


def _fail_if_swallowed(item, guard):
    if guard is not None and guard.started:
        pytest.fail(f"{item.nodeid} starts a process ({guard.started[0]}) but is not marked "
                    "slow (the test caught the failure): mark it @pytest.mark.slow",
                    pytrace=False)
