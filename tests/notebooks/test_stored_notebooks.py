"""The stored notebooks read well unexecuted, in JupyterLab and on GitHub.

Checks on the files as committed, no kernel needed:

* metadata: exactly what JupyterLab writes (``tools/normalize_notebooks.py``), so opening a
  notebook does not mark it unsaved;
* no raw Python repr where a reader expects text: an output shown as ``text/plain`` (nothing
  richer to show without a kernel: a widget's view needs the live kernel) must not read like
  ``Label(value='...')``, ``RingAllReduceStepper(world_size=3, ...)`` or ``<Figure ...>``;
* every output line within 100 characters (the ``[rank N] `` prefix included): JupyterLab breaks
  wider lines anywhere, mid-word;
* every stored figure at least 700 px wide as displayed (the PNG header's width, or the width
  JupyterLab is told to draw it at);
* every relative link in a notebook's Markdown, in the README and in docs/ resolves to a file
  inside the folder the README starts JupyterLab in (outside it the server answers 404).

The Markdown ``**`` slip has its own test: tests/notebooks/test_notebook_markdown.py.
"""
from __future__ import annotations

import base64
import re
import shlex
import struct
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)  # the core path and notebooks/deep/
IDS = [p.name for p in NOTEBOOKS]
MAX_LINE = 100
MIN_FIGURE_PX = 700
# a repr: Name(...=...) (widgets, dataclasses), <module.Object ...> or a list of those
RAW_REPR = re.compile(r"^(?:[A-Za-z_][\w.]*\(.*=.*\)|<[A-Za-z_][\w.]*[ >].*>|\[<.*>\])$")
# what JupyterLab can show from a stored output without a kernel, richest first
RICH = ("text/html", "image/png", "image/jpeg", "image/svg+xml", "text/markdown", "text/latex",
        "application/json")


def _tool():
    """``tools/normalize_notebooks.py``, imported as the other tools' tests import theirs."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import normalize_notebooks

    return normalize_notebooks


def _code_outputs(nb):
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for output in cell.get("outputs", []):
                yield index, output


def shown_text(output) -> str | None:
    """The text a reader sees for a stored output when nothing richer can be drawn."""
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return None  # tracebacks are checked by the replay, not here
    data = output.get("data", {})
    if any(m in data for m in RICH):
        return None
    return data.get("text/plain")


def png_width(output) -> int | None:
    """The width in px a stored PNG output is drawn at (metadata width, else the PNG's own)."""
    data = output.get("data", {})
    if "image/png" not in data:
        return None
    meta = output.get("metadata", {}).get("image/png", {})
    if "width" in meta:
        return int(meta["width"])
    raw = base64.b64decode(data["image/png"])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">I", raw[16:20])[0]


# ------------------------------------------------------------------------ the checks' own tests

def test_the_checks_catch_what_they_are_for():
    assert RAW_REPR.match("Label(value='torchrun: 2 processes running')")
    assert RAW_REPR.match("RingAllReduceStepper(world_size=3, step=0 of 4)")
    assert RAW_REPR.match("<Figure size 560x240 with 1 Axes>")
    assert RAW_REPR.match("[<matplotlib.lines.Line2D at 0x7f>]")
    assert not RAW_REPR.match("NOT YET 00.3 (GPU index from the global rank)\n  rank 4 x=1")
    assert not RAW_REPR.match("[rank 0] sum = 3 (expected 3)")
    assert not RAW_REPR.match("torchrun: 2 processes finished (exit 0)")
    assert not RAW_REPR.match("len(sampler) per rank: [13, 13] = ceil(100 / 8)\nrank 0: [95, 4]")
    widget = nbformat.from_dict({"output_type": "display_data", "metadata": {}, "data": {
        "text/plain": "Label(value='x')", "application/vnd.jupyter.widget-view+json": {}}})
    assert shown_text(widget) == "Label(value='x')"
    png = struct.pack(">I", 8) + b"IHDR" + struct.pack(">II", 1234, 300) + b"\x08\x06\0\0\0"
    figure = nbformat.from_dict({"output_type": "display_data", "metadata": {}, "data": {
        "text/plain": "<Figure size 1234x300 with 1 Axes>",
        "image/png": base64.b64encode(b"\x89PNG\r\n\x1a\n" + png).decode()}})
    assert shown_text(figure) is None and png_width(figure) == 1234
    figure.metadata = {"image/png": {"width": 617}}
    assert png_width(figure) == 617


# ------------------------------------------------------------------------ every stored notebook

@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_metadata_is_what_jupyterlab_writes(path):
    problems = _tool().differences(path)
    assert not problems, ("opening this notebook in JupyterLab marks it unsaved; run "
                          "`python tools/normalize_notebooks.py`:\n" + "\n".join(problems))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_raw_repr_where_a_reader_expects_text(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, text) for i, out in _code_outputs(nb) if out.output_type != "stream"
             for text in [shown_text(out)] if text and RAW_REPR.match(text.strip())]
    assert not found, f"{path.name}: outputs that show a Python repr (cell index, text): {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_output_lines_fit_in_100_characters(path):
    nb = nbformat.read(path, as_version=4)
    wide = [(i, len(line), line) for i, out in _code_outputs(nb)
            for line in (shown_text(out) or "").splitlines() if len(line) > MAX_LINE]
    assert not wide, (f"{path.name}: {len(wide)} output lines over {MAX_LINE} characters "
                      f"(cell index, length, line): {wide}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_figures_are_at_least_700_px_wide(path):
    nb = nbformat.read(path, as_version=4)
    small = [(i, w) for i, out in _code_outputs(nb)
             for w in [png_width(out)] if w is not None and w < MIN_FIGURE_PX]
    assert not small, (f"{path.name}: figures under {MIN_FIGURE_PX} px wide "
                       f"(cell index, width px): {small}")


# ------------------------------------------------------------------------ links

_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""",
                        re.IGNORECASE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def relative_links(markdown: str) -> list[str]:
    """Relative link targets in ``markdown`` (no scheme, no pure #anchor), fragments cut."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    targets = _MD_LINK.findall(text) + _HTML_LINK.findall(text)
    return [t.split("#")[0] for t in targets
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")
            and t.split("#")[0]]


def served_root() -> Path:
    """The folder the README's notebooks section starts JupyterLab in (``jupyter lab [DIR]``,
    run from the repository root)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The notebooks", 1)[1]
    command = next(line for line in section.splitlines() if line.strip().startswith("jupyter lab"))
    folders = [a for a in shlex.split(command, comments=True)[2:] if not a.startswith("-")]
    return (ROOT / (folders[0] if folders else ".")).resolve()


def _documents():
    docs = [(p, p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        docs.append((path, "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")))
    return docs


def test_link_check_reads_markdown_and_html_links():
    md = ("see [pitfalls](../docs/pitfalls.md#b5), ![fig](a/b.png \"t\"), [web](https://x.org), "
          "[top](#intro), `[not](code.md)`, <a href='../README.md'>readme</a>")
    assert relative_links(md) == ["../docs/pitfalls.md", "a/b.png", "../README.md"]


def test_readme_serves_the_folder_every_link_needs():
    root = served_root()
    assert root == ROOT, (f"the README starts JupyterLab in {root.relative_to(ROOT)}/, but the "
                          f"notebooks link to ../docs/ and the README to notebooks/: start it "
                          f"in the repository root")


@pytest.mark.parametrize("path,markdown", _documents(), ids=[p.name for p, _ in _documents()])
def test_relative_links_resolve_inside_the_served_root(path, markdown):
    root = served_root()
    bad = []
    for target in relative_links(markdown):
        resolved = (path.parent / target).resolve()
        if not resolved.exists():
            bad.append(f"{target} (no such file)")
        elif not resolved.is_relative_to(root):
            bad.append(f"{target} (outside the folder JupyterLab serves, {root.name}/: a 404)")
    assert not bad, f"{path.name}: dead links: {bad}"
