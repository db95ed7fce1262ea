"""Every numbered cross-reference in the notebooks and docs names a section that exists.

A reference is ``§K`` or ``section K`` (``K`` = ``3``, ``2b``), with what it points at read from
just before it: a Markdown link around it (``[N05 §2b](../notebooks/05_....ipynb#2b-...)``, the
link's file; its anchor must start with the same ``K``), ``notebook NN``, ``NNN``, ``NN §K`` in a
deep dive (the core notebook NN), ``deep dive NN`` / ``NN deep dive`` / ``notebook NN's deep dive``
(the deep dive NN, when only one has that number, or the link just before), ``the core
notebook's`` (the deep dive's core notebook), or nothing: the notebook's own sections. A
notebook's sections are its headings ``## K · Title`` and ``### K · Title``. A link whose text
says ``notebook NN`` must point at notebook NN, one that says ``deep`` at a deep dive.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DEEP = sorted((ROOT / "notebooks" / "deep").glob("*.ipynb"))
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
#: The package's docstrings and comments: their references to a notebook are checked; a bare
#: "section 4" there is a paper's or a doc's (Thakur et al. (2005), section 4) and is left alone.
SOURCES = sorted((ROOT / "ddp_lesson").rglob("*.py"))

HEADING = re.compile(r"^#{2,3}\s+(\d+[a-z]?)\s+·", re.M)
REF = re.compile(r"(?:§\s?|\b[Ss]ections?\s+)(\d+[a-z]?)\b(?!\.\d)")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
LEGEND = re.compile(r"\bN(\d\d) = notebook (\d\d)\b")


def _sections(path: Path) -> set[str]:
    nb = nbformat.read(path, as_version=4)
    return {m.group(1) for c in nb.cells if c.cell_type == "markdown"
            for m in HEADING.finditer(c.source)}


SECTIONS = {p: _sections(p) for p in [*NOTEBOOKS, *DEEP]}


def _core(nn: str) -> Path | None:
    found = [p for p in NOTEBOOKS if p.name.startswith(nn + "_")]
    return found[0] if len(found) == 1 else None


def _deep(nn: str) -> Path | str:
    found = [p for p in DEEP if p.name.startswith(nn + "_")]
    if len(found) == 1:
        return found[0]
    return f"deep dive {nn} is ambiguous ({len(found)} deep dives): link the one meant"


def _texts() -> list[tuple[Path, int | None, str]]:
    out = []
    for p in [*NOTEBOOKS, *DEEP]:
        for i, cell in enumerate(nbformat.read(p, as_version=4).cells):
            out.append((p, i, cell.source))
    out += [(p, None, p.read_text(encoding="utf-8")) for p in [*DOCS, *SOURCES]]
    return out


def _target(path: Path, text: str, start: int) -> Path | str | None:
    """The notebook a reference at ``text[start:]`` points at; a string says why none."""
    for link in LINK.finditer(text):
        if link.start(1) <= start < link.end(1):
            dest = link.group(2).split("#")[0]
            return (path.parent / dest).resolve() if dest.endswith(".ipynb") else None
    prefix = text[max(0, start - 80):start]
    prefix = re.split(r"\.\s|\n\n", prefix)[-1]
    if re.search(r"paper's\s*$", prefix):
        return None                                   # a paper's own section
    m = re.search(r"\]\(([^)\s]+\.ipynb)[^)]*\),?\s*\(?$", prefix)
    if m:                                             # [notebook 06's deep dive](...), section 1
        return (path.parent / m.group(1)).resolve()
    m = re.search(r"\b(notebooks/(?:deep/)?\w+\.ipynb)`*,?\s*$", prefix)
    if m:                                             # (``notebooks/deep/06_....ipynb``, section 2)
        return ROOT / m.group(1)
    m = re.search(r"(?:deep dive (\d\d)|(\d\d) deep dive|[Nn]otebook (\d\d)'s deep dive"
                  r"|deep (\d\d)),?\s*\(?$", prefix)
    if m:
        return _deep(next(g for g in m.groups() if g))
    m = re.search(r"(?:\b[Nn]otebook\s+|\bN)(\d\d)\b(?:'s)?[^,.;()]{0,12}?,?\s*\(?$", prefix)
    if m:
        return _core(m.group(1)) or f"no notebook {m.group(1)}"
    m = re.search(r"\b[Nn]otebook\s+(\d\d)\b[^.]{0,20}\bits\s*$", prefix)
    if m:
        return _core(m.group(1)) or f"no notebook {m.group(1)}"
    if path.suffix == ".ipynb" and path.parent.name == "deep":
        m = re.search(r"(?:^|[\s(])(\d\d)\s*$", prefix)
        if m:                                         # "From 01 §3a" in a deep dive
            return _core(m.group(1)) or f"no notebook {m.group(1)}"
        if re.search(r"core notebook(?:'s|,)?\s*$", prefix):
            return _core(path.name[:2])
    if path.suffix == ".ipynb":
        return path
    if path.suffix == ".py":
        return None
    return "a bare section number in a doc: name the notebook"


def _problems() -> list[str]:
    problems = []
    for path, cell, text in _texts():
        where = f"{path.relative_to(ROOT)}" + (f" cell {cell}" if cell is not None else "")
        for m in REF.finditer(text):
            target = _target(path, text, m.start())
            context = text[max(0, m.start() - 50):m.end()].replace("\n", " ")
            if isinstance(target, str):
                problems.append(f"{where}: {target}: ...{context}")
            elif target is not None and m.group(1) not in SECTIONS.get(target, ()):
                problems.append(f"{where}: {target.name} has no section {m.group(1)} "
                                f"(it has {sorted(SECTIONS.get(target, ()))}): ...{context}")
        for link in LINK.finditer(text):
            label, dest = link.groups()
            file_, _, anchor = dest.partition("#")
            if not file_.endswith(".ipynb"):
                continue
            ref = REF.search(label)
            if ref and anchor and not anchor.startswith(ref.group(1) + "-"):
                problems.append(f"{where}: link text {label!r} but anchor #{anchor}")
            said = re.search(r"\b(?:notebook |N)(\d\d)\b(?!'s deep)", label)
            name = Path(file_).name
            if said and "deep" not in label and (
                    Path(file_).parent.name == "deep" or not name.startswith(said.group(1))):
                problems.append(f"{where}: link text {label!r} points at {file_}")
        for m in LEGEND.finditer(text):
            if m.group(1) != m.group(2):
                problems.append(f"{where}: legend {m.group(0)!r}")
    return problems


def test_every_notebook_has_numbered_sections():
    assert all(SECTIONS[p] for p in NOTEBOOKS), [p.name for p in NOTEBOOKS if not SECTIONS[p]]


def test_every_section_reference_names_an_existing_section():
    problems = _problems()
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("text, problem", [
    ("no_sync (notebook 04, section 7)", "has no section 7"),
    ("[N05 §2b](../notebooks/05_your_script_data_parallel.ipynb#2c-·-Data)", "anchor #2c"),
    ("N08 = notebook 05", "legend"),
    ("see section 2", "bare section"),
    ("[notebook 07 §2](../notebooks/deep/07_restart_trap_and_stores.ipynb)", "points at"),
])
def test_the_checker_flags_a_wrong_reference(monkeypatch, text, problem):
    doc = ROOT / "docs" / "cheatsheet.md"
    monkeypatch.setattr(sys.modules[__name__], "_texts", lambda: [(doc, None, text)])
    assert any(problem in p for p in _problems()), _problems()
