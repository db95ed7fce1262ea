"""Build the series as a static website from the stored notebooks and docs/, executing nothing.

    python tools/build_book.py               # -> build/book/index.html (open it in a browser)
    python tools/build_book.py --out DIR

Sphinx with MyST-NB (``book/conf.py``): every core notebook, deep dive and doc becomes a page,
the stored outputs and figures as nbval replays them, the links between notebooks and docs
turned into links between pages (the anchors JupyterLab gives headings kept). Warnings are
errors, so a link to a missing page or heading fails the build. No page loads anything from the
network: MathJax is served from the book, widgets show their stored text form; :func:`offline`
lists what would break that. ``tests/notebooks/test_book.py`` builds it and opens it in Chromium.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "book"
#: a tag that makes the browser fetch something: a script, a stylesheet or font, an image, a frame
_FETCH = re.compile(r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=\"([^\"]*)\"", re.I)


def offline(out: Path) -> list[str]:
    """``page: url`` for every script, stylesheet, image or frame a page would fetch from
    another machine (an ``http(s)://`` or ``//`` address). Empty: the book reads offline."""
    found = []
    for page in sorted(out.rglob("*.html")):
        for url in _FETCH.findall(page.read_text(errors="replace")):
            if re.match(r"(https?:)?//", url, re.I):
                found.append(f"{page.relative_to(out)}: {url}")
    return found


def build(out: Path = OUT, quiet: bool = True) -> Path:
    """Build the book into ``out`` and return the path of its start page.

    Raises:
        SystemExit: Sphinx reported a warning or an error (a broken link, a missing heading), or
            a page would fetch something from the network.
    """
    from sphinx.cmd.build import build_main

    args = ["-b", "html", "-c", str(ROOT / "book"), "-W", "--keep-going", "-d",
            str(out / ".doctrees"), *(["-q"] if quiet else []), str(ROOT), str(out)]
    if build_main(args):
        raise SystemExit("the book did not build cleanly: see Sphinx's messages above")
    start = out / "index.html"
    start.write_text('<!DOCTYPE html><meta charset="utf-8">'
                     '<meta http-equiv="refresh" content="0; url=book/index.html">'
                     '<a href="book/index.html">ddp-lesson</a>\n')
    if bad := offline(out):
        raise SystemExit("pages that need the network:\n" + "\n".join(bad))
    return start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    opts = p.parse_args(argv)
    print(f"built {build(opts.out.resolve())}: open it in a browser")
    return 0


if __name__ == "__main__":
    sys.exit(main())
