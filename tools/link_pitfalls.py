"""Make every pitfall code (A1, B15, C6, ...) in the notebooks' Markdown a link to its entry.

    python tools/link_pitfalls.py                 # rewrite notebooks/**/*.ipynb in place
    python tools/link_pitfalls.py --check         # list bare codes, exit 1 if any

A code becomes ``[B15](../docs/pitfalls.md#B15)`` (the path relative to the notebook's folder);
codes already inside a link, a code span or a fenced block are left alone. Only codes that
``docs/pitfalls.md`` defines (its table rows start ``| <a id="B15"></a>B15 |``) are linked.
``tests/notebooks/test_notebook_markdown.py`` fails on a bare code or a link to a missing anchor.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
PITFALLS = ROOT / "docs" / "pitfalls.md"
CODE = re.compile(r"(?<![\w/#\[`.-])([A-D]\d{1,2})(?![\w])")
#: Pieces of Markdown left as they are: fenced blocks, code spans, links and images, HTML tags.
KEEP = re.compile(r"```.*?```|`[^`\n]*`|!?\[[^\]]*\]\([^)]*\)|<[^>\n]+>", re.S)


def defined_codes(text: str | None = None) -> set[str]:
    """The codes ``docs/pitfalls.md`` has an anchor for."""
    text = PITFALLS.read_text() if text is None else text
    return set(re.findall(r'<a id="([A-D]\d{1,2})"></a>', text))


def bare_codes(markdown: str, codes: set[str]) -> list[str]:
    """Defined codes in ``markdown`` that are not inside a link, code span or block."""
    out, pos = [], 0
    for m in KEEP.finditer(markdown):
        out += [c for c in CODE.findall(markdown[pos:m.start()]) if c in codes]
        pos = m.end()
    return out + [c for c in CODE.findall(markdown[pos:]) if c in codes]


def link_codes(markdown: str, codes: set[str], rel: str) -> str:
    """``markdown`` with each bare defined code made a link to ``rel/docs/pitfalls.md#CODE``."""
    def link(m):
        c = m.group(1)
        return f"[{c}]({rel}/docs/pitfalls.md#{c})" if c in codes else c

    pieces, pos = [], 0
    for m in KEEP.finditer(markdown):
        pieces.append(CODE.sub(link, markdown[pos:m.start()]))
        pieces.append(m.group(0))
        pos = m.end()
    pieces.append(CODE.sub(link, markdown[pos:]))
    return "".join(pieces)


def notebooks() -> list[Path]:
    return sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("paths", nargs="*", type=Path)
    opts = p.parse_args(argv)
    codes, bad = defined_codes(), 0
    for path in opts.paths or notebooks():
        nb = nbformat.read(path, as_version=4)
        rel = os.path.relpath(ROOT, path.resolve().parent)
        changed = False
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            found = bare_codes(cell.source, codes)
            if found and opts.check:
                print(f"{path.relative_to(ROOT)}: cell {cell.get('id')}: {', '.join(found)}")
                bad += 1
            elif found:
                cell.source = link_codes(cell.source, codes, rel)
                changed = True
        if changed:
            nbformat.write(nb, path)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
