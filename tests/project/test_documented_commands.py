"""Every pytest command the README, CONTRIBUTING.md and docs/ give starts (issue 40).

Each documented ``pytest ...`` line (in a code block or inline code) is parsed by pytest's own
command-line parser with this repository's ``pyproject.toml`` (its ``addopts`` included), as
``pytest`` would parse it before collecting: an option pytest does not know, or one that turns
off a plugin ``addopts`` needs (``-p no:nbval`` leaves ``--nbval`` unrecognized), fails here
with pytest's own message. Each test path it names must exist.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from _pytest.config import UsageError, _prepareconfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "CONTRIBUTING.md",
        *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def _pytest_args(line: str) -> list[str] | None:
    """The arguments after ``pytest`` (or ``python -m pytest``) in a shell line; None if none."""
    line = line.split(" # ")[0].strip()
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    if "pytest" not in words:  # pytest, python -m pytest, VAR= pytest, /usr/bin/time ... pytest
        return None
    return words[words.index("pytest") + 1:]


def documented_commands() -> list[tuple[str, str]]:
    """``(file, command)`` for every pytest command in the documents."""
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        for block in blocks:
            found += [(name, line.strip()) for line in block.splitlines()
                      if _pytest_args(line) is not None]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            span = " ".join(span.split())  # inline code wrapped over two lines
            if re.search(r"(^|\s)pytest(\s|$)", span) and _pytest_args(span) is not None:
                found.append((name, span))
    return found


def parse(args: list[str]):
    """pytest's parse of ``args`` with the repository's ini file; raises UsageError."""
    config = _prepareconfig(["--noconftest", *args])
    config._ensure_unconfigure()
    return config


def test_the_documents_give_pytest_commands():
    commands = documented_commands()
    assert ("CONTRIBUTING.md", 'pytest -m "not slow" -n 0') in commands
    assert any(name == "docs/gpus.md" and "-m gpu" in cmd for name, cmd in commands)


@pytest.mark.parametrize("name, command", documented_commands())
def test_every_documented_pytest_command_starts(name, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = _pytest_args(command)
    try:
        config = parse(args)
    except UsageError as exc:
        pytest.fail(f"{name}: `{command}` does not start: {exc}")
    for path in config.option.file_or_dir or []:
        path = path.split("::")[0]
        if "..." in path or "*" in path:
            continue
        assert (ROOT / path).exists(), f"{name}: `{command}` names {path}, which does not exist"


def test_a_command_that_cannot_start_is_caught(monkeypatch):
    """The old GPU command: ``-p no:nbval`` leaves addopts' ``--nbval`` unrecognized."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(UsageError, match="unrecognized arguments: --nbval"):
        parse(["-m", "gpu", "-p", "no:nbval", "tests/gpu/test_gpu.py"])
    assert parse(["-m", "gpu", "-n", "0", "tests/gpu"]).option.numprocesses == 0
