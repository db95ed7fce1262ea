"""Every pitfall code in a notebook's Markdown is a link to its entry in docs/pitfalls.md, and
every such link names an anchor that exists (``tools/link_pitfalls.py`` makes the links)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from link_pitfalls import bare_codes, defined_codes, link_codes  # noqa: E402

NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
CODES = defined_codes()
LINK = re.compile(r"\]\(((?:\.\./)+)docs/pitfalls\.md#([^)]+)\)")


def test_every_table_row_has_its_anchor():
    rows = re.findall(r"^\| <a id=\"([A-D]\d{1,2})\"></a>\1 \|", (ROOT / "docs" / "pitfalls.md")
                      .read_text(), re.M)
    assert len(rows) == len(set(rows)) == len(CODES) >= 40


def test_the_linker_links_bare_codes_only():
    md = "case B15 and (A2, A3); `B5` in code; [B8](../docs/pitfalls.md#B8); A100 GPUs; X9"
    linked = link_codes(md, CODES, "..")
    assert linked == ("case [B15](../docs/pitfalls.md#B15) and ([A2](../docs/pitfalls.md#A2), "
                      "[A3](../docs/pitfalls.md#A3)); `B5` in code; [B8](../docs/pitfalls.md#B8);"
                      " A100 GPUs; X9")
    assert bare_codes(linked, CODES) == []
    assert bare_codes(md, CODES) == ["B15", "A2", "A3"]
    assert bare_codes("no code span or link here: A2 and B5", CODES) == ["A2", "B5"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_pitfall_codes_in_markdown_are_links_to_existing_anchors(path):
    depth = len(path.relative_to(ROOT).parts) - 1  # notebooks/x.ipynb: 1, notebooks/deep/x: 2
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        assert bare_codes(cell.source, CODES) == [], (cell.get("id"), "run tools/link_pitfalls.py")
        for up, code in LINK.findall(cell.source):
            assert code in CODES, (cell.get("id"), code)
            assert up == "../" * depth, (cell.get("id"), up)


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_LINK = re.compile(r"\[([A-E]\d{1,2})\]\(([^)]*pitfalls\.md)(#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_a_pitfall_code_in_the_docs_links_to_its_own_entry(path):
    """``[B7](pitfalls.md)`` opened the table's top, not B7: each code links to its anchor."""
    wrong = [m.group(0) for m in DOC_LINK.finditer(path.read_text())
             if m.group(3) != f"#{m.group(1)}" or m.group(1) not in CODES]
    assert wrong == []
