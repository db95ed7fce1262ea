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


# ----------------------------------------------------------------------------- the quick tier
# tests/tiers.py: the slow tests, and the guard that fails a test not marked slow that starts
# a process. `pytest -m "not slow"` is the quick tier (CONTRIBUTING.md, "Tests").

import tiers  # noqa: E402  (found through the sys.path entry above)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        path = getattr(item, "path", None)
        cls = getattr(item, "cls", None)
        names = {getattr(item, "originalname", None) or item.name, cls and cls.__name__}
        if path is not None and tiers.is_listed_slow(path, names):
            item.add_marker(pytest.mark.slow)
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
                    "slow (the test caught the failure): add it to SLOW in tests/tiers.py",
                    pytrace=False)
