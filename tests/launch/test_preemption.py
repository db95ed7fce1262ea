"""A job stopped from outside (SIGTERM, as a scheduler preempting it does, or SIGINT as the
Jupyter stop button does): no process is left behind, the latest complete checkpoint loads,
and the next launch works at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_lesson.launch import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TINY = ["--size", "32", "64", "--width", "8", "--num-train", "64", "--num-val", "8", "-b", "2",
        "--epochs", "500", "--checkpoint-every-steps", "2"]  # far longer than the test waits


def _processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_sigterm_to_the_cli_ends_every_process_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "preempted"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DDP_LESSON_BACKEND", None)
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddp_lesson.cli",
            "train",
            "--nproc-per-node",
            "2",
            *TINY,
            "--out",
            str(out),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = out / "checkpoint.pt"
    _wait_for(lambda: ckpt.exists(), 90, "a first checkpoint")
    time.sleep(0.5)  # let training go on, perhaps into the next checkpoint write
    assert len(_processes_mentioning(str(out))) >= 3  # cli, torchrun and 2 workers (at least)
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=60) != 0
    _wait_for(lambda: not _processes_mentioning(str(out)), 20, "every process of the job to end")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)  # complete, loadable
    # every checkpoint is taken at a multiple of 2 steps (epoch ends too: 16 steps an epoch)
    assert state["global_step"] >= 2 and state["global_step"] % 2 == 0


def test_next_launch_works_at_once_after_an_interrupt(tmp_path):
    worker = tmp_path / "sleeper.py"
    worker.write_text(
        "import os, sys, time\n"
        "open(os.path.join(os.path.dirname(__file__), 'started' + os.environ['RANK']), 'w')"
        ".close()\n"
        "time.sleep(600)\n"
    )
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as a notebook kernel has\n"
        "from ddp_lesson.launch import run_torchrun\n"
        "try:\n"
        f"    run_torchrun({str(worker)!r}, nproc_per_node=2, timeout=300, live=False)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, str(driver)])
    _wait_for(lambda: all((tmp_path / f"started{r}").exists() for r in (0, 1)), 60, "both workers")
    # its 2 workers (the agent, forked from the launcher's fork server, runs under that
    # server's command line: multiprocessing.forkserver)
    assert len(_processes_mentioning(str(worker))) >= 2
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert _processes_mentioning(str(worker)) == []
    result = run_torchrun(code="import os; print('again', os.environ['RANK'])", nproc_per_node=2,
                          timeout=60, live=False)
    assert result.stdout.splitlines() == ["[rank 0] again 0", "[rank 1] again 1"]
