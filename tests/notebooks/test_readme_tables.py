"""The README's core-path table and deep-dive list are what the notebooks say of themselves
(``tools/readme_tables.py`` writes them): titles, reading and run times from each notebook's
first cell."""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import readme_tables  # noqa: E402


def test_every_notebook_states_its_reading_and_run_time():
    paths = [*sorted((ROOT / "notebooks").glob("*.ipynb")),
             *sorted((ROOT / "notebooks" / "deep").glob("*.ipynb"))]
    missing = [p.name for p in paths
               if not readme_tables.TIMES.search(nbformat.read(p, as_version=4).cells[0].source)]
    assert missing == [], "first cell lacks 'Reading time: about N minutes ... Run time: about S s'"


def test_every_core_notebook_has_a_line_in_the_readme_table():
    stems = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert stems == set(readme_tables.SHOWS)


def test_readme_blocks_are_the_notebooks():
    readme = (ROOT / "README.md").read_text()
    assert readme_tables.render(readme) == readme, "run python tools/readme_tables.py"


def test_the_readme_counts_the_checkers_the_registry_holds():
    from ddp_lesson.exercises.registry import REGISTRY

    readme = (ROOT / "README.md").read_text()
    said = int(readme_tables.CHECKERS.search(readme).group(0).split("(")[1].split()[0])
    assert said == len(REGISTRY) == readme_tables.checker_count()
    stale = readme.replace(f"code ({said} of them", "code (3 of them")
    assert f"code ({len(REGISTRY)} of them" in readme_tables.render(stale)   # the tool rewrites it
