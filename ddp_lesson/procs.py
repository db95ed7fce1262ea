"""Processes the runtime starts: is one alive, reap it, make it die with its parent, watch a run.

One owner for four rules that the launcher (:mod:`ddp_lesson.launch`), the persistent ranks
(:mod:`ddp_lesson.cluster`), the worker bootstrap (:mod:`ddp_lesson._worker`) and the checkpoint
sweep (:mod:`ddp_lesson.checkpoint`) all need:

* :func:`alive`: a process that exists and has not exited. A zombie (exited, not yet reaped by
  its parent: ``Z`` in ``/proc/PID/stat``) is not alive: it runs nothing and holds no file or
  port. A process owned by another user (``kill(pid, 0)`` answers ``EPERM``) is alive: it exists.
* :func:`reap`: wait, bounded, for a child started with ``subprocess.Popen``.
* :func:`die_with_parent`: ``PR_SET_PDEATHSIG``, the kernel's SIGKILL when the parent dies.
* :func:`start_watchdog` / :func:`release_watchdog` / :func:`watch`: a small process that ends a
  run's processes if their owner dies without ending them (SIGKILL, a kernel restart).

Kept free of heavy imports: :mod:`ddp_lesson._worker` uses it before torch is imported.
Sources: ``kill(2)``, ``proc(5)``, ``prctl(2)`` (Linux man-pages).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

#: ``prctl`` option: the signal this process gets when the thread that forked it dies.
PR_SET_PDEATHSIG = 1


def alive(pid: int) -> bool:
    """True when process ``pid`` exists on this machine and is not a zombie (module docstring);
    where ``/proc`` cannot tell, ``kill(pid, 0)``'s answer. Non-positive pids: False."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # exited between the two looks
        return False
    except (OSError, IndexError):
        return True


def reap(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc`` to exit; True once it has been reaped (its
    ``returncode`` set). ``os.waitpid``, not ``Popen.wait``: an interrupt inside ``Popen.poll``
    can leave Popen's wait lock held, and a later ``Popen.wait()`` blocks forever."""
    wait_exit = getattr(proc, "wait_exit", None)
    if wait_exit is not None:  # a forked agent (ddp_lesson.launch.forkserver)
        return wait_exit(seconds)
    deadline = time.monotonic() + seconds
    while True:
        if proc.returncode is not None:
            return True
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (by Popen)
            return True
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


#: The C library (``ctypes.CDLL``), or None where it cannot be loaded (not Linux).
# Loaded here, in the parent: ``die_with_parent`` also runs in a child between fork and exec
# (``preexec_fn``), where loading a library could deadlock on a lock another thread held.
LIBC = _load_libc()


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``).

    In a child before exec (``preexec_fn=partial(die_with_parent, os.getpid())``) and first
    thing in every worker and engine (torchrun gives each a session of its own, out of reach
    of a group's signal). A parent already gone (not ``parent_pid``, or init when None): this
    process leaves at once. Does nothing outside Linux.
    """
    if LIBC is None:
        return
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    ppid = os.getppid()
    if ppid == 1 or (parent_pid is not None and ppid != parent_pid):
        os._exit(1)


# --------------------------------------------------------------------------- the watchdog

def folder_pids(folder: str) -> list[int]:
    """Every pid recorded in ``folder``: the files named ``*.pid``, whitespace-separated pids."""
    pids = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".pid"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                pids += [int(x) for x in f.read().split() if x.isdigit()]
        except OSError:
            continue
    return pids


def kill_pids(pids, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid's process group and to the pid itself.

    The runtime starts its children as session leaders (``start_new_session``), so a pid is
    also its group's id; a group outlives its leader while any member lives, so this reaches
    the processes a child started too. A pid already gone is skipped.
    """
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def start_watchdog(folder, env: dict | None = None) -> subprocess.Popen:
    """Start :func:`watch` on ``folder`` in a session of its own; give its pipe to nobody else.

    The caller keeps the only write end of the watchdog's stdin (``Popen`` makes it
    non-inheritable): any death of the caller closes it. End the watch with
    :func:`release_watchdog`.
    """
    return subprocess.Popen([sys.executable, "-m", "ddp_lesson.procs", "--watch", str(folder)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def release_watchdog(watchdog: subprocess.Popen | None, seconds: float = 10.0) -> None:
    """Tell the watchdog its owner ended the run itself (nothing for it to do) and reap it."""
    if watchdog is None:
        return
    try:
        watchdog.stdin.write(b"done")
        watchdog.stdin.close()
    except (OSError, ValueError):
        pass
    if not reap(watchdog, seconds):
        kill_pids([watchdog.pid])
        reap(watchdog, seconds)


def watch(folder: str) -> None:
    """The watchdog's body: wait for EOF on stdin, then end the run unless told it is done.

    Its owner holds the only write end of the pipe. It writes ``done`` when it has ended its
    processes itself; if it dies in any way (kernel restart, SIGKILL) the pipe closes with
    nothing written, and the watchdog kills every process group recorded in ``folder``
    (:func:`folder_pids`) and removes the folder. An interrupt aimed at the owner's group does
    not reach it (own session; SIGINT ignored besides).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.stdin.buffer.read().startswith(b"done"):
        return
    kill_pids(folder_pids(folder))
    time.sleep(0.5)  # then the folder: a dying process may still write into it
    kill_pids(folder_pids(folder))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--watch"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m ddp_lesson.procs --watch FOLDER")
    watch(sys.argv[2])
