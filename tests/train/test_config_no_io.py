"""``ddp_lesson/config.py`` parses and derives, nothing else (issue 42): no file, folder,
data set or checkpoint is read or written there, so following one run never jumps into it for
I/O. Read with ``ast``: the module may import only the standard library's parsing and
arithmetic modules and the package's pure modules, never calls ``open``, and builds every
config of a command line without touching the disk.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from ddp_lesson import config

SOURCE = Path(config.__file__)
#: what config.py may import: parsing, arithmetic, and the package's constants and layout maths
ALLOWED = {"__future__", "argparse", "dataclasses", "math", "re", "sys",
           "env", "gradients", "layout", "models"}
#: modules that read or write the disk, or load data sets and checkpoints
IO_MODULES = {"os", "pathlib", "tempfile", "shutil", "io", "glob", "torch", "checkpoint",
              "data", "train"}


def _imports(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    return names


def test_config_imports_no_io_module_and_calls_no_open():
    tree = ast.parse(SOURCE.read_text())
    imported = _imports(tree)
    assert imported <= ALLOWED, f"config.py imports {sorted(imported - ALLOWED)}"
    assert not imported & IO_MODULES
    calls = {n.func.id for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "open" not in calls


def test_parsing_and_deriving_touch_no_file(tmp_path, monkeypatch):
    """A missing --out and --data-root stay missing: parsing reads and makes nothing."""
    monkeypatch.chdir(tmp_path)
    out, root = tmp_path / "out", tmp_path / "no-such-root"
    cfg = config.parse_config(["--out", str(out), "--data-root", str(root), "-b", "4"])
    d = config.derived_values(cfg, world_size=2)
    assert (d["global_batch"], d["steps_per_epoch"]) == (8, 128)  # 1024 / 8
    assert not out.exists() and not root.exists() and os.listdir(tmp_path) == []


def test_the_check_would_catch_todays_io():
    """The import check rejects what config.py held before (os, tempfile, data, checkpoint)."""
    old = ast.parse("import os\nimport tempfile\nfrom .data import make_datasets\n"
                    "from .checkpoint import load_checkpoint\n")
    assert _imports(old) & IO_MODULES == {"os", "tempfile", "data", "checkpoint"}
