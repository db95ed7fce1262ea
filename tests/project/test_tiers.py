"""The quick tier holds itself (tests/tiers.py): the guard refuses every way of starting a
process, the markers are registered, and tools/slow_markers.py writes an old central list of
slow tests as markers."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys

import pytest
import tiers


class Refused(Exception):
    pass


def _refuse(message):
    raise Refused(message)


def test_no_central_slow_list_is_left():
    """A branch merged with the old list (tests/tiers.py SLOW) marks nothing: convert it with
    tools/slow_markers.py (its docstring says how)."""
    assert not getattr(tiers, "SLOW", None), "run tools/slow_markers.py on the merged SLOW list"


def test_slow_markers_writes_the_old_list_as_markers(tmp_path):
    sys.path.insert(0, str(tiers.TESTS.parent / "tools"))
    try:
        import slow_markers
    finally:
        sys.path.pop(0)
    (tmp_path / "a").mkdir()
    (tmp_path / "a/test_all.py").write_text(
        "import os\n\npytestmark = pytest.mark.timeout(9)\n\n\ndef test_x():\n    pass\n")
    (tmp_path / "a/test_some.py").write_text(
        '"""Doc."""\nimport os\n\n\n@deco\ndef test_a():\n    pass\n\n\n'
        "class TestB:\n    def test_c(self):\n        pass\n\n\ndef test_d():\n    pass\n")
    slow = {"a/test_all.py": "*", "a/test_some.py": {"test_a", "TestB", "test_gone"}}
    problems = slow_markers.apply(slow, "*", tmp_path)
    assert problems == ["a/test_some.py::test_gone: no such test"]
    assert "pytestmark = [pytest.mark.slow, pytest.mark.timeout(9)]" in (
        tmp_path / "a/test_all.py").read_text()
    some = (tmp_path / "a/test_some.py").read_text()
    assert some.startswith('"""Doc."""\nimport pytest\nimport os\n')
    assert "@pytest.mark.slow\n@deco\ndef test_a" in some
    assert "@pytest.mark.slow\nclass TestB" in some and some.count("mark.slow") == 2
    slow_markers.apply(slow, "*", tmp_path)  # idempotent
    assert (tmp_path / "a/test_some.py").read_text() == some


def test_every_test_that_starts_a_process_here_is_marked_slow():
    """Spot check of the conversion: files whose every test launches torchrun are marked."""
    import ast

    for rel in ("launch/test_preemption.py", "train/test_train_resize.py", "zero/test_fsdp.py"):
        tree = ast.parse((tiers.TESTS / rel).read_text())
        marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "pytestmark"]
        assert any("pytest.mark.slow" in m for m in marks), rel


def test_the_guard_refuses_a_subprocess_a_multiprocessing_process_and_os_calls():
    original = subprocess.Popen._execute_child
    with tiers.no_process_starts("t", _refuse) as guard:
        with pytest.raises(Refused, match=r"^t starts a process \(subprocess \[.*'-c', 'pass'\]"):
            subprocess.run([sys.executable, "-c", "pass"])
        with pytest.raises(Refused, match=r"multiprocessing SpawnProcess\) but is not marked slow"):
            multiprocessing.get_context("spawn").Process(target=print).start()
        with pytest.raises(Refused, match=r"os\.system\('true'\)"):
            os.system("true")
        with pytest.raises(Refused, match=r"os\.fork\(\)"):
            os.fork()
    assert len(guard.started) == 4
    assert subprocess.Popen._execute_child is original  # restored on leaving the block


def test_system_tools_libraries_call_are_let_through():
    assert tiers._command_name(["uname", "-p"]) in tiers.TOOLS
    assert tiers._command_name("/sbin/ldconfig -p") in tiers.TOOLS
    assert tiers._command_name([sys.executable, "-m", "torch.distributed.run"]) not in tiers.TOOLS


def test_notebook_marker_lookup():
    assert tiers.reads_notebooks(tiers.TESTS / "notebooks/test_stored_notebooks.py")
    assert not tiers.reads_notebooks(tiers.TESTS / "sampler/test_sampler.py")


def test_slow_and_notebook_markers_are_registered_in_pyproject():
    text = (tiers.TESTS.parent / "pyproject.toml").read_text()
    markers = re.search(r"^markers = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    assert markers, "no markers list in pyproject.toml"
    for name in ("gpu", "slow", "notebook"):
        assert re.search(rf'^\s+"{name}: ', markers.group(1), re.MULTILINE), name


def test_the_guard_comes_off_the_real_class_when_a_test_replaced_popen(monkeypatch):
    """A test that monkeypatches ``subprocess.Popen`` while guarded (test_bad_input does): the
    guard must leave the real class as it found it, or every later test in the worker is blamed
    on that one."""
    import subprocess

    real, before = subprocess.Popen, subprocess.Popen._execute_child
    with tiers.no_process_starts("t", lambda msg: None):
        monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: None)
    monkeypatch.undo()
    assert subprocess.Popen is real
    assert subprocess.Popen._execute_child is before


def test_the_pytest_process_refuses_a_process_group():
    """tests/conftest.py: a gloo group's teardown can deadlock in a long-lived pytest process
    (a worker hung in it for 40 minutes), so a group lives only in a world_of_one test's own
    process."""
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match="world_of_one"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_the_run_summary_lists_failures_errors_and_skips():
    # addopts' -r replaces pytest's default -rfE (_pytest/terminal.py: --report-chars is a
    # "store" option with default "fE"): -rs alone ended a failing run with skips, no FAILED
    from pathlib import Path

    import tomllib
    from _pytest.config import get_config
    from _pytest.terminal import getreportopt

    root = Path(__file__).resolve().parents[2]
    ini = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    config = get_config()
    args = config._parser.parse_known_args(ini["addopts"].split())
    config.option.reportchars = args.reportchars
    config.option.disable_warnings = False
    chars = getreportopt(config)
    assert {"f", "E", "s"} <= set(chars), f"addopts -r gives summary chars {chars!r}"
