"""Every notebook's Markdown reads as written: no `**` that Markdown turns into bold by accident.

In Markdown, `2**12` outside a code span is not "2 to the 12": the asterisks open emphasis, and
a later `**` closes it, so notebook 03's exercise once read "from 212 to 222" with the
exponents in bold. Write powers as code (`` `2**12` ``), with a superscript (2¹²), or escape the
asterisks (``2\\*\\*12``). This test finds `**` between two word characters (a digit, a
letter, `_`, or a closing/opening bracket) outside code spans and fenced code blocks.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parents[2] / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_SLIP = re.compile(r"[\w)\]]\*\*[\w(]")


def slips(markdown: str) -> list[str]:
    """The fragments of ``markdown`` where ``**`` sits between word characters outside code."""
    text = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), _FENCE.sub("", markdown))
    return [text[max(0, m.start() - 12):m.end() + 12].replace("\n", " ")
            for m in _SLIP.finditer(text)]


def test_the_check_finds_the_slip_and_spares_code_and_bold():
    found = slips("piece_numel from 2**12 to 2**22.")
    assert len(found) == 2 and "2**12" in found[0] and "2**22" in found[1]
    assert len(slips("exponent x**2 here")) == 1
    assert slips("from `2**12` to `2**22`, and **bold** words") == []
    assert slips("escaped 2\\*\\*12 and 2¹²") == []
    assert slips("```python\ny = 2**12\n```\nafter") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_markdown_has_no_accidental_bold(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, s) for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
             for s in slips(cell.source)]
    assert not found, f"{path.name}: `**` outside code (cell index, text): {found}"
