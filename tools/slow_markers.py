"""Turn a central list of slow tests into ``slow`` markers in the test files themselves.

``tests/tiers.py`` once listed the slow tests (``SLOW = {"folder/test_x.py": "*" or {names}}``);
each test file now marks its own (``pytestmark = pytest.mark.slow`` for a whole file,
``@pytest.mark.slow`` on a function or class). A branch written against the old list still
adds entries to it: this tool writes them as markers. It is idempotent (a test already marked
is left as it is) and reads the list from any file that defines ``SLOW`` and ``ALL``::

    git show OTHER_BRANCH:tests/tiers.py > /tmp/tiers_old.py
    python tools/slow_markers.py /tmp/tiers_old.py      # marks what the branch listed

Prints one line per marker added; exits 1 naming an entry whose file or test does not exist.
"""
from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
MARK = "pytest.mark.slow"


def _is_slow(node: ast.expr) -> bool:
    return ast.unparse(node) == MARK


def mark_file(text: str) -> str | None:
    """``text`` with ``pytestmark`` holding ``pytest.mark.slow``; None if it already does."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
                "pytestmark"]:
            value = node.value
            items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            if any(_is_slow(v) for v in items):
                return None
            start = _offset(lines, value.lineno, value.col_offset)
            end = _offset(lines, value.end_lineno, value.end_col_offset)
            src = "".join(lines)
            if isinstance(value, ast.List):
                return src[:start + 1] + MARK + ", " + src[start + 1:]
            return src[:start] + f"[{MARK}, " + src[start:end] + "]" + src[end:]
    # no pytestmark: after the last top-level import
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    at = imports[-1].end_lineno if imports else 0
    return "".join(lines[:at]) + f"\npytestmark = {MARK}\n" + "".join(lines[at:])


def mark_tests(text: str, names) -> tuple[str, list[str], list[str]]:
    """``text`` with ``@pytest.mark.slow`` above each top-level test function or class in
    ``names``: ``(new text, names marked, names not found)``."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    found, marked = set(), []
    inserts = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name not in names:
            continue
        found.add(node.name)
        if any(_is_slow(d) for d in node.decorator_list):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        inserts.append(first - 1)
        marked.append(node.name)
    for at in sorted(inserts, reverse=True):
        lines.insert(at, f"@{MARK}\n")
    return "".join(lines), marked, sorted(set(names) - found)


def _offset(lines, lineno, col) -> int:
    return sum(len(s) for s in lines[:lineno - 1]) + len(lines[lineno - 1].encode()[:col].decode())


def _with_pytest_import(text: str) -> str:
    tree = ast.parse(text)
    if any(isinstance(n, ast.Import) and any(a.name == "pytest" for a in n.names)
           for n in tree.body):
        return text
    lines = text.splitlines(keepends=True)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    at = imports[0].lineno - 1 if imports else 0
    return "".join(lines[:at]) + "import pytest\n" + "".join(lines[at:])


def apply(slow: dict, all_marker: str, tests: Path = TESTS) -> list[str]:
    """Write ``slow``'s entries as markers into the files below ``tests``; the problems
    (missing files or tests). Prints each marker it adds."""
    problems = []
    for rel, entry in sorted(slow.items()):
        path = tests / rel
        if not path.is_file():
            problems.append(f"{rel}: no such test file")
            continue
        text = _with_pytest_import(path.read_text())
        if entry == all_marker:
            new = mark_file(text)
            if new is not None:
                print(f"{rel}: pytestmark")
                path.write_text(new)
            continue
        new, marked, missing = mark_tests(text, set(entry))
        problems += [f"{rel}::{name}: no such test" for name in missing]
        if marked:
            print(f"{rel}: {', '.join(marked)}")
            path.write_text(new)
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    module = runpy.run_path(argv[0])
    problems = apply(module["SLOW"], module.get("ALL", "*"))
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
