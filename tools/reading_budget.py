"""Reading time of each notebook by the series' one rule (CONTRIBUTING.md, "Reading budgets").

    python tools/reading_budget.py            # one line per notebook, then the core total
    python tools/reading_budget.py --check    # exit 1 if a budget or a stated figure is off
    python tools/reading_budget.py --write    # set each first cell's "about N minutes" to the rule

The rule: Markdown prose at 200 words a minute (HTML tags dropped), code cells and printed
source (an output of 8 lines or more with 3 or more lines of Python structure) at 100, other
text outputs at 150, 3/4 minute a figure. Folded cells count like any other. A notebook's first
cell states the figure as "Reading time: about N minutes"; ``--check`` wants N within 10 % of the
tool's figure (or 0.5 min, the rounding of a short one), the core path within ``CORE_TOTAL``
minutes, no core notebook over its cap in ``CAPS`` (none over ``CORE_MAX``).
``tests/notebooks/test_reading_budget.py`` runs it.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_TOTAL, CORE_MAX = 150, 25   # minutes: the core path, one core notebook
#: Each core notebook's own cap, in minutes (issue 44's plan; 09 is new this round).
CAPS = {"00": 10, "01": 14, "02": 15, "03": 15, "04": 22, "05": 13, "06": 17, "07": 16, "08": 14,
        "09": 12}
STATED = re.compile(r"Reading time:\s+about\s+(\d+)\s+minutes?")
_PYTHON = re.compile(r"\s*(def |class |return |import |from \S+ import|@|for .* in .*:|if .*:"
                     r"|with .*:)")


def _words(text: str) -> int:
    return len(text.split())


def looks_like_source(text: str) -> bool:
    """True for a printed output that reads as Python source (8+ lines, 3+ of them structure)."""
    lines = text.splitlines()
    return len(lines) >= 8 and sum(bool(_PYTHON.match(line)) for line in lines) >= 3


def budget(path: Path) -> dict:
    """Words by kind, figures, ``minutes`` (one decimal) and the first cell's ``stated`` figure
    (None when it states none) of the notebook at ``path``."""
    cells = json.loads(Path(path).read_text())["cells"]
    n = dict(prose=0, code=0, source=0, out=0, figs=0)
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            n["prose"] += _words(re.sub(r"<[^>]+>", " ", text))
        if cell["cell_type"] != "code":
            continue
        n["code"] += _words(text)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            figure = "image/png" in data
            n["figs"] += figure or "image/svg+xml" in data
            shown = "".join(out.get("text", "")) or ("" if figure else
                                                      "".join(data.get("text/plain", "")))
            n["source" if looks_like_source(shown) else "out"] += _words(shown)
    minutes = (n["prose"] / 200 + (n["code"] + n["source"]) / 100 + n["out"] / 150
               + 0.75 * n["figs"])
    m = STATED.search("".join(cells[0]["source"])) if cells else None
    path = Path(path).resolve()
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    return dict(path=shown, **n, minutes=round(minutes, 1),
                stated=int(m.group(1)) if m else None)


def core_paths() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


def deep_paths() -> list[Path]:
    return sorted((ROOT / "notebooks" / "deep").glob("*.ipynb"))


def problems(core: list[dict], deep: list[dict]) -> list[str]:
    """What ``--check`` refuses, one line each (empty: all within the rule)."""
    bad = []
    for r in core + deep:
        slack = max(0.1 * r["minutes"], 0.5)
        if r["stated"] is None or abs(r["stated"] - r["minutes"]) > slack:
            bad.append(f"{r['path']}: states {r['stated']} min, the rule gives {r['minutes']}")
    for r in core:
        cap = min(CORE_MAX, CAPS.get(Path(r["path"]).name[:2], CORE_MAX))
        if r["minutes"] > cap:
            bad.append(f"{r['path']}: {r['minutes']} min > its cap, {cap}")
    total = sum(r["minutes"] for r in core)
    if total > CORE_TOTAL:
        bad.append(f"core path: {total:.1f} min > {CORE_TOTAL}")
    return bad


def write_stated(path: Path) -> bool:
    """Set the first cell's "Reading time: about N minutes" to the rule's figure, rounded.
    Returns whether the notebook changed (a first cell without the phrase is left alone)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    n = max(1, round(budget(path)["minutes"]))
    new = STATED.sub(f"Reading time: about {n} minutes", nb.cells[0].source, count=1)
    if new == nb.cells[0].source:
        return False
    nb.cells[0].source = new
    nbformat.write(nb, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a figure is off")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="restate each first cell's figure")
    opts = p.parse_args(argv)
    if opts.write:
        changed = [q.name for q in core_paths() + deep_paths() if write_stated(q)]
        print("restated:", ", ".join(changed) or "none")
    core, deep = [budget(q) for q in core_paths()], [budget(q) for q in deep_paths()]
    if opts.json:
        print(json.dumps(dict(core=core, deep=deep)))
    else:
        for r in core + deep:
            print(f"{r['path']}: {r['minutes']} min (stated {r['stated']}); prose {r['prose']}, "
                  f"code {r['code']}, source {r['source']}, out {r['out']}, figs {r['figs']}")
        print(f"core path: {sum(r['minutes'] for r in core):.1f} min")
    bad = problems(core, deep) if opts.check else []
    print(*bad, sep="\n", file=sys.stderr) if bad else None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
