"""The quick tier holds itself (tests/tiers.py): the slow list names real tests, the guard
refuses every way of starting a process, and the markers are registered."""

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


def test_every_slow_entry_names_an_existing_test_file_and_function():
    assert tiers.SLOW, "the slow list is empty"
    assert tiers.stale_entries() == []


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


def test_slow_lookup_by_file_function_and_class():
    assert tiers.is_listed_slow(tiers.TESTS / "launch/test_preemption.py", {"anything"})
    train = tiers.TESTS / "train/test_train.py"
    assert tiers.is_listed_slow(train, {"test_two_process_training_run", "TestMultiProcess"})
    assert not tiers.is_listed_slow(train, {"test_defaults", None})
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
