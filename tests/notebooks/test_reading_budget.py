"""The reading budgets (``tools/reading_budget.py``, CONTRIBUTING.md "Reading budgets"): the
rule's arithmetic, each notebook's stated figure against the tool's, the core path's caps."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import reading_budget  # noqa: E402

NOTEBOOKS = [*reading_budget.core_paths(), *reading_budget.deep_paths()]


def _notebook(tmp_path, cells):
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_the_rule_counts_prose_code_printed_source_outputs_and_figures(tmp_path):
    source = "def f(x):\n    return x\n" + "import os\n" + "y = 1\n" * 5   # 8 lines, 3 Python
    prose = "Reading time: about 5 minutes <b>x</b> " + "w " * 194       # 200 words, tags off
    cells = [
        {"cell_type": "markdown", "source": [prose]},
        {"cell_type": "code", "source": "a " * 100, "outputs": [
            {"output_type": "stream", "text": "out " * 150},
            {"output_type": "stream", "text": source},
            {"output_type": "display_data", "data": {"image/png": "AA", "text/plain": "<Fig>"}}]},
    ]
    r = reading_budget.budget(_notebook(tmp_path, cells))
    words_of_source = len(source.split())   # 21
    assert (r["prose"], r["code"], r["source"], r["out"], r["figs"]) == (
        200, 100, words_of_source, 150, 1)
    assert r["minutes"] == round(1 + 1 + words_of_source / 100 + 1 + 0.75, 1)   # 3.96
    assert r["stated"] == 5


def test_write_restates_the_figure_in_the_first_cell(tmp_path):
    cells = [{"cell_type": "markdown", "id": "a1", "metadata": {},
              "source": "Reading time: about 9 minutes · "
              "Run time: about 5 s\n" + "w " * 394}]   # 400 words of prose: 2 minutes
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    assert reading_budget.write_stated(path) is True
    assert reading_budget.budget(path)["stated"] == 2
    assert "Run time: about 5 s" in "".join(json.loads(path.read_text())["cells"][0]["source"])
    assert reading_budget.write_stated(path) is False   # already true


def test_check_refuses_a_stated_figure_off_by_more_than_ten_percent():
    row = dict(path="notebooks/deep/99_x.ipynb", minutes=20.0, stated=20)
    assert reading_budget.problems([], [row]) == []
    assert reading_budget.problems([], [dict(row, stated=23)]) == [
        "notebooks/deep/99_x.ipynb: states 23 min, the rule gives 20.0"]
    assert reading_budget.problems([], [dict(row, stated=None)]) != []


def test_check_refuses_a_core_notebook_over_its_cap_and_a_long_path():
    row = dict(path="notebooks/00_setup.ipynb", minutes=10.4, stated=10)
    assert reading_budget.problems([row], []) == [
        "notebooks/00_setup.ipynb: 10.4 min > its cap, 10"]
    long = [dict(path=f"notebooks/{i:02d}_x.ipynb", minutes=9.0, stated=9) for i in range(17)]
    assert reading_budget.problems(long, []) == ["core path: 153.0 min > 150"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_notebook_states_the_tools_figure_within_ten_percent(path):
    r = reading_budget.budget(path)
    assert r["stated"] is not None, f"{path.name}: no 'Reading time: about N minutes'"
    assert abs(r["stated"] - r["minutes"]) <= max(0.1 * r["minutes"], 0.5), (
        f"{path.name} states {r['stated']} min; python tools/reading_budget.py: {r['minutes']}")


@pytest.mark.parametrize("path", reading_budget.core_paths(), ids=lambda p: p.name)
def test_each_core_notebook_within_its_cap(path):
    cap = min(reading_budget.CORE_MAX, reading_budget.CAPS[path.name[:2]])
    assert reading_budget.budget(path)["minutes"] <= cap


def test_the_core_path_within_two_and_a_half_hours_and_the_tool_agrees():
    total = sum(reading_budget.budget(p)["minutes"] for p in reading_budget.core_paths())
    assert total <= reading_budget.CORE_TOTAL == 150
    assert reading_budget.main(["--check"]) == 0
