"""The command line speaks the user's words: every subcommand's help lists all its flags in plain
text, and an error names the command the user typed and the flag as they typed it."""
from __future__ import annotations

import argparse
import re

import pytest

from ddp_lesson import cli, doctor
from ddp_lesson.config import build_parser


def _parsers(parser: argparse.ArgumentParser):
    """``parser`` and every sub-parser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_screen_is_plain_text_and_every_flag_explained():
    parsers = list(_parsers(cli._parser()))
    assert {p.prog for p in parsers} >= {"ddp-lesson", "ddp-lesson train", "ddp-lesson doctor",
                                         "ddp-lesson bench", "ddp-lesson bench ddp"}
    for p in parsers:
        text = p.format_help()
        assert not re.search(r"`|:(?:func|class|mod|data|meth):", text), (p.prog, text)
        bare = [a.option_strings for a in p._actions if a.option_strings and not a.help]
        assert bare == [], f"{p.prog}: flags without help: {bare}"


def test_plain_removes_restructured_text():
    assert cli.plain("The ``ddp-lesson`` command, :func:`ddp_lesson.launch.run_torchrun` "
                     "and `x`") == "The ddp-lesson command, ddp_lesson.launch.run_torchrun and x"


def test_train_help_lists_the_launcher_and_every_trainer_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    trainer = [o for a in build_parser()._actions for o in a.option_strings]
    assert {"-b", "--batch-size", "--epochs", "-j", "--lr", "--grad-accum-steps"} <= set(trainer)
    missing = [o for o in [*trainer, "--nproc-per-node", "--nnodes", "--max-restarts"]
               if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    assert missing == [], missing
    assert "-b BATCH_SIZE, --batch-size BATCH_SIZE" in text and "(default: 8)" in text


@pytest.mark.parametrize("flags, message", [
    (["-b", "0"], "-b/--batch-size must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch", "0"], "--batch-size must be >= 1, got 0"),           # argparse's abbreviation
    (["--batch-size=0"], "--batch-size must be >= 1, got 0"),
    (["-j", "-1"], "-j/--workers must be >= 0, got -1"),
    (["--static-graph", "--grad-accum-steps", "2"],
     "--static-graph with --grad-accum-steps 2: torch's DDP fails"),
    (["--local_rank", "-1"], "--local_rank must be >= 0, got -1"),
])
def test_train_errors_name_the_command_and_the_flag_as_typed(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(cli.subprocess, "Popen", lambda *a, **k: pytest.fail("process started"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--nproc-per-node", "1", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddp-lesson train: error: {message}"), err


def test_the_trainer_itself_names_its_own_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-b", "x"])
    assert "python -m ddp_lesson.train: error: argument -b/--batch-size: invalid int value: 'x'" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "ddp", "--nprocs", "0"], "ddp-lesson bench ddp: error: --nprocs needs counts >= 1"),
    (["bench", "ddp", "--nprocs", "two"], "ddp-lesson bench ddp: error: --nprocs needs whole"),
    (["bench", "ddp", "--steps", "0"], "ddp-lesson bench ddp: error: --steps must be >= 1, got 0"),
    (["bench", "allreduce", "--methods", "gloo,foo"],
     "ddp-lesson bench allreduce: error: --methods: unknown method 'foo'"),
    (["bench", "allreduce", "--repeats", "0"],
     "ddp-lesson bench allreduce: error: --repeats must be >= 1, got 0"),
    (["bench", "scaling", "--nprocs", "2"],
     "ddp-lesson bench scaling: error: --nprocs must include 1"),
    (["bench", "scaling", "--nprocs", "1,3", "--modes", "strong"],
     "ddp-lesson bench scaling: error: --global-batch 16 is not divisible by 3 processes"),
])
def test_bench_errors_name_the_command_before_any_process(argv, message, capsys, monkeypatch):
    from ddp_lesson import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message)


def test_doctor_error_names_the_command(capsys):
    assert doctor.main(["--nproc-per-node", "0"]) == 2
    assert capsys.readouterr().err == "ddp-lesson doctor: error: --nproc-per-node must be >= 1, " \
                                      "got 0\n"


@pytest.mark.parametrize("module", [
    "ddp_lesson.flight", "ddp_lesson.labs.collectives_check", "ddp_lesson.labs.ddp_pitfalls",
    "ddp_lesson.labs.zero_dcp", "ddp_lesson.labs.compile_ddp", "ddp_lesson.labs.ddp_overlap",
    "ddp_lesson.labs.torch_reducer", "ddp_lesson.labs.amp_clip", "ddp_lesson.labs.token_loss",
])
def test_the_programs_help_is_plain_text(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ")
    assert not re.search(r"`|:(?:func|class|mod|data|meth):", text), text
