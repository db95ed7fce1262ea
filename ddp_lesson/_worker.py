"""Bootstrap that :func:`ddp_lesson.launch.run_torchrun` puts between torchrun and your code.

torchrun starts ``python -m ddp_lesson._worker OUTDIR (--module NAME | --script PATH) ARGS...``
once per rank. Before running the real target this:

1. sends the rank's stdout and stderr (file descriptors 1 and 2, so C++ and child-process
   output too) to ``OUTDIR/rank{RANK}.out`` / ``.err``, line-buffered, so the launcher can show
   each rank's output grouped in rank order and follow progress live;
2. records its pid in ``OUTDIR/rank{RANK}.pid`` and asks Linux to kill it if torchrun dies
   (``PR_SET_PDEATHSIG``): torchrun starts every worker in a session of its own, so without
   this a SIGKILL to the launcher alone would leave orphans.

Then it runs the target as ``__main__``, exactly as ``python -m NAME`` / ``python PATH`` would.
When the target finishes normally, the process runs its ``atexit`` handlers, flushes its output
and leaves with ``os._exit``: skipping the interpreter's teardown avoids a known gloo abort
(a DDP reducer still holding a process group whose worker threads are torn down at exit,
"terminate called without an active exception", pytorch/pytorch#179291), seen here in about
one run in twenty, after all output was printed. Failures exit as usual, with their traceback.
Kept free of heavy imports: it runs before torch is imported.
"""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys


#: ``prctl`` option: the signal this process gets when the thread that forked it dies.
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``).

    Used twice by the launcher: in the torchrun child before it execs (so torchrun dies with
    the notebook kernel) and here, in every worker (so workers die with torchrun). The parent
    may have died between fork and ``prctl``: then this process is already an orphan and
    leaves at once. ``parent_pid`` is the expected parent (None: only "not reparented to
    init" is checked). Does nothing outside Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    ppid = os.getppid()
    if ppid == 1 or (parent_pid is not None and ppid != parent_pid):
        os._exit(1)


def _redirect(outdir: str, rank: str) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    for fd, suffix in ((1, "out"), (2, "err")):
        path = os.path.join(outdir, f"rank{rank}.{suffix}")
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    if restart:
        print(f"[restart {restart}]")
    with open(os.path.join(outdir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("--module", "--script"):
        raise SystemExit("usage: python -m ddp_lesson._worker OUTDIR "
                         "(--module NAME | --script PATH) [ARGS...]")
    outdir, kind, target, args = argv[0], argv[1], argv[2], argv[3:]
    die_with_parent()
    _redirect(outdir, os.environ.get("RANK", "0"))
    sys.argv = [target, *args]
    try:
        if kind == "--module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    _finish()


def _finish() -> None:
    """Leave a successful run without interpreter teardown (see the module docstring)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
