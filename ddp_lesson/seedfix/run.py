"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.seedfix.run seed_v0

Run one version of the seed (``seed_v0`` ... ``seed_v10``) as ``python -m`` runs it, and say in
one line how it ended, where the program itself would end in a traceback.

Each rank runs the version's module as ``__main__`` (:func:`runpy.run_module`), with the
arguments after the version's name, so the program's own lines print as they would. Its
stderr is kept aside while it runs (the file descriptor too, where torch's C++ code writes
its warnings) and written back to stderr afterwards. Then come one line per distinct warning
found there, ``warning (reducer.cpp): <the warning's first clause>``, and the ending:
``finished``, ``exited 2: <the last line the program wrote to stderr>`` (argparse's error),
or ``crashed at seed_v0.py:32: NameError: ...``, at the program's own line nearest the error.
Where NCCL cannot start, torch's words and exception class depend on the build (a CPU build and
a CUDA build without a GPU differ: :data:`NCCL_UNAVAILABLE`), so that ending is one line that
holds for every build, :data:`NO_NCCL`. The program's traceback goes to stderr, with torch's
own message (``%%torchrun --show-stderr`` shows it).
A process group the crashed program left open is destroyed, and the process ends with exit
status 0, so a notebook cell that runs it shows these lines and the next cell runs. Run the
version's module directly (``-m ddp_lesson.seedfix.seed_v0``) for the program's own exit
status and traceback.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
import tempfile
import traceback

from ..env import group_active
from . import last_own_frame, path

#: A warning line as Python (``file.py:12: UserWarning: ...``) or torch's C++ code
#: (``[W... reducer.cpp:1529] Warning: ...``) writes it.
WARNING = re.compile(r"(?P<file>[\w.-]+\.(?:py|cpp|cc|h|hpp)):\d+\]?:? \w*Warning: (?P<msg>.+)")


#: torch's words when ``init_process_group("nccl")`` cannot start NCCL, by build and version:
#: a CPU build has no NCCL (``RuntimeError`` from ``_new_process_group_helper`` in
#: ``torch/distributed/distributed_c10d.py``); a CUDA build on a machine without a GPU has NCCL
#: but no device for it: torch 2.14.1+cu130 raises ``ValueError`` from ``ProcessGroupNCCL``'s
#: constructor (C++, ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``), torch 2.15.0+cu132
#: ``RuntimeError`` from ``_nccl2_device`` in ``distributed_c10d.py`` (both seen by a run).
NCCL_UNAVAILABLE = ("Distributed package doesn't have NCCL built in",
                    "ProcessGroupNCCL is only supported with GPUs, no GPUs found!",
                    "nccl2 requires at least one CUDA device")
#: The ending printed for either, the same on every build.
NO_NCCL = "NCCL cannot start here (no NCCL in this torch, or no GPU)"


def nccl_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is torch saying that NCCL cannot start on this machine, in the words of
    any build (:data:`NCCL_UNAVAILABLE`)."""
    return any(words in str(exc) for words in NCCL_UNAVAILABLE)


def warnings_in(text: str) -> list[tuple[str, str]]:
    """``(file, first clause)`` of each distinct warning line in ``text``, in order; the
    clause is the message up to its first ", " (the rest explains it)."""
    found: list[tuple[str, str]] = []
    for m in WARNING.finditer(text):
        item = (m.group("file"), m.group("msg").split(", ")[0].strip().rstrip("."))
        if item not in found:
            found.append(item)
    return found


class _Captured:
    text = ""


@contextlib.contextmanager
def captured_stderr():
    """Keep what is written to stderr, by Python (``sys.stderr``) and at file descriptor 2
    (C and C++ code), while the block runs; ``.text`` holds it afterwards, and it is written
    back to stderr. The two are kept apart (descriptor 2's text first).

    Not :mod:`ddp_lesson.launch.fdcapture`, which streams a ``%%ranks`` cell's descriptors to
    the notebook live and keeps nothing: here the text is read after the program ended (its
    warnings and last line), and a temporary file holds any amount without a reader thread."""
    box = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    python = io.StringIO()
    with tempfile.TemporaryFile() as fd_file:
        os.dup2(fd_file.fileno(), 2)
        try:
            with contextlib.redirect_stderr(python):
                yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            fd_file.seek(0)
            box.text = fd_file.read().decode(errors="replace") + python.getvalue()
    sys.stderr.write(box.text)
    sys.stderr.flush()


def _ending(exc: BaseException | None, err: str, version: str) -> str:
    if exc is None:
        return "finished"
    if isinstance(exc, SystemExit):
        if exc.code in (0, None):
            return "finished"
        last = [line for line in err.splitlines() if line.strip()][-1:] or [str(exc.code)]
        return f"exited {exc.code}: {last[0].strip()}"
    frame = last_own_frame(exc, path(version))
    where = f" at {path(version).name}:{frame.lineno}" if frame else ""
    if nccl_unavailable(exc):
        return f"crashed{where}: {NO_NCCL}"
    message = (str(exc).splitlines() or [""])[0]
    return f"crashed{where}: {type(exc).__name__}: {message}"


def run_version(version: str, argv=()) -> str:
    """Run ``version`` as ``python -m ddp_lesson.seedfix.<version> *argv`` in this process;
    print its warnings and its ending (module docstring) and return the ending.

    Raises:
        ValueError: ``version`` is not one of ``seed_v0`` ... ``seed_v10``.
    """
    path(version)  # a clear error for an unknown name, before anything runs
    saved_argv, exc = sys.argv, None
    sys.argv = [version, *argv]
    sys.modules.pop(f"{__package__}.{version}", None)  # run afresh, as `python -m` does
    with captured_stderr() as err:
        try:
            runpy.run_module(f"{__package__}.{version}", run_name="__main__", alter_sys=True)
        except (Exception, SystemExit) as e:  # the ending is the point (Ctrl-C still stops it)
            exc = e
        finally:
            sys.argv = saved_argv
            sys.stdout.flush()
            if exc is not None and group_active():  # the group the program left open
                import torch.distributed as dist

                dist.destroy_process_group()
    if exc is not None and not isinstance(exc, SystemExit):
        traceback.print_exception(exc, file=sys.stderr)  # as `python -m` would print it
        sys.stderr.flush()
    ending = _ending(exc, err.text, version)
    for file, clause in warnings_in(err.text):
        print(f"warning ({file}): {clause}")
    print(ending)
    return ending


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        raise SystemExit("usage: python -m ddp_lesson.seedfix.run seed_vN [the program's args]")
    try:
        run_version(args[0], args[1:])
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
