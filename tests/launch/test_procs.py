"""ddp_lesson.procs: one rule for "is this pid alive", one reaper, one parent-death helper, one
watchdog (used by the launcher, the cluster, the worker bootstrap and the checkpoint sweep)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest

from ddp_lesson import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_a_dead_pid_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    assert procs.reap(p, 30.0) and p.returncode == 0
    assert not procs.alive(p.pid)
    assert not procs.alive(0) and not procs.alive(-1)  # process groups, not a process


def test_a_zombie_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # exited, not reaped: state Z
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.02)
    os.kill(p.pid, 0)  # still answers kill(0)...
    assert not procs.alive(p.pid)  # ...but is not alive
    assert procs.reap(p, 5.0)


def test_a_running_process_is_alive_and_eperm_means_alive(monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.alive(p.pid)
        assert procs.alive(os.getpid())

        def eperm(pid, sig):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(procs.os, "kill", eperm)  # another user's process
        assert procs.alive(p.pid)
    finally:
        monkeypatch.undo()
        p.kill()
        procs.reap(p, 10.0)
    assert p.returncode == -9


def test_reap_waits_a_bounded_time():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    start = time.monotonic()
    assert not procs.reap(p, 0.3) and time.monotonic() - start < 5
    p.terminate()
    assert procs.reap(p, 10.0) and p.returncode == -15


def test_die_with_parent_kills_the_child_when_its_parent_dies(tmp_path):
    """A middle process starts a grandchild with die_with_parent, then is SIGKILLed: the kernel
    kills the grandchild at once (it would otherwise be reparented and live on)."""
    pidfile = tmp_path / "child"
    middle = subprocess.Popen([sys.executable, "-c", (
        "import functools, os, subprocess, sys, time\n"
        "from ddp_lesson.procs import die_with_parent\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=functools.partial(die_with_parent, os.getpid()))\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n")], env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert procs.alive(child)
    middle.kill()
    procs.reap(middle, 10.0)
    deadline = time.monotonic() + 10
    while procs.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs.alive(child)


def test_watchdog_kills_recorded_groups_when_its_owner_dies_not_when_released(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    (folder / "agents.pid").write_text(f"{sleeper.pid}\n")
    released = procs.start_watchdog(folder)
    procs.release_watchdog(released)
    assert released.returncode == 0 and procs.alive(sleeper.pid) and folder.exists()
    owner_gone = procs.start_watchdog(folder)
    owner_gone.stdin.close()  # what the owner's death does to the pipe
    assert procs.reap(owner_gone, 20.0)
    procs.reap(sleeper, 10.0)
    assert sleeper.returncode == -9 and not folder.exists()
