"""Helpers shared by the test files: stored-notebook readers and the lab fixtures.

Notebook readers (plain functions, ``from conftest import stream_text``): tests that check the
numbers a notebook prints read them from the *stored* outputs, the ones nbval replays, so a
printed line changed in a lab shows up in both places.

Lab fixtures (``zero_lab``, ``fsdp_lab``): one torchrun launch per world size (2 and 3, where
3 catches uneven splits) per test module; each yields ``(world_size, rank 0's printed lines)``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


@functools.lru_cache(maxsize=16)
def code_cells(notebook: str) -> tuple:
    """The code cells of ``notebooks/<notebook>`` as stored (outputs included), in order."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    return tuple(c for c in nb.cells if c.cell_type == "code")


def cell_with(notebook: str, marker: str):
    """The first code cell of ``notebook`` whose source contains ``marker``.

    Raises:
        AssertionError: no cell contains ``marker`` (the notebook was edited: say which).
    """
    for cell in code_cells(notebook):
        if marker in cell.source:
            return cell
    raise AssertionError(f"no cell containing {marker!r} in {notebook}")


def stream_text(notebook: str, marker: str) -> str:
    """The stored stdout/stderr text of the first code cell containing ``marker``."""
    outputs = cell_with(notebook, marker).outputs
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


def lab_rank0_lines(module: str, world_size: int, timeout: float = 120) -> list[str]:
    """Run ``module``'s ``main()`` under torchrun on ``world_size`` processes; rank 0's lines."""
    from ddp_lesson.launch import run_torchrun

    r = run_torchrun(code=f"from {module} import main; main()",
                     nproc_per_node=world_size, timeout=timeout, live=False)
    return r.rank_lines(0)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def zero_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.zero_check`` (ZeRO-1 against DDP+AdamW)."""
    return request.param, lab_rank0_lines("ddp_lesson.labs.zero_check", request.param)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def fsdp_lab(request):
    """``(world_size, lines)`` of ``ddp_lesson.labs.fsdp_tinygpt`` (FSDP2 against DDP)."""
    return request.param, lab_rank0_lines("ddp_lesson.labs.fsdp_tinygpt", request.param)
