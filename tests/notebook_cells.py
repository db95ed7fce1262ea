"""Stored-notebook readers shared by the test files (``from notebook_cells import stream_text``).

Tests that check the numbers a notebook prints read them from the *stored* outputs, the ones
nbval replays, so a printed line changed in a lab shows up in both places. A plain module, not
``conftest.py``: ``notebooks/conftest.py`` also exists, and a second module named ``conftest``
on ``sys.path`` would shadow this one.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import nbformat

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


def stored_run(notebook: str, marker: str,
               indent: int = 11) -> tuple[dict[int, list[str]], list[str]]:
    """The stored stdout of the cell containing ``marker``, read as a run's result.

    Lines ``[rank N] text`` go to ``ranks[N]`` (in order), every other line to ``other``. A
    rank line the launcher broke at 100 characters is made whole first
    (:func:`ddp_lesson.launch.output.join_continuations`); then a line that starts with
    ``indent`` spaces is a ``textwrap.fill`` continuation of a cell's own printing and is joined
    back to the line before it with one space (``indent=0``: none is). Returns
    ``(ranks, other)``.
    """
    from ddp_lesson.launch.output import join_continuations

    joined: list[str] = []
    for line in join_continuations(stream_text(notebook, marker)):
        if indent and line.startswith(" " * indent) and joined:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    ranks: dict[int, list[str]] = {}
    other = []
    for line in joined:
        m = re.match(r"\[rank (\d+)\] (.*)$", line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(2))
        else:
            other.append(line)
    return ranks, other


def lab_cell(notebook: str, module: str):
    """The stored cell that runs lab ``module`` as ``%%torchrun --nproc-per-node 2`` /
    ``from MODULE import main`` / ``main([])``, asserting its source is exactly that: a test
    that reads the cell's output instead of launching the lab checks that very job."""
    marker = f"from {module} import main"
    cell = cell_with(notebook, marker)
    assert cell.source == f"%%torchrun --nproc-per-node 2\n{marker}\n\nmain([])", cell.source
    return cell


class StoredRun:
    """A stored ``%%torchrun`` cell read as the run's result: ``rank_lines(rank)`` as
    :class:`ddp_lesson.launch.TorchrunResult` gives them (``[]`` for a rank that printed
    nothing), ``other`` the cell's lines that are not a rank's (the launcher's backend line)."""

    def __init__(self, notebook: str, marker: str, source: str):
        cell = cell_with(notebook, marker)
        assert cell.source == source, cell.source  # the very job the test would launch
        self.ranks, self.other = stored_run(notebook, marker, indent=0)  # no wrapped lines

    def rank_lines(self, rank: int) -> list[str]:
        return list(self.ranks.get(rank, []))


def concept_checks(notebook: str) -> list[tuple[str, str]]:
    """The concept checks of ``notebooks/<notebook>``: ``(question, answer)`` pairs, in order.

    The convention (CONTRIBUTING.md, "Concept checks"): one Markdown cell whose first line is
    ``## Concept checks``; each question is a numbered item (``1. ...``) followed by its answer in
    ``<details><summary>Answer</summary> ... </details>``. The texts come back with the HTML tags
    removed and whitespace collapsed, so a test can find the number the answer states.

    Raises:
        AssertionError: the notebook has no such cell, or a question has no answer.
    """
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "markdown"
             and c.source.lstrip().startswith("## Concept checks")]
    assert cells, f"no '## Concept checks' cell in {notebook}"
    text = cells[0].source.split("\n", 1)[1]
    pairs = []
    for item in re.split(r"^\d+\.\s", text, flags=re.M)[1:]:
        m = re.search(r"<details>(.*?)</details>", item, re.S)
        assert m, f"a concept check of {notebook} has no <details> answer: {item[:60]!r}"
        question = item[:m.start()]
        answer = re.sub(r"<summary>.*?</summary>", " ", m.group(1), flags=re.S)
        clean = [" ".join(re.sub(r"<[^>]+>", " ", s).split()) for s in (question, answer)]
        pairs.append((clean[0], clean[1]))
    return pairs


def numbers_in(text: str) -> list[float]:
    """The numbers written in ``text`` (a concept check's answer), in order: ``"0.2: 8 × 64"``
    gives ``[0.2, 8.0, 64.0]``; thousands separators are read (``"1,024"``: 1024.0), and
    exponents (``"3.5e9"``)."""
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e\d+)?", text.replace(",", ""))]
