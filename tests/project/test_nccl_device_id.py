"""Every ``init_process_group`` that can pick NCCL passes ``device_id`` (issue 40).

Without ``device_id`` NCCL forms its communicator lazily, at the first collective, so a missing
peer or an NCCL error surfaces there and not in ``init_process_group``; with it torch calls
``ncclCommInit*`` at once (torch/distributed/distributed_c10d.py, ``init_process_group``'s
``device_id`` and ``eager_connect_single_device``). gloo needs nothing: ProcessGroupGloo
connects the full mesh while the group is created (docs/pitfalls.md C7).

The scan covers the package's Python (what notebooks print with ``inspect.getsource``), the
notebooks' code cells, the Python blocks and the inline code of README.md, CONTRIBUTING.md,
docs/*.md and the notebooks' Markdown. A call is exempt when its backend is the literal
``"gloo"``; a call with ``**kwargs`` counts as passing ``device_id`` when its function sets
``"device_id"`` in them. The seed as it was given (seed v0–v2 and the prose that quotes it)
is exempt: its set-up is one of the defects docs/seed.md lists, repaired in seed v3.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from ddp_lesson import seedfix

ROOT = Path(__file__).resolve().parents[2]

#: (file, reason): files whose calls are exempt as a whole
EXEMPT_FILES = {
    "ddp_lesson/seedfix/seed_v0.py": "the seed as given (docs/seed.md), repaired in v3",
    "ddp_lesson/seedfix/seed_v1.py": "the seed before the set-up step (docs/seed.md)",
    "ddp_lesson/seedfix/seed_v2.py": "the seed before the set-up step (docs/seed.md)",
}
#: (file, inline code span): prose that quotes the seed's own set-up
EXEMPT_SPANS = {
    ("docs/seed.md", 'init_process_group(backend="nccl")'),
    ("notebooks/06_training_the_seed_model.ipynb", 'init_process_group(backend="nccl")'),
    ("notebooks/deep/06_the_seed_repaired.ipynb", 'init_process_group(backend="nccl")'),
}


def _calls_without_device_id(source: str) -> list[str]:
    """``init_process_group`` calls in Python ``source`` that can pick NCCL, lacking device_id."""
    tree = ast.parse(source)
    bad = []
    for func in [tree, *(n for n in ast.walk(tree)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        sets_device_id = any(isinstance(n, ast.Constant) and n.value == "device_id"
                             for n in ast.walk(func))
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) == "init_process_group"):
                continue
            backend = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "backend"), None)
            if isinstance(backend, ast.Constant) and backend.value == "gloo":
                continue
            names = {k.arg for k in node.keywords}
            if "device_id" in names or (None in names and sets_device_id):
                continue
            bad.append(ast.unparse(node))
    return sorted(set(bad))


def _python_sources():
    for path in sorted((ROOT / "ddp_lesson").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text()
    for version in seedfix.VERSIONS:  # seed_v1 ... seed_v9 are made from seed_v0
        if not seedfix.path(version).is_file():
            yield f"ddp_lesson/seedfix/{version}.py", seedfix.source(version)
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                # magics and shell lines are not Python: blank them, keep the line numbers
                lines = ["" if line.lstrip().startswith(("%", "!")) else line
                         for line in cell.source.splitlines()]
                yield f"{path.relative_to(ROOT)} cell {i}", "\n".join(lines)
    for path, text in _markdown():
        for j, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            yield f"{path} python block {j}", block


def _markdown():
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                 *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        yield str(path.relative_to(ROOT)), text


def test_every_python_init_process_group_that_can_pick_nccl_passes_device_id():
    found, bad = 0, []
    for where, source in _python_sources():
        if where in EXEMPT_FILES or "init_process_group" not in source:
            continue
        found += 1
        bad += [f"{where}: {call}" for call in _calls_without_device_id(source)]
    assert found >= 10, found  # the scan sees the package's calls
    assert not bad, "init_process_group that can pick NCCL, without device_id:\n" + "\n".join(bad)


def test_every_documented_init_process_group_call_passes_device_id():
    bad = []
    for where, text in _markdown():
        for span in re.findall(r"`([^`\n]*init_process_group\([^`\n]*\))[^`\n]*`", text):
            if (where, span) in EXEMPT_SPANS or '"gloo"' in span or "device_id" in span:
                continue
            bad.append(f"{where}: {span}")
    assert not bad, "documented init_process_group without device_id:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, flagged", [
    ('dist.init_process_group("nccl")', True),
    ('dist.init_process_group(backend)', True),
    ('dist.init_process_group()', True),  # no backend: NCCL for CUDA tensors where there is CUDA
    ('dist.init_process_group("gloo")', False),
    ('dist.init_process_group(backend="gloo", timeout=t)', False),
    ('dist.init_process_group("nccl", device_id=device)', False),
    ('kwargs = {}\nkwargs["device_id"] = d\ndist.init_process_group(b, **kwargs)', False),
    ('kwargs = {}\ndist.init_process_group(b, **kwargs)', True),
])
def test_the_scan_tells_which_calls_can_pick_nccl_without_device_id(source, flagged):
    assert bool(_calls_without_device_id(source)) is flagged
