"""Helpers shared by the test files: stored-notebook readers and the lab fixtures.

Notebook readers live in ``tests/notebook_cells.py`` (a plain module: ``notebooks/conftest.py``
would shadow a ``from conftest import ...``).

``json_lab``: :func:`run_json_lab` (a lab that writes its results as JSON to ``--out``).

Lab fixtures (``zero_lab``, ``fsdp_lab``): one torchrun launch per world size (2 and 3, where
3 catches uneven splits) per test module; each yields ``(world_size, rank 0's printed lines)``.
"""

from __future__ import annotations

import pytest


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


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def zero_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.zero_check`` (ZeRO-1 against DDP+AdamW)."""
    return request.param, lab_rank0_lines("ddp_lesson.labs.zero_check", request.param)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def fsdp_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.fsdp_tinygpt`` (FSDP2 against DDP)."""
    return request.param, lab_rank0_lines("ddp_lesson.labs.fsdp_tinygpt", request.param)
