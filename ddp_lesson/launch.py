"""Launch real multi-process runs with torchrun, from a notebook cell or from Python.

Two faces of one launcher:

* ``run_torchrun(...)`` for scripts and tests;
* the ``%%torchrun`` cell magic (``%load_ext ddp_lesson``) for notebooks, and its line form
  ``%torchrun --nproc-per-node 2 -m ddp_lesson.train --epochs 1``.

Both start the real launcher, ``python -m torch.distributed.run`` (torchrun), in a subprocess;
nothing here spawns workers by hand. A run is built (:func:`_build_launch`: torchrun's flags
from :func:`torchrun_flags`, the one place they are made), supervised (:func:`_supervise`) and
collected (:func:`_collect_result`). What the launcher adds around torchrun:

* a free rendezvous port on 127.0.0.1: the agents' c10d rendezvous store is hosted here, on a
  socket bound to loopback (torchrun's own would listen on every interface), so two launches
  at once never collide and nothing listens beyond this machine; rank 0's store and gloo are
  kept on loopback too (see :func:`_loopback_env`, :func:`ddp_lesson.env.init_distributed`);
* one backend/device choice, made with :func:`ddp_lesson.env.choose_backend` for every
  process on this host, printed once and used by every rank (``DDP_LESSON_LAUNCHER_BACKEND``);
* ``OMP_NUM_THREADS`` set explicitly (cores / processes) when you have not set it, which is
  what silences torchrun's starred OMP banner (docs/pitfalls.md);
* each rank's stdout captured to a file of its own and shown grouped in rank order after the
  run, as a terminal would show it (a progress bar redrawn with ``\\r`` keeps its final state)
  and wrapped to 100 characters with the ``[rank N] `` prefix, so a deterministic program gives
  a deterministic cell output (nbval replays it); stderr is shown when a rank fails (or with
  ``--show-stderr``), the cell's file named ``<torchrun cell>``;
* live status while it runs: in a notebook one line of plain text (no widget: it reads the
  same after a kernel restart and unexecuted), shown with a display id and rewritten in place;
  it starts and ends as a constant text (:func:`status_text`), so the stored output is
  deterministic (see :class:`_LiveStatus`);
* a failing rank raises :class:`TorchrunError`: the lowest failing rank and its traceback,
  every failing rank named in rank order;
* a wall-clock timeout (:class:`TorchrunTimeout`) and, on timeout or interrupt
  (:class:`TorchrunInterrupted`, one line in a notebook), every process ended: torchrun gets
  SIGTERM (it forwards it), then SIGKILL, then every process group of the run is killed
  (torchrun puts each worker in its own session, so killing the launcher's process group alone
  would orphan them and whatever they started);
* if this process dies outright (a kernel restart, SIGKILL), a watchdog process ends the run
  and removes its folder (``ddp_lesson._worker.watch``); torchrun's own log folder lives in the
  run's folder, so ``$TMPDIR`` is left as it was.

Source: torchrun's documentation, https://pytorch.org/docs/stable/elastic/run.html.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ._worker import die_with_parent, kill_run
from .env import (
    ANNOUNCED_ENV,
    BACKEND_ENV,
    BACKENDS,
    LAUNCHER_BACKEND_ENV,
    LAUNCHER_REASON_ENV,
    LOCAL_RUN_ENV,
    choose_backend,
)

DEFAULT_TIMEOUT_S = 300.0
#: How the cell's code is named in tracebacks, warnings and ``--show-stderr``.
CELL_LABEL = "<torchrun cell>"
_POLL_S = 0.25
_TERM_GRACE_S = 5.0


class TorchrunError(RuntimeError):
    """A rank exited with an error; ``rank``, ``exitcode``, ``traceback``, ``result`` tell which."""

    def __init__(self, message: str, rank: int | None, exitcode: int, traceback: str,
                 result: TorchrunResult):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        self.result = result

    def _render_traceback_(self):  # IPython shows this instead of the launcher's own frames
        lines = [f"TorchrunError: {self}"]
        if self.traceback:
            lines += ["", *self.traceback.rstrip().splitlines()]
        return lines


class TorchrunInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, the notebook's stop button); every process was ended.

    A ``KeyboardInterrupt``, so a run-all stops here; in a notebook it shows as one line,
    not a traceback through the launcher.
    """

    MESSAGE = "torchrun interrupted: every process it started was ended"

    def __str__(self):
        return self.MESSAGE

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [f"KeyboardInterrupt: {self.MESSAGE}"]


class TorchrunTimeout(subprocess.TimeoutExpired):
    """The run outlived its timeout; every process it started has been ended."""

    def __init__(self, cmd, timeout: float, result: TorchrunResult):
        super().__init__(cmd, timeout, output=result.stdout, stderr=result.launcher_stderr)
        self.result = result

    def __str__(self):
        return (f"torchrun did not finish within {self.timeout:g} s; all its processes were "
                "ended (a rank waiting in a collective its peers never reach hangs until "
                "the process group's timeout)")


@dataclass
class TorchrunResult:
    """What a run left behind.

    Attributes:
        returncode: torchrun's exit status (0 when every rank succeeded).
        outputs: global rank -> that rank's stdout (all restarts, in order).
        errors: global rank -> that rank's stderr.
        launcher_stderr: torchrun's own stderr (its log lines and failure summary).
        command: the command actually run.
        torchrun_command: the equivalent command to type in a terminal.
        backend, backend_reason: the launcher's backend choice and why.
        wall_s: seconds from start to exit.
        failed_rank: the lowest failing rank (None when all succeeded).
        failed_ranks: every failing rank, in rank order.
    """

    returncode: int
    outputs: dict[int, str]
    errors: dict[int, str]
    launcher_stderr: str
    command: list[str]
    torchrun_command: str
    backend: str
    backend_reason: str
    wall_s: float = 0.0
    failed_rank: int | None = field(default=None)
    failed_ranks: list[int] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        """Every rank's stdout in rank order, each line prefixed ``[rank N] ``."""
        return format_rank_outputs(self.outputs)

    def rank_lines(self, rank: int) -> list[str]:
        """Lines rank ``rank`` printed to stdout."""
        return self.outputs.get(rank, "").splitlines()


#: Widest stored output line, ``[rank N] `` prefix included: JupyterLab breaks wider lines
#: anywhere, mid-word.
LINE_WIDTH = 100


def _fit(line: str, prefix: str, width: int = LINE_WIDTH) -> list[str]:
    """``prefix + line``, wrapped at spaces so each piece fits ``width`` with its prefix.

    Continuation lines keep the line's indentation; a single word longer than the room left
    is not broken (it would stop being searchable or copyable).
    """
    room = width - len(prefix)
    if len(line) <= room:
        return [prefix + line]
    indent = line[:len(line) - len(line.lstrip(" "))]
    pieces = textwrap.wrap(line, room, subsequent_indent=indent, break_long_words=False,
                           break_on_hyphens=False, drop_whitespace=True) or [line]
    if line.startswith(indent) and not pieces[0].startswith(indent):
        pieces[0] = indent + pieces[0]
    return [prefix + piece for piece in pieces]


def format_rank_outputs(outputs: dict[int, str], ranks=None) -> str:
    """Join per-rank outputs in rank order, each line prefixed ``[rank N] ``.

    Lines wider than :data:`LINE_WIDTH` with their prefix are wrapped at spaces.
    """
    lines = []
    for rank in sorted(outputs):
        if ranks is not None and rank not in ranks:
            continue
        for line in outputs[rank].splitlines():
            lines += _fit(line, f"[rank {rank}] ")
    return "\n".join(lines) + ("\n" if lines else "")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_flags(nproc_per_node: int = 2, nnodes: int = 1, *, max_restarts: int = 0,
                   rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                   node_rank: int | None = None, rdzv_conf: str | None = None, log_dir=None,
                   extra=()) -> list[str]:
    """torchrun's own flags, without the program: the one place they are built.

    One node without ``rdzv_endpoint``: ``--standalone`` (torchrun binds a free port itself).
    Otherwise c10d rendezvous at ``rdzv_endpoint`` (``HOST:PORT`` of the first node) under the
    job id ``rdzv_id``, with ``--rdzv-conf`` and ``--node-rank`` when given. Then
    ``--nproc-per-node``, ``--max-restarts`` when not 0,
    ``--log-dir`` when given (torchrun otherwise makes a ``torchelastic_*`` folder in
    ``$TMPDIR`` and leaves it there), and ``extra`` unchanged.

    >>> torchrun_flags(2)
    ['--standalone', '--nproc-per-node', '2']

    Raises:
        ValueError: a count out of range, or several nodes without ``rdzv_endpoint``.
    """
    _validate(nproc_per_node, nnodes, max_restarts, None)
    if nnodes == 1 and not rdzv_endpoint:
        flags = ["--standalone"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT "
                             "(the address of the first node)")
        flags = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]
        if rdzv_conf:
            flags += ["--rdzv-conf", rdzv_conf]
        if node_rank is not None:
            flags += ["--node-rank", str(node_rank)]
    flags += ["--nproc-per-node", str(nproc_per_node)]
    if max_restarts:
        flags += ["--max-restarts", str(max_restarts)]
    if log_dir is not None:
        flags += ["--log-dir", str(log_dir)]
    return flags + [str(x) for x in extra]


def torchrun_command(target: str, args=(), *, module: bool = False, nproc_per_node: int = 2,
                     nnodes: int = 1, max_restarts: int = 0, extra=()) -> str:
    """The terminal command equivalent to a run (what to type without this package).

    >>> torchrun_command("ddp_lesson.train", ["--epochs", "1"], module=True)
    'torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train --epochs 1'
    """
    several = nnodes > 1
    flags = torchrun_flags(nproc_per_node, nnodes, max_restarts=max_restarts,
                           rdzv_endpoint="HOST:PORT" if several else None,
                           rdzv_id="JOB_ID" if several else None, extra=extra)
    program = (["-m", target] if module else [target]) + [str(a) for a in args]
    return shlex.join(["torchrun", *flags, *program])


def _validate(nproc_per_node: int, nnodes: int, max_restarts: int, timeout: float | None) -> None:
    if (isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int)
            or nproc_per_node < 1):
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def launch_env(base, backend: str | None, nprocs_here: int, announced: bool = True,
               chosen: tuple[str, str] | None = None) -> dict:
    """The environment torchrun and its workers get: backend, threads, import path.

    Args:
        base: environment to start from (None: this process's).
        backend: an explicit ``"gloo"``/``"nccl"``/``"auto"`` passed on to every rank as
            ``DDP_LESSON_BACKEND``; None leaves the variable as it is.
        nprocs_here: processes per node, for ``OMP_NUM_THREADS``.
        announced: tell the workers the launcher printed the backend choice already.
        chosen: ``(backend, reason)`` the launcher chose and printed; every rank then uses
            it (``DDP_LESSON_LAUNCHER_BACKEND``/``_REASON``) instead of choosing again.
    """
    env = dict(os.environ if base is None else base)
    if backend is not None:
        env[BACKEND_ENV] = backend
    if chosen is not None:
        env[LAUNCHER_BACKEND_ENV], env[LAUNCHER_REASON_ENV] = chosen
    if announced:
        env[ANNOUNCED_ENV] = "1"
    if "OMP_NUM_THREADS" not in env:
        # Set explicitly: torchrun otherwise prints its starred banner and picks 1 anyway.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs_here))
    # Restarts (--max-restarts): by default torchrun >= 2.4 keeps one rendezvous TCP store
    # across restarts, and on torch 2.13 + gloo the restarted workers then often fail in
    # init_process_group with "Gloo connectFullMesh failed ... Connection refused": the shared
    # store still holds the dead attempt's keys, which carry no restart count (pitfall C7 in
    # docs/pitfalls.md; pytorch/pytorch#135712, reported for NCCL). A fresh store per
    # rendezvous round removes them: tests/launch/test_elastic.py's restarts recover with it.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Let the workers import this package even when it is not installed (a plain checkout).
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def launcher_backend(nproc_per_node: int, nnodes: int = 1, backend: str | None = None,
                     env: dict | None = None) -> tuple[str, str]:
    """The launcher's backend choice for a run on this host: ``(backend, reason)``.

    Every process of the run is on this host, simulated nodes too (``nnodes`` agents share
    its GPUs), so :func:`ddp_lesson.env.choose_backend` is applied to all
    ``nproc_per_node * nnodes`` of them; ``backend`` None reads ``DDP_LESSON_BACKEND`` from
    ``env`` (the run's environment, default this process's), as every rank would.
    """
    requested = backend if backend is not None else (env or os.environ).get(BACKEND_ENV)
    return choose_backend(nproc_per_node * nnodes, requested or "auto")


def _read(path: Path) -> str:
    """The file's text as written: ``\\r`` kept (no newline translation), bad bytes replaced."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def terminal_text(text: str) -> str:
    """What a terminal shows for ``text``: each ``\\r`` returns to the start of the line and
    what follows overwrites it (a tqdm bar's many updates end as its final state).

    >>> terminal_text("  0%|  | 0/2\\r 50%|# | 1/2\\r100%|##| 2/2\\ndone\\n")
    '100%|##| 2/2\\ndone\\n'
    """
    lines = []
    for line in text.split("\n"):
        screen = ""
        for part in line.split("\r"):
            screen = part + screen[len(part):]
        lines.append(screen)
    return "\n".join(lines)


def _collect(outdir: Path, script: Path | None = None
             ) -> tuple[dict[int, str], dict[int, str], dict[int, int]]:
    """Each rank's stdout and stderr as a terminal shows them, and the ranks' own failures.

    The cell's temporary file is named ``<torchrun cell>`` (tracebacks, warnings), so
    nothing shown depends on where the run's folder was.
    """
    def text(p: Path) -> str:
        t = terminal_text(_read(p))
        return t.replace(str(script), CELL_LABEL) if script is not None else t

    outputs = {int(p.stem[4:]): text(p) for p in outdir.glob("rank*.out")}
    errors = {int(p.stem[4:]): text(p) for p in outdir.glob("rank*.err")}
    exits = {}
    for p in outdir.glob("rank*.exit"):
        try:
            exits[int(p.stem[4:])] = int(_read(p) or 1)
        except ValueError:
            exits[int(p.stem[4:])] = 1
    return outputs, errors, exits


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _reap(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc`` to exit; True once it has been reaped.

    Uses ``os.waitpid`` directly, not ``Popen.wait``: an interrupt that lands inside
    ``Popen.poll`` can leave Popen's internal wait lock held, and a later ``Popen.wait()``
    then blocks forever.
    """
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


def _terminate(procs: list[subprocess.Popen], outdir: Path) -> None:
    """End torchrun agents and every process group of the run (see the module docstring)."""
    for p in procs:
        if p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        if not _reap(p, max(0.1, deadline - time.monotonic())):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(p, 10.0)
    # workers live in sessions of their own, and so may processes they started
    kill_run(str(outdir))


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _failed_rank(launcher_stderr: str, errors: dict[int, str]) -> tuple[int | None, int | None]:
    """The rank to show: torchrun's first observed failure, unless that rank said nothing.

    When every rank exits on the same bad input, often only rank 0 prints why; torchrun may
    still name another rank as the first failure. Show one that left a traceback or message.
    """
    m = _ROOT_CAUSE.search(launcher_stderr)
    root = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    if root[0] is not None and errors.get(root[0], "").strip():
        return root
    for marker in ("Traceback (most recent call last)", ""):
        for rank in sorted(errors):
            if errors[rank].strip() and marker in errors[rank]:
                return rank, (root[1] if rank == root[0] else None)
    return root


_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _failed_ranks(launcher_stderr: str, errors: dict[int, str], exits: dict[int, int]
                  ) -> list[tuple[int, int | None]]:
    """Every failing rank with its exit code, in rank order (the error names the lowest).

    A rank whose own program failed recorded it (``rank{N}.exit``); torchrun's summary adds
    ranks that died without a word (a signal), but not the ones torchrun itself ended
    (SIGTERM) because a peer failed first. Without records: torchrun's choice (see
    :func:`_failed_rank`).
    """
    failed = dict(exits)
    for rank, code in _FAILURE.findall(launcher_stderr):
        if int(code) != -signal.SIGTERM and int(rank) not in failed and exits:
            failed[int(rank)] = int(code)
    if not failed:
        rank, code = _failed_rank(launcher_stderr, errors)
        return [] if rank is None else [(rank, code)]
    return sorted(failed.items())


def _clean_traceback(text: str, script: Path | None, label: str) -> str:
    """The rank's traceback without the bootstrap's frames, the cell file shown as ``label``."""
    if script is not None:
        text = text.replace(str(script), label)
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return text[-4000:]
    tb = text[start:].splitlines()
    frames, i = [tb[0]], 1
    skip = ("ddp_lesson/_worker.py", "<frozen runpy>", "/runpy.py")
    while i < len(tb):
        line = tb[i]
        if line.startswith("  File "):
            block = [line]
            i += 1
            while i < len(tb) and tb[i].startswith("    "):
                block.append(tb[i])
                i += 1
            if not any(s in line for s in skip):
                frames += block
        else:
            frames.append(line)
            i += 1
    return "\n".join(frames)


def status_text(nprocs: int) -> str:
    """The live status's constant text form, e.g. ``"torchrun: 2 processes"``.

    The status line's first and last text: what a stored notebook shows (also on GitHub),
    plain text that reads as well after the run as before it. nbval keeps a line's first
    form and nbclient stores its last, so both are this one and replays stay exact.
    """
    return f"torchrun: {nprocs} process{'es' if nprocs != 1 else ''}"


class _LiveStatus:
    """A one-line live status in a notebook kernel (nothing elsewhere): plain text, no widget.

    Shown with ``display(..., display_id=True)`` and rewritten in place with
    ``update_display_data`` messages: JupyterLab (and VS Code, nbclient) apply them live, and
    since there is no widget and no comm, nothing in the page depends on the kernel staying
    alive -- after a kernel restart the line stays readable text (a widget's view showed a
    broken-link icon, issue 19 item 5), and an unexecuted notebook shows the text as stored
    (also on GitHub).

    Replays: nbval 0.11 keeps the first ``display_data`` of a cell and ignores updates, while
    nbclient (``jupyter nbconvert --execute``) stores the last update. So the line starts and
    ends with the same constant text, :func:`status_text` (``"torchrun: 2 processes"``), and
    only the updates in between carry the elapsed seconds and rank 0's progress; the stored
    output is deterministic. One line per cell: several launches from one cell (a loop of
    ``run_torchrun`` calls) update the same line, which ends as the cell's first launch began.

    It also keeps the kernel reported busy while the cell runs (:func:`keep_kernel_status_busy`).
    """

    _per_cell: dict = {}  # the cell's execute request -> (display handle, its constant text)

    def __init__(self, enabled: bool | None, nprocs: int):
        self.handle = None
        self.text = status_text(nprocs)
        try:
            from IPython import get_ipython
            from IPython.display import display

            ip = get_ipython()
            if ip is None or not hasattr(ip, "kernel"):
                return
            keep_kernel_status_busy(ip.kernel)
            if enabled is False:
                return
            # the request that runs this cell (nbval runs cells without counting them)
            parent = getattr(ip, "parent_header", None) or {}
            cell = parent.get("header", {}).get("msg_id") or getattr(ip, "execution_count", None)
            if cell in self._per_cell:
                self.handle, self.text = self._per_cell[cell]
            else:
                self.handle = display({"text/plain": self.text}, raw=True, display_id=True)
                self._per_cell.clear()  # earlier cells' lines are done with
                self._per_cell[cell] = (self.handle, self.text)
        except Exception:  # no kernel, no display: the run goes on without live status
            self.handle = None

    @property
    def live(self) -> bool:
        return self.handle is not None

    def update(self, text: str) -> None:
        """Show ``text`` in place of the line (only while the run lasts: see :meth:`end`)."""
        if self.handle is not None:
            try:
                self.handle.update({"text/plain": text}, raw=True)
            except Exception:  # the display went away: the run matters more than its line
                self.handle = None

    def end(self, text: str | None = None) -> None:
        """The line's last state: its constant text (what replays compare), or ``text``
        for an outcome no stored notebook can hold (an interrupt)."""
        self.update(self.text if text is None else text)


def _request_id(message) -> str | None:
    return ((message or {}).get("header") or {}).get("msg_id")


def keep_kernel_status_busy(kernel) -> bool:
    """Make ``kernel`` (an ipykernel Kernel) say "busy" again after each "idle" it publishes
    for another request while a cell runs; installed once per kernel, kept for its lifetime.

    Why: a front end shows the kernel's last ``status`` message. ipykernel answers requests
    on the control channel on a thread of their own, each with a busy/idle pair on IOPub, even
    while a cell runs (ipython/ipykernel#799). JupyterLab ignores the pairs of a few request
    types (jupyter_server's ``untracked_message_types``: debug, kernel_info, comm_info...) but
    not those of the subshell probe it sends when it connects to a kernel
    (``create_subshell_request``, ``delete_subshell_request``): when a fresh kernel's first
    cell has already started, that "idle" arrives last, and the page read "Idle" for the whole
    of a long first ``%%torchrun`` cell (issue 19, item 6, seen in the page's websocket
    traffic; a later run is not affected: the probe is sent once).

    Every status goes through ``Kernel._publish_status``; this wraps it on the instance: it
    tracks the execute requests being run (their own busy ... idle) and, when an "idle" for
    any other request is published while one runs, publishes "busy" for that execute request
    right after it. Installing it inside a cell says "busy" for that cell at once.

    Returns:
        True when the kernel is guarded (now or before), False when it cannot be (no
        ``_publish_status``: not an ipykernel kernel).
    """
    if getattr(kernel, "_ddp_lesson_keeps_busy", False):
        return True
    original = getattr(kernel, "_publish_status", None)
    if original is None or not hasattr(kernel, "get_parent"):
        return False
    running: list = []  # execute requests between their busy and their idle, oldest first
    lock = threading.Lock()

    def publish_status(status, channel, parent=None):
        original(status, channel, parent)
        try:
            answered = parent or kernel.get_parent(channel) or {}
            with lock:
                if (answered.get("header") or {}).get("msg_type") == "execute_request":
                    rid = _request_id(answered)
                    running[:] = [r for r in running if _request_id(r) != rid]
                    if status == "busy":
                        running.append(answered)
                    return
                if status != "idle" or not running:
                    return
                current = running[-1]
            original("busy", "shell", current)
        except Exception:  # only what the page's indicator shows is at stake
            pass

    kernel._publish_status = publish_status
    kernel._ddp_lesson_keeps_busy = True
    try:  # installed from inside a cell: that cell is running now
        current = kernel.get_parent("shell")
        if (current.get("header") or {}).get("msg_type") == "execute_request":
            with lock:
                running.append(current)
            original("busy", "shell", current)
    except Exception:
        pass
    return True


def _progress_line(outdir: Path, rank: int = 0) -> str:
    """What rank ``rank`` is showing now: a progress bar being redrawn on stderr (tqdm), else
    its last line of stdout. Never stderr's other lines (warnings and their source lines)."""
    err = _read(outdir / f"rank{rank}.err")
    tail = err.rsplit("\n", 1)[-1]
    if "\r" in tail and terminal_text(tail).strip():
        return terminal_text(tail).strip()[:120]
    out = terminal_text(_read(outdir / f"rank{rank}.out")).rstrip()
    return out.rsplit("\n", 1)[-1].strip()[:120] if out else ""


@dataclass
class _Launch:
    """A run ready to start: torchrun's commands, their environment and where output goes."""

    commands: list[list[str]]
    env: dict
    cwd: object
    outdir: Path
    script: Path | None
    equivalent: str
    backend: str
    reason: str
    total: int
    store: object = None  # the agents' rendezvous store, alive for the run


def _rendezvous_store():
    """A TCPStore server on 127.0.0.1 for torchrun's agents: ``(store, "127.0.0.1:PORT")``.

    torch's TCPStore server binds every interface, but accepts a listening socket from the
    caller (``master_listen_fd``); one bound to 127.0.0.1 keeps the rendezvous on this machine.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach(), multi_tenant=True)
    return store, f"127.0.0.1:{port}"


def _loopback_env(env: dict) -> dict:
    """Variables that keep a run whose ranks are all on this machine off the network.

    Rank 0's store binds 127.0.0.1 (``DDP_LESSON_ALL_RANKS_LOCAL``, read by
    :func:`ddp_lesson.env.init_distributed`), and gloo's own connections use the loopback
    interface (``GLOO_SOCKET_IFNAME=lo``; gloo otherwise listens on the address the host name
    resolves to). A value you set yourself is kept.
    """
    extra = {LOCAL_RUN_ENV: "1"}
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in {n for _, n in socket.if_nameindex()}:
        extra["GLOO_SOCKET_IFNAME"] = "lo"
    return extra


def _program(target, args, code, module, outdir: Path) -> tuple[list[str], Path | None]:
    """The worker bootstrap's command line (``-m ddp_lesson._worker ...``) and the cell file."""
    script = None
    if code is not None:
        script = outdir / "torchrun_cell.py"
        script.write_text(code)
        kind, what = "--script", str(script)
    elif module:
        kind, what = "--module", target
    else:
        if not Path(target).is_file():
            raise FileNotFoundError(f"script {target!r} not found (cwd {os.getcwd()})")
        kind, what = "--script", str(Path(target).resolve())
    return ["-m", "ddp_lesson._worker", str(outdir), kind, what, *map(str, args)], script


def _build_launch(target, args, code, module, nproc_per_node, nnodes, max_restarts, backend,
                  env, cwd, torchrun_args, outdir: Path) -> _Launch:
    """Build torchrun's command(s) and environment; choose the backend once, for every rank."""
    program, script = _program(target, args, code, module, outdir)
    base = launch_env(env, backend, nproc_per_node)
    chosen = launcher_backend(nproc_per_node, nnodes, backend, base)
    child_env = launch_env(base, None, nproc_per_node, chosen=chosen)
    child_env.update(_loopback_env(child_env))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    # The agents' rendezvous store is hosted here, on 127.0.0.1 only (torchrun's own would
    # listen on every interface); each agent is a client of it (is_host=false). torchrun's
    # log folder goes inside the run's own, removed with it.
    store, endpoint = _rendezvous_store()
    common = dict(rdzv_endpoint=endpoint, rdzv_id=uuid.uuid4().hex[:8], rdzv_conf="is_host=false",
                  max_restarts=max_restarts, log_dir=outdir / "torchelastic", extra=torchrun_args)
    commands = [[*torchrun, *torchrun_flags(nproc_per_node, nnodes, node_rank=node if nnodes > 1
                                            else None, **common), *program]
                for node in range(nnodes)]
    equivalent = torchrun_command(target if code is None else "cell.py", args,
                                  module=module and code is None, nproc_per_node=nproc_per_node,
                                  nnodes=nnodes, max_restarts=max_restarts, extra=torchrun_args)
    return _Launch(commands, child_env, cwd, outdir, script, equivalent, *chosen,
                   nproc_per_node * nnodes, store)


def _start(launch: _Launch, errfiles) -> list[subprocess.Popen]:
    """Start one torchrun agent per command, each in a session of its own, dying with us."""
    procs = []
    linux = sys.platform.startswith("linux")
    for cmd, err in zip(launch.commands, errfiles):
        procs.append(subprocess.Popen(
            cmd, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL, stdout=err,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=partial(die_with_parent, os.getpid()) if linux else None))
        with open(launch.outdir / "agents.pid", "a") as f:  # for the watchdog
            f.write(f"{procs[-1].pid}\n")
    return procs


def _start_watchdog(launch: _Launch) -> subprocess.Popen:
    """A small process that ends the run if this one dies (``ddp_lesson._worker.watch``).

    It reads a pipe whose write end only this process holds: any death of the launcher (a
    kernel restart, SIGKILL) closes it, and the watchdog then kills every process group of
    the run, processes the ranks started included, and removes the run's folder.
    """
    return subprocess.Popen([sys.executable, "-m", "ddp_lesson._worker", "--watch",
                             str(launch.outdir)], env=launch.env, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


def _release_watchdog(watchdog: subprocess.Popen) -> None:
    """Tell the watchdog the run is over (nothing for it to do) and reap it."""
    try:
        watchdog.stdin.write(b"done")
        watchdog.stdin.close()
    except OSError:
        pass
    _reap(watchdog, 10.0)


def _supervise(launch: _Launch, timeout: float | None, status: _LiveStatus, errfiles,
               cancel: threading.Event | None = None
               ) -> tuple[list[subprocess.Popen], bool, float]:
    """Start the agents and wait for them: ``(procs, timed_out, wall_s)``.

    Live status every ``_POLL_S``; on timeout, interrupt (or ``cancel`` set by another
    thread: :func:`run_torchrun_many`) or any other exception every process is ended (the
    exception is re-raised; a timeout is reported through ``timed_out``).
    """
    start = time.monotonic()
    procs = []
    try:
        procs = _start(launch, errfiles)
        while any(p.poll() is None for p in procs):
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed > timeout:
                _terminate(procs, launch.outdir)
                return procs, True, time.monotonic() - start
            if status.live:
                rank0 = _progress_line(launch.outdir)
                status.update(f"{status_text(launch.total)}, at {elapsed:.0f} s"
                              + (f" | rank 0: {rank0}" if rank0 else ""))
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _terminate(procs, launch.outdir)
        status.end("torchrun: interrupted; every process ended")
        raise TorchrunInterrupted() from None
    except BaseException:
        _terminate(procs, launch.outdir)
        status.end()
        raise
    return procs, False, time.monotonic() - start


def _collect_result(launch: _Launch, procs, errfiles, wall: float
                    ) -> tuple[TorchrunResult, dict[int, int]]:
    """Read what the run left in its folder: every rank's output, torchrun's own log, and
    the exit codes of the ranks whose own program failed."""
    launcher_stderr = ""
    for err in errfiles:
        err.seek(0)
        launcher_stderr += err.read().decode(errors="replace")
    outputs, errors, exits = _collect(launch.outdir, launch.script)
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    return TorchrunResult(returncode, outputs, errors, launcher_stderr, launch.commands[0],
                          launch.equivalent, launch.backend, launch.reason, wall), exits


def _failure(launch: _Launch, result: TorchrunResult, exits: dict[int, int]) -> TorchrunError:
    """The error for a failed run: every failing rank in rank order, the lowest one's traceback."""
    failed = _failed_ranks(result.launcher_stderr, result.errors, exits)
    result.failed_ranks = [r for r, _ in failed]
    if not failed:
        tb = _clean_traceback(result.launcher_stderr, launch.script, CELL_LABEL)
        last = tb.strip().splitlines()[-1] if tb.strip() else ""
        return TorchrunError(f"torchrun failed (exit code {result.returncode})"
                             + (f": {last}" if last else ""), None, result.returncode, tb, result)
    rank, code = failed[0]
    result.failed_rank = rank
    # the traceback: the lowest failing rank's, else the first failing rank that said why
    said = [r for r, _ in failed if result.errors.get(r, "").strip()] or [rank]
    tb = _clean_traceback(result.errors.get(said[0], ""), launch.script, CELL_LABEL)
    exitcode = code if code is not None else result.returncode
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    if len(failed) == 1:
        where = f"rank {rank} of {launch.total} failed (exit code {exitcode})"
    else:
        codes = ", ".join(str(c if c is not None else result.returncode) for _, c in failed)
        where = (f"ranks {', '.join(str(r) for r, _ in failed)} of {launch.total} failed "
                 f"(exit codes {codes})")
    return TorchrunError(where + (f": {last}" if last else ""), rank, exitcode, tb, result)


def run_torchrun(target: str | None = None, args=(), *, code: str | None = None,
                 module: bool = False, nproc_per_node: int = 2, nnodes: int = 1,
                 max_restarts: int = 0, timeout: float | None = DEFAULT_TIMEOUT_S,
                 backend: str | None = None, env: dict | None = None, cwd=None,
                 live: bool | None = None, check: bool = True,
                 torchrun_args=(), _cancel: threading.Event | None = None) -> TorchrunResult:
    """Run a program on ``nnodes * nproc_per_node`` processes with torchrun, collect each output.

    Give exactly one of ``code`` (source text, run as a script: what ``%%torchrun`` does),
    ``target`` with ``module=True`` (like ``torchrun -m NAME``) or ``target`` as a script path.
    With ``nnodes > 1`` it starts that many torchrun agents on this host, one per simulated
    node, joined by c10d rendezvous on 127.0.0.1 (as separate machines would be).

    Args:
        target: module name or script path.
        args: the program's command-line arguments.
        code: Python source to run on every rank instead of ``target``.
        module: ``target`` is a module name.
        nproc_per_node: processes per node (torchrun's ``--nproc-per-node``).
        nnodes: number of torchrun agents (simulated nodes) to start here.
        max_restarts: torchrun's ``--max-restarts``.
        timeout: wall-clock seconds for the whole run; None waits forever (not advised).
        backend: ``"auto"``, ``"gloo"``, ``"nccl"``; None reads ``DDP_LESSON_BACKEND``. The
            launcher chooses once and every rank uses that choice.
        env: environment for the run (default: this process's).
        cwd: working directory of the workers.
        live: the live status line (plain text) in a notebook kernel: None (default) or True
            show it there, False never. Outside a kernel there is none.
        check: raise :class:`TorchrunError` when a rank fails.
        torchrun_args: further torchrun flags, passed through unchanged.

    Returns:
        A :class:`TorchrunResult`; ``result.stdout`` is every rank's output in rank order.

    Raises:
        ValueError: bad arguments (named with their values).
        TorchrunError: a rank failed (``check=True``); carries its traceback.
        TorchrunTimeout: the run outlived ``timeout``; all processes were ended.
        TorchrunInterrupted: a ``KeyboardInterrupt``, raised after ending every process.
    """
    if (code is None) == (target is None):
        raise ValueError("give exactly one of code= or target=")
    if isinstance(args, str):  # "--epochs 1" means what a shell would make of it
        args = shlex.split(args)
    _validate(nproc_per_node, nnodes, max_restarts, timeout)
    outdir = Path(tempfile.mkdtemp(prefix="ddp_lesson_run_"))
    launch = None
    try:
        launch = _build_launch(target, args, code, module, nproc_per_node, nnodes, max_restarts,
                               backend, env, cwd, [str(a) for a in torchrun_args], outdir)
        status = _LiveStatus(live, launch.total)
        errfiles = [open(outdir / f"launcher{n}.err", "w+b") for n in range(len(launch.commands))]
        watchdog = _start_watchdog(launch)
        try:
            procs, timed_out, wall = _supervise(launch, timeout, status, errfiles, _cancel)
            result, exits = _collect_result(launch, procs, errfiles, wall)
        finally:
            _release_watchdog(watchdog)
            for err in errfiles:
                err.close()
        status.end()  # the constant text: what a stored notebook holds, whatever the outcome
        if timed_out:
            raise TorchrunTimeout(launch.equivalent, timeout, result)
        if result.returncode != 0:
            error = _failure(launch, result, exits)
            if check:
                raise error
        return result
    finally:
        if launch is not None:  # stop the rendezvous store now, not when a traceback is freed
            launch.store = None
        shutil.rmtree(outdir, ignore_errors=True)


def run_torchrun_many(jobs: dict, *, label: str = "torchrun", live: bool | None = None
                      ) -> dict:
    """Start several :func:`run_torchrun` jobs at once and wait for all of them.

    Each job runs in a thread of its own with its own rendezvous store, ports and folder; they
    share only the machine. Started together, jobs that mostly wait (for a timeout, a
    rendezvous, a torch import on a spare core) take about as long as the slowest one, not the
    sum. Results are deterministic in content and come back in the order of ``jobs``, not of
    finishing. In a notebook one live status line counts the finished jobs and ends as
    :func:`status_text` of all their processes (what a stored notebook holds).

    Args:
        jobs: ``{label: kwargs of run_torchrun}`` (``live`` is forced off for each job: the
            line here speaks for all).
        label: the first word of the live line (``"hang clinic: 3 of 7 runs finished, 4 s"``).
        live: as for :func:`run_torchrun`.

    Returns:
        ``{label: TorchrunResult}`` in the order of ``jobs``.

    Raises:
        ValueError: no job, or a job's bad arguments.
        TorchrunError / TorchrunTimeout: the first job (in ``jobs`` order) that raised one,
            once every job has ended.
        TorchrunInterrupted: a ``KeyboardInterrupt``; every process of every job is ended first.
    """
    if not jobs:
        raise ValueError("run_torchrun_many needs at least one job, got none")
    results, errors, cancel = {}, {}, threading.Event()

    def work(name, kwargs):
        try:
            results[name] = run_torchrun(**{**kwargs, "live": False, "_cancel": cancel})
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[name] = exc

    defaults = inspect.signature(run_torchrun).parameters  # one source for the defaults
    total = sum(kw.get("nproc_per_node", defaults["nproc_per_node"].default)
                * kw.get("nnodes", defaults["nnodes"].default) for kw in jobs.values())
    status = _LiveStatus(live, total)
    threads = [threading.Thread(target=work, args=item, daemon=True) for item in jobs.items()]
    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            done = sum(not t.is_alive() for t in threads)
            status.update(f"{label}: {done} of {len(threads)} runs finished, "
                          f"at {time.monotonic() - start:.0f} s")
            for t in threads:
                t.join(_POLL_S / len(threads))
    except KeyboardInterrupt:
        cancel.set()
        for t in threads:
            t.join()
        status.end("torchrun: interrupted; every process ended")
        raise TorchrunInterrupted() from None
    status.end()
    for name in jobs:
        if name in errors:
            raise errors[name]
    return {name: results[name] for name in jobs}


# --------------------------------------------------------------------------- cell magic

def _magic_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="%%torchrun", add_help=False,
        description="Run the cell (or -m MODULE / SCRIPT) on several processes with torchrun.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="processes per node (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="simulated nodes on this host (default 1)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before every process is ended (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="override the automatic choice (also: DDP_LESSON_BACKEND)")
    p.add_argument("--ranks", default=None,
                   help="comma-separated ranks whose output to show (default: all)")
    p.add_argument("--show-stderr", action="store_true",
                   help="also show each rank's stderr (warnings, progress bars)")
    p.add_argument("--quiet", action="store_true", help="do not print the backend line")
    p.add_argument("-h", "--help", action="store_true")
    return p


_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--max-restarts",
           "--max_restarts", "--timeout", "--backend", "--ranks"}


def split_magic_line(line: str) -> tuple[list[str], str | None, bool, list[str]]:
    """Split ``%torchrun`` options from the program: ``(options, target, is_module, args)``.

    Everything after ``-m NAME`` or after the first bare word (a script path) belongs to the
    program, so ``%torchrun --nproc-per-node 2 -m ddp_lesson.train --epochs 1`` passes
    ``--epochs 1`` to the trainer.
    """
    tokens = shlex.split(line)
    opts, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "-m":
            if i + 1 >= len(tokens):
                raise ValueError("-m needs a module name")
            return opts, tokens[i + 1], True, tokens[i + 2:]
        if tok == "--":
            rest = tokens[i + 1:]
            return (opts, rest[0], False, rest[1:]) if rest else (opts, None, False, [])
        if tok.startswith("-"):
            opts.append(tok)
            if tok in _VALUED:
                if i + 1 >= len(tokens):
                    raise ValueError(f"{tok} needs a value")
                opts.append(tokens[i + 1])
                i += 1
        else:
            return opts, tok, False, tokens[i + 1:]
        i += 1
    return opts, None, False, []


def torchrun_magic(line: str, cell: str | None = None):
    """``%%torchrun [opts]`` runs the cell, ``%torchrun [opts] -m MODULE|SCRIPT [args]`` a program.

    Options (torchrun's own names): ``--nproc-per-node N`` (default 2), ``--nnodes N``,
    ``--max-restarts N``, plus ``--timeout S``, ``--backend {auto,gloo,nccl}``,
    ``--ranks 0,2``, ``--show-stderr``, ``--quiet``. Prints the backend choice once, then each
    rank's output in rank order; raises when a rank fails. Returns nothing (the result is
    kept as ``_torchrun_result`` in the user namespace).
    """
    parser = _magic_parser()
    opt_tokens, target, is_module, args = split_magic_line(line)
    try:
        opts = parser.parse_args(opt_tokens)
    except SystemExit:
        raise ValueError(f"could not parse %%torchrun options {line!r}; "
                         "see %torchrun --help") from None
    if opts.help:
        print(torchrun_magic.__doc__)
        return None
    body = cell if cell is not None and cell.strip() else None
    if body is None and target is None:
        raise ValueError("%%torchrun needs code in the cell, or %torchrun -m MODULE / SCRIPT")
    if body is not None and target is not None:
        raise ValueError("give either a cell body or a program after %%torchrun, not both")
    total = opts.nproc_per_node * opts.nnodes
    ranks = None if opts.ranks is None else {int(r) for r in opts.ranks.split(",") if r.strip()}
    if ranks is not None and not all(0 <= r < total for r in ranks):
        raise ValueError(f"--ranks {opts.ranks}: ranks must be in [0, {total - 1}]")
    if not opts.quiet:
        _, reason = launcher_backend(opts.nproc_per_node, opts.nnodes, opts.backend)
        print(f"[torchrun] {reason}")
    try:
        result = run_torchrun(target, args, code=body, module=is_module,
                              nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes,
                              max_restarts=opts.max_restarts, timeout=opts.timeout,
                              backend=opts.backend)
    except TorchrunError as e:
        out = format_rank_outputs(e.result.outputs, ranks)
        if out:
            print(out, end="")
        raise
    except TorchrunTimeout as e:
        out = format_rank_outputs(e.result.outputs, ranks)
        if out:
            print(out, end="")
        raise
    print(format_rank_outputs(result.outputs, ranks), end="")
    if opts.show_stderr:
        err = format_rank_outputs({r: t for r, t in result.errors.items() if t.strip()}, ranks)
        if err:
            print(err, end="", file=sys.stderr)
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.user_ns["_torchrun_result"] = result
    except ImportError:
        pass
    return None


def load_ipython_extension(ipython) -> None:
    """Register ``%%torchrun`` / ``%torchrun`` (called by ``%load_ext ddp_lesson``), and keep
    the kernel's status busy while its cells run (:func:`keep_kernel_status_busy`)."""
    ipython.register_magic_function(torchrun_magic, magic_kind="line_cell", magic_name="torchrun")
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None:
        keep_kernel_status_busy(kernel)
