"""The static book (``tools/build_book.py``): built from the stored notebooks and docs/ without
executing a cell, every notebook and doc a page in the navigation, every link between pages
landing on a page and heading that exist, and read in headless Chromium with no request leaving
the machine (figures drawn, math typeset, the widgets' stored text shown)."""
from __future__ import annotations

import html
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CHROMIUM = os.environ.get("DDP_LESSON_CHROMIUM") or "/usr/bin/chromium"
NOTEBOOKS = [*sorted((ROOT / "notebooks").glob("*.ipynb")),
             *sorted((ROOT / "notebooks" / "deep").glob("*.ipynb"))]
HREF = re.compile(r"<a\b[^>]*\bhref=\"([^\"]+)\"")
IDS = re.compile(r"\bid=\"([^\"]+)\"")


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    for module in ("sphinx", "myst_nb"):
        pytest.importorskip(module, reason=f"the book needs {module}: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("book")
    build_book.build(out)
    return out


def _page(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix(".html").as_posix()


def test_every_notebook_and_doc_is_a_page_in_the_navigation(book):
    index = (book / "book" / "index.html").read_text()
    for path in NOTEBOOKS:
        assert (book / _page(path)).is_file(), path.name
        assert f'href="../{_page(path)}"' in index, f"{path.name} missing from the navigation"
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f'href="../{_page(doc)}"' in index, doc.name
    assert "Reading time: about" in (book / _page(NOTEBOOKS[0])).read_text()


def test_the_offline_check_finds_a_network_fetch(tmp_path):
    (tmp_path / "a.html").write_text('<script src="https://cdn.example/x.js"></script>'
                                     '<link rel="stylesheet" href="//fonts.example/f.css">'
                                     '<img src="_images/local.png"><a href="https://ok">x</a>')
    assert build_book.offline(tmp_path) == ["a.html: https://cdn.example/x.js",
                                            "a.html: //fonts.example/f.css"]


def test_no_page_fetches_anything_from_the_network(book):
    assert build_book.offline(book) == []


def test_every_link_between_pages_lands_on_a_page_and_heading(book):
    ids: dict[Path, set[str]] = {}
    broken, checked = [], 0
    for page in sorted(book.rglob("*.html")):
        if page.parent.name in ("_static", "_sources") or page.name in ("genindex.html",
                                                                         "search.html"):
            continue
        for href in HREF.findall(page.read_text()):
            href = html.unescape(href)
            parts = urlsplit(href)
            if parts.scheme or href.startswith(("#", "mailto:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            checked += 1
            if not target.is_file():
                broken.append(f"{page.relative_to(book)} -> {href}")
            elif parts.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = {html.unescape(i) for i in IDS.findall(target.read_text())}
                if unquote(parts.fragment) not in ids[target]:
                    broken.append(f"{page.relative_to(book)} -> {href} (no such heading)")
    assert checked > 200 and broken == []


@pytest.fixture(scope="module")
def chromium():
    pytest.importorskip("playwright", reason="pip install -e '.[dev]' (playwright)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu",
                                           "--disable-background-networking"])
        yield browser
        browser.close()


def test_pages_read_offline_in_chromium(book, chromium):
    """Figures load, MathJax typesets from the book itself, a widget shows its stored text, and
    a link from notebook 00 to a deep-dive heading lands there; no request leaves file://."""
    outside: list[str] = []
    page = chromium.new_page()
    page.on("request", lambda r: None if r.url.startswith(("file://", "data:", "blob:"))
            else outside.append(r.url))
    page.set_default_timeout(30_000)
    figures = 0
    for nb in ("01_data_parallelism", "02_sampler_sharding", "deep/03_collective_costs"):
        page.goto((book / "notebooks" / f"{nb}.html").as_uri(), wait_until="load")
        sizes = page.eval_on_selector_all("img", "els => els.map(e => e.naturalWidth)")
        assert sizes and all(w > 0 for w in sizes), (nb, sizes)
        figures += len(sizes)
    page.goto((book / "notebooks" / "01_data_parallelism.html").as_uri(), wait_until="load")
    page.wait_for_selector("mjx-container", timeout=30_000)      # the identity, typeset
    page.goto((book / "notebooks" / "02_sampler_sharding.html").as_uri(), wait_until="load")
    assert "run the notebook to move its sliders" in page.inner_text("body")
    page.goto((book / "notebooks" / "00_setup.html").as_uri(), wait_until="load")
    page.click("a[href$='#3-·-What-your-own-job-script-must-do']")
    page.wait_for_load_state("load")
    assert page.url.endswith("00_torchrun_internals.html#3-%C2%B7-What-your-own-job-script-must-do")
    assert page.locator("[id='3-·-What-your-own-job-script-must-do']").count() == 1
    page.close()
    assert figures >= 3 and outside == []
