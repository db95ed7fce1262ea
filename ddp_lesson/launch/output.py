"""What a run shows and leaves: rank-ordered output, failures, live status.

Each rank's captured stdout and stderr read as a terminal shows them (:func:`terminal_text`),
joined in rank order with ``[rank N] `` prefixes and wrapped to :data:`LINE_WIDTH`
(:func:`format_rank_outputs`); the failing ranks and the traceback to show, read from the
ranks' records and torchrun's summary; the one-line live status of a notebook cell
(:class:`LiveStatus`, :func:`keep_kernel_status_busy`); and the result and error types
that :func:`ddp_lesson.launch.run_torchrun` returns and raises.
"""
from __future__ import annotations

import re
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

#: How the cell's code is named in tracebacks, warnings and ``--show-stderr``.
CELL_LABEL = "<torchrun cell>"


class TorchrunError(RuntimeError):
    """A rank exited with an error.

    Attributes:
        rank: the rank that failed first (the root cause), None when no rank is known.
        exitcode, traceback: its exit code and traceback (the cell named ``<torchrun cell>``).
        consequences: the ranks that failed after it, in rank order (a rank waiting in a
            collective fails when its peer's process ends: "Connection closed by peer").
        result: the :class:`TorchrunResult`.

    The first failure is read from the ranks' records (``rank{N}.exit``, ``time.time_ns()``,
    :mod:`ddp_lesson._worker`), not torchrun's "Root Cause": its timestamps are whole seconds
    (``int(time.time())`` in ``ProcessFailure``, ``ChildFailedError.get_first_failure``,
    ``torch/distributed/elastic/multiprocessing/errors/``), so cause and consequence tie.
    """

    def __init__(self, message: str, rank: int | None, exitcode: int, traceback: str,
                 result: TorchrunResult, consequences: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback
        self.result = result
        self.consequences = list(consequences or [])

    def _render_traceback_(self):  # IPython shows this instead of the launcher's own frames
        lines = [f"TorchrunError: {self}"]
        if self.traceback:
            lines += ["", *self.traceback.rstrip().splitlines()]
        for rank in self.consequences:
            last = _last_line(self.result.errors.get(rank, ""))
            lines += ["", f"rank {rank} failed after rank {self.rank}, as a consequence"
                      + (f": {last}" if last else "")]
        return lines


def _last_line(text: str) -> str:
    """The last non-empty line of a rank's stderr, without torch's ``[rankN]: `` prefix."""
    lines = [_TORCH_PREFIX.sub("", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else ""


#: torch's excepthook prefixes every line of an uncaught exception's traceback with
#: ``[rank{N}]: `` once a process group exists (``_set_pg_excepthook`` sets it in
#: ``torch/distributed/distributed_c10d.py``).
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)


class TorchrunInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, the stop button); every process was ended. A
    ``KeyboardInterrupt`` (a run-all stops), shown in a notebook as one line."""

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
    """What a run left behind: torchrun's ``returncode``; ``outputs`` and ``errors``, global
    rank -> stdout / stderr (all restarts); ``launcher_stderr`` (torchrun's log and summary);
    the ``command`` run and the ``torchrun_command`` to type; the backend and why; ``wall_s``;
    ``failed_rank`` (the root cause, :class:`TorchrunError`) and every ``failed_ranks``."""

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
    """``prefix + line`` broken at spaces to fit ``width``; later pieces are indented by
    ``len(prefix)`` without a prefix (never two prints of the rank). A break drops one space,
    the last of its run, so a continuation starts with a character and
    :func:`join_continuations` restores the line; a word longer than the room is not broken.
    """
    room = width - len(prefix)
    pieces, rest = [], line
    while len(rest) > room:
        # the last space of a run of spaces, so a continuation never starts with a space
        cut = next((i for i in range(min(room, len(rest) - 1), 0, -1)
                    if rest[i] == " " and rest[i + 1] != " " and rest[:i].strip()), 0)
        if cut <= 0:
            cut = next((i for i in range(room, len(rest) - 1)
                        if rest[i] == " " and rest[i + 1] != " "), 0)
        if cut <= 0:
            break
        pieces.append(rest[:cut])
        rest = rest[cut + 1:]
    pieces.append(rest)
    pad = " " * len(prefix)
    return [prefix + pieces[0]] + [pad + piece for piece in pieces[1:]]


_RANK_PREFIX = re.compile(r"\[rank \d+\] ")


def join_continuations(text: str) -> list[str]:
    """The lines of :func:`format_rank_outputs`'s ``text`` with each broken line made whole again:
    a line indented by exactly the previous rank line's prefix width, then a non-space,
    continues it."""
    joined: list[str] = []
    for line in text.splitlines():
        m = _RANK_PREFIX.match(joined[-1]) if joined else None
        if m and line.startswith(" " * m.end()) and line[m.end():m.end() + 1].strip():
            joined[-1] += " " + line[m.end():]
        else:
            joined.append(line)
    return joined


def format_rank_outputs(outputs: dict[int, str], ranks=None) -> str:
    """Join per-rank outputs in rank order, each line prefixed ``[rank N] ``.

    Lines wider than :data:`LINE_WIDTH` with their prefix are broken at spaces and continued
    on indented lines without a prefix (:func:`_fit`; :func:`join_continuations` undoes it).
    """
    lines = []
    for rank in sorted(outputs):
        if ranks is not None and rank not in ranks:
            continue
        for line in outputs[rank].splitlines():
            lines += _fit(line, f"[rank {rank}] ")
    return "\n".join(lines) + ("\n" if lines else "")


def ranks_word(ranks) -> str:
    """``"rank 2"`` or ``"ranks 0, 3"`` (sorted): how failure messages name ranks."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


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


def collect_outputs(outdir: Path, script: Path | None = None
                    ) -> tuple[dict[int, str], dict[int, str], dict[int, int], dict[int, int]]:
    """``(outputs, errors, exits, times)``: each rank's stdout and stderr as a terminal shows
    them (``script`` named ``<torchrun cell>``), and its own failure record
    (:mod:`ddp_lesson._worker` writes ``"CODE TIME_NS"``): exit code and ``time.time_ns()``,
    plus :data:`CONSEQUENCE_NS` when marked `` consequence`` (it passes on a peer's failure).
    """
    def text(p: Path) -> str:
        t = terminal_text(_read(p))
        return t.replace(str(script), CELL_LABEL) if script is not None else t

    outputs = {int(p.stem[4:]): text(p) for p in outdir.glob("rank*.out")}
    errors = {int(p.stem[4:]): text(p) for p in outdir.glob("rank*.err")}
    exits, times = {}, {}
    for p in outdir.glob("rank*.exit"):
        rank, fields = int(p.stem[4:]), _read(p).split()
        try:
            exits[rank] = int(fields[0]) if fields else 1
        except ValueError:
            exits[rank] = 1
        if len(fields) > 1 and fields[1].isdigit():
            times[rank] = int(fields[1]) + (CONSEQUENCE_NS if "consequence" in fields[2:] else 0)
    return outputs, errors, exits, times


#: Added to the time of a failure whose exception says it passes on a peer's failure: later
#: than any real time (year 2286 and beyond), so such a failure is never named as the cause.
CONSEQUENCE_NS = 10 ** 19


def first_failures(failed: list[int], times: dict[int, int]) -> list[int]:
    """``failed`` ordered by when each rank failed, the root cause first: ranks without a
    record (``times``) died of a signal, which no peer's failure causes, so they come first;
    the others by their record's time, ties by rank.
    """
    unrecorded = [r for r in sorted(failed) if r not in times]
    recorded = sorted((r for r in failed if r in times), key=lambda r: (times[r], r))
    return unrecorded + recorded



_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _failed_rank(launcher_stderr: str, errors: dict[int, str]) -> tuple[int | None, int | None]:
    """The rank to show: torchrun's first observed failure, unless that rank said nothing
    (every rank exits on the same bad input, only rank 0 says why): then one that did."""
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


def read_failed_ranks(launcher_stderr: str, errors: dict[int, str], exits: dict[int, int]
                      ) -> list[tuple[int, int | None]]:
    """Every failing rank with its exit code, in rank order: the ranks' records
    (``rank{N}.exit``), plus those torchrun's summary names dead of a signal other than its
    own SIGTERM; without records, :func:`_failed_rank`'s choice.
    """
    failed = dict(exits)
    for rank, code in _FAILURE.findall(launcher_stderr):
        if int(code) != -signal.SIGTERM and int(rank) not in failed and exits:
            failed[int(rank)] = int(code)
    if not failed:
        rank, code = _failed_rank(launcher_stderr, errors)
        return [] if rank is None else [(rank, code)]
    return sorted(failed.items())


def clean_traceback(text: str, script: Path | None, label: str) -> str:
    """The rank's traceback without the bootstrap's frames, the cell file shown as ``label``."""
    if script is not None:
        text = text.replace(str(script), label)
    text = _TORCH_PREFIX.sub("", text)
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
    """The live status's first and last text, e.g. ``"torchrun: 2 processes"``: nbval keeps a
    line's first form and nbclient stores its last, so replays stay exact."""
    return f"torchrun: {nprocs} process{'es' if nprocs != 1 else ''}"


class LiveStatus:
    """A one-line live status in a notebook kernel (nothing elsewhere): plain text, no widget.

    ``display(..., display_id=True)`` rewritten with ``update_display_data``: no widget and no
    comm, so after a kernel restart (or on GitHub) the line stays readable text. nbval 0.11
    keeps a cell's first ``display_data``, nbclient its last update: the line starts and ends
    as :func:`status_text`, only the updates between carry seconds and rank 0's progress. One
    line per cell (several launches update it). Keeps the kernel reported busy meanwhile
    (:func:`keep_kernel_status_busy`).
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
    for another request while a cell runs; installed once per kernel.

    A front end shows the kernel's last ``status``. ipykernel answers control requests on a
    thread of their own with busy/idle pairs even while a cell runs (ipython/ipykernel#799);
    JupyterLab ignores the pairs of jupyter_server's ``untracked_message_types`` but not those
    of its subshell probe on connect (``create_subshell_request``), so the page read "Idle"
    through a long first ``%%torchrun`` cell (seen in its websocket traffic). This wraps
    ``Kernel._publish_status`` on the instance: it tracks the running execute requests and
    publishes "busy" for the current one after any other request's "idle".

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


def progress_line(outdir: Path, rank: int = 0) -> str:
    """What rank ``rank`` shows now: a progress bar redrawn on stderr (tqdm), else its last
    line of stdout (never stderr's other lines: warnings)."""
    err = _read(outdir / f"rank{rank}.err")
    tail = err.rsplit("\n", 1)[-1]
    if "\r" in tail and terminal_text(tail).strip():
        return terminal_text(tail).strip()[:120]
    out = terminal_text(_read(outdir / f"rank{rank}.out")).rstrip()
    return out.rsplit("\n", 1)[-1].strip()[:120] if out else ""

