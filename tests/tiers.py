"""The quick tier's guard: a test not marked ``slow`` may not start a process.

``pytest -m "not slow"`` runs every single-process test (CONTRIBUTING.md, "Tests"). A test is
``slow`` when it starts a process: a torchrun launch, a process group in a subprocess, a
JupyterLab server or a browser, a script run with ``sys.executable``. Each test file marks its
own: ``pytestmark = pytest.mark.slow`` for a file whose every test is slow, else
``@pytest.mark.slow`` on the function or class. nbval's notebook replays are ``slow`` too
(``notebooks/conftest.py`` marks them).

A test not marked slow that starts a process fails, naming itself and the command
(:func:`no_process_starts`, active during the setup and call of every test not marked slow, so a
module-scoped fixture that launches torchrun counts against the first test that needs it).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import re
import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_POPEN = subprocess.Popen  # the real class, whatever a test later puts in its place

#: Short-lived system tools that libraries call on their own (``platform`` runs ``uname``,
#: ``ctypes.util.find_library`` runs ``ldconfig``, matplotlib runs ``fc-list``): starting one of
#: these is not a test starting a process.
TOOLS = frozenset({"uname", "ldconfig", "fc-list", "gcc", "cc", "ld", "objdump", "git"})


@functools.cache
def reads_notebooks(path: Path) -> bool:
    """Whether the test file at ``path`` reads the notebooks' stored files: it imports
    ``notebook_cells`` or ``nbformat``, or names an ``.ipynb`` (the ``notebook`` marker)."""
    if path.suffix != ".py" or TESTS not in path.resolve().parents:
        return False
    return re.search(r"notebook_cells|nbformat|\.ipynb", path.read_text()) is not None


def _command_name(args) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    first = os.fsdecode(first)
    return os.path.basename(first.split()[0]) if first.strip() else ""


class _Guard:
    """What :func:`no_process_starts` patches, and the test it reports against."""

    def __init__(self, test: str, fail):
        self.test, self.fail, self.started = test, fail, []

    def refuse(self, what: str):
        self.started.append(what)
        self.fail(f"{self.test} starts a process ({what}) but is not marked slow: add it to "
                  "@pytest.mark.slow (or pytestmark = pytest.mark.slow in its file: the "
                  "quick tier, pytest -m 'not slow', runs no process)")


@contextlib.contextmanager
def no_process_starts(test: str, fail):
    """Within the block, starting a process calls ``fail(message)`` (``pytest.fail``) instead.

    Covers ``subprocess`` (so ``asyncio`` subprocesses and Playwright's driver too),
    ``multiprocessing`` and ``torch.multiprocessing`` processes, ``os.fork``, ``os.forkpty``,
    ``os.posix_spawn[p]`` and ``os.system``, from any thread. :data:`TOOLS` are let through.
    Yields the guard; ``guard.started`` lists what was refused (a test that swallowed the
    failure still fails on it).
    """
    guard = _Guard(test, fail)
    # The class itself, as imported: a test may replace ``subprocess.Popen`` (monkeypatch) while
    # the guard is active, and restoring ``_execute_child`` on the replacement instead of the
    # class would leave the guard installed for every later test.
    popen = _POPEN
    original_child = popen._execute_child
    original_start = multiprocessing.process.BaseProcess.start
    originals = {name: getattr(os, name) for name in
                 ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system") if hasattr(os, name)}

    def execute_child(self, args, *rest, **kwargs):
        if _command_name(args) not in TOOLS:
            guard.refuse(f"subprocess {_shown(args)}")
        return original_child(self, args, *rest, **kwargs)

    def start(self):
        guard.refuse(f"multiprocessing {type(self).__name__}")

    def refusing(name):
        def refused(*args, **kwargs):
            guard.refuse(f"os.{name}({repr(args[0])[:120] if args else ''})")
        return refused

    popen._execute_child = execute_child
    multiprocessing.process.BaseProcess.start = start
    for name in originals:
        setattr(os, name, refusing(name))
    try:
        yield guard
    finally:
        popen._execute_child = original_child
        multiprocessing.process.BaseProcess.start = original_start
        for name, fn in originals.items():
            setattr(os, name, fn)


def _shown(args) -> str:
    text = repr(args if isinstance(args, (str, bytes)) else list(args))
    return text if len(text) <= 120 else text[:117] + "..."
