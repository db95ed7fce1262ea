"""The notebook conventions of issue 44 (CONTRIBUTING.md, "Concept checks" and "Try, then read"),
checked on every core notebook: at least three answered concept checks; and where an exercise asks
the learner to build a teaching core (its reference lives in ``ddp_lesson/core/``), the cell that
prints that core comes after the exercise's specification, after a "Try the exercise first" line,
and is folded (``outputs_hidden``, JupyterLab's own cell metadata)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import nbformat
import pytest
from notebook_cells import concept_checks

ROOT = Path(__file__).resolve().parents[2]
CORE = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _builds_a_core() -> list[tuple[str, str, str]]:
    """(notebook number, exercise id, the core's definition line) for every exercise whose
    reference is a teaching core in ``ddp_lesson/core/``."""
    import ddp_lesson.exercises.catalog  # noqa: F401  (registers them)
    from ddp_lesson.exercises.registry import REGISTRY

    found = []
    for eid, ex in sorted(REGISTRY.items()):
        if ex.reference.__module__.startswith("ddp_lesson.core."):
            first = next(line for line in inspect.getsource(ex.reference).splitlines()
                         if line.startswith(("class ", "def ")))
            found.append((eid.split(".")[0], eid, first))
    return found


BUILDS = _builds_a_core()


def test_the_core_path_is_notebooks_00_to_09():
    assert [p.name[:2] for p in CORE] == [f"{i:02d}" for i in range(10)]


def test_the_exercises_that_build_a_core_are_found():
    assert {eid for _, eid, _ in BUILDS} >= {"02.1", "03.6", "04.3", "04.4", "08.5"}


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_each_core_notebook_has_three_answered_concept_checks(path):
    checks = concept_checks(path.name)
    assert len(checks) >= 3, f"{path.name}: {len(checks)} concept checks"
    assert all(q and a for q, a in checks), path.name


def _printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []))


@pytest.mark.parametrize("number,eid,definition", BUILDS, ids=[b[1] for b in BUILDS])
def test_a_core_an_exercise_builds_is_printed_folded_after_its_specification(number, eid,
                                                                             definition):
    path = next(p for p in CORE if p.name.startswith(number))
    cells = nbformat.read(path, as_version=4).cells
    spec = [i for i, c in enumerate(cells) if c.cell_type == "markdown"
            and re.search(rf'check\("{re.escape(eid)}"', c.source)]
    prints = [i for i, c in enumerate(cells) if c.cell_type == "code"
              and any(line.startswith(definition) for line in _printed(c).splitlines())]
    assert spec, f"{path.name}: no Markdown states exercise {eid} (check(\"{eid}\", ...))"
    assert prints, f"{path.name} does not print {definition!r}, the core {eid} builds"
    for i in prints:
        assert i > spec[0], f"{path.name}: cell {i} prints {definition!r} before {eid}'s task"
        assert cells[i].metadata.get("jupyter", {}).get("outputs_hidden") is True, (
            f"{path.name}: cell {i} prints {eid}'s answer unfolded")
        lead = cells[i - 1]
        assert lead.cell_type == "markdown" and "Try the exercise first" in lead.source, (
            f"{path.name}: cell {i} needs a 'Try the exercise first' line before it")
