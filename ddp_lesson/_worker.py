"""Bootstrap that :func:`ddp_lesson.launch.run_torchrun` puts between torchrun and your code.

torchrun starts ``python -u -m ddp_lesson._worker OUTDIR (--module NAME | --script PATH) ARGS...``
once per rank. Before running the real target this:

1. sends fds 1 and 2 (C++ and child processes too) to ``OUTDIR/rank{RANK}.out`` / ``.err``,
   line-buffered, for the launcher's rank-ordered output and live progress;
2. appends its pid (also its process group's id, which the watchdog kills:
   :func:`ddp_lesson.procs.watch`) to ``OUTDIR/rank{RANK}.pid`` and dies with torchrun
   (``PR_SET_PDEATHSIG``: torchrun gives every worker a session of its own);
3. when the target fails, first writes ``OUTDIR/rank{RANK}.exit`` (exit code,
   ``time.time_ns()``), so the launcher knows every failed rank and which failed first (a peer
   waiting in a collective fails only once the failed rank's process ended, after its record);
   an exception with ``is_consequence = True`` (``Rank0Error``) is marked `` consequence``.

Then it runs the target as ``python -m NAME`` / ``python PATH`` would, in a ``__main__`` module
kept in ``sys.modules`` (atexit handlers, pickling). A successful run ends in the order of
Python's shutdown (threads joined, executors drained, ``atexit``, every open file flushed), then
``os._exit``: the interpreter's teardown can make gloo abort ("terminate called without an active
exception", pytorch/pytorch#179291; about one run in twenty here). Only ``__del__`` of objects
alive at exit is skipped, which Python does not promise either (its data model). Failures exit as
usual. Kept free of heavy imports: it runs before torch is imported.
"""
from __future__ import annotations

import atexit
import gc
import io
import os
import runpy
import sys
import threading
import time
import types

from .procs import die_with_parent


def _redirect(outdir: str, rank: str) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    try:  # a failure recorded by an earlier attempt of this rank is not this attempt's
        os.unlink(os.path.join(outdir, f"rank{rank}.exit"))
    except FileNotFoundError:
        pass
    for fd, suffix in ((1, "out"), (2, "err")):
        path = os.path.join(outdir, f"rank{rank}.{suffix}")
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    if restart:
        print(f"[restart {restart}]")
    with open(os.path.join(outdir, f"rank{rank}.pid"), "a") as f:
        f.write(f"{os.getpid()}\n")


def _is_consequence(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it was raised from or during) says it only passes on
    a peer's failure (``is_consequence = True``, as :class:`ddp_lesson.checkpoint.Rank0Error`
    does)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if getattr(exc, "is_consequence", False) is True:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _record_exit(outdir: str, rank: str, code, exc: BaseException | None = None) -> None:
    """Write this rank's failing exit code and the time (ns since the epoch, one host's clock)
    to ``OUTDIR/rank{RANK}.exit`` as ``"CODE TIME_NS"``, plus ``" consequence"`` when the
    exception passes on a peer's failure (:func:`_is_consequence`); read by the launcher."""
    code = code if isinstance(code, int) else 1
    mark = " consequence" if _is_consequence(exc) else ""
    try:
        with open(os.path.join(outdir, f"rank{rank}.exit"), "w") as f:
            f.write(f"{code} {time.time_ns()}{mark}")
    except OSError:
        pass


def _run_as_main(kind: str, target: str, args: list[str]) -> None:
    """Run ``target`` in a fresh ``__main__`` module, as ``python PATH`` / ``python -m NAME``."""
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module  # stays: atexit handlers and pickle look it up
    if kind == "--module":
        mod_name, spec, code = runpy._get_module_details(target)
        sys.argv = [spec.origin, *args]
        runpy._run_code(code, main_module.__dict__, None, "__main__", spec, spec.parent, None)
    else:
        # python PATH puts the script's folder first on sys.path, not the working directory
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        with open(target, "rb") as f:
            code = compile(f.read(), target, "exec")
        sys.argv = [target, *args]
        try:
            runpy._run_code(code, main_module.__dict__, None, "__main__", None, None, target)
        finally:  # as CPython's own script runner does (pythonrun.c): atexit sees no __file__
            main_module.__dict__.pop("__file__", None)
            main_module.__dict__.pop("__cached__", None)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("--module", "--script"):
        raise SystemExit("usage: python -m ddp_lesson._worker OUTDIR "
                         "(--module NAME | --script PATH) [ARGS...]")
    outdir, kind, target, args = argv[0], argv[1], argv[2], argv[3:]
    this_module = sys.modules["__main__"]  # noqa: F841 (kept alive while __main__ is replaced)
    die_with_parent()
    rank = os.environ.get("RANK", "0")
    _redirect(outdir, rank)
    try:
        _run_as_main(kind, target, args)
    except SystemExit as e:
        if e.code not in (None, 0):
            _record_exit(outdir, rank, e.code, e)
            raise
    except BaseException as e:
        _record_exit(outdir, rank, 1, e)
        raise
    _finish()


def _finish() -> None:
    """Leave a successful run as Python's shutdown would, minus teardown (module docstring)."""
    threading._shutdown()  # join non-daemon threads; executors finish their queued work
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # what teardown would flush: every open buffered file
        # type(obj), not isinstance: a lazy module proxy can warn when its __class__ is read
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
