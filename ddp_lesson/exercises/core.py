"""The machinery behind :func:`ddp_lesson.exercises.check`: registry, verdicts, runners.

An :class:`Exercise` is one task from a notebook's Exercises section that a learner can code.
It knows its reference solution (in :mod:`ddp_lesson.exercises.solutions`), how to run a
candidate, and how to judge what came back, in words a learner can act on.

Two kinds:

* ``local``: the candidate is a plain function (index arithmetic, a cost model); the checker
  calls it in this process on a table of cases.
* ``distributed``: the candidate calls collectives. The checker serialises it with
  ``cloudpickle`` (so a function or class typed into a notebook cell travels by value), starts
  ``world_size`` real processes with :func:`ddp_lesson.launch.run_torchrun` (gloo on CPU,
  whatever the hardware: the exercises use CPU tensors), and each rank runs the candidate
  on its own inputs and writes what it got to a file of its own. The judge then compares
  every rank with the reference. A candidate that raises, or waits in a collective the
  others never join, ends with a verdict that says which rank and why: each worker's process
  group has a short timeout and the whole launch a wall-clock limit. An exercise may name
  several world sizes (``Exercise.world_sizes``); they run in the same launch, so that a
  constant standing in for ``dist.get_world_size()`` fails at one of them.

Local candidates run case by case under a time limit (:func:`call_case`). The shortcuts each
checker is built to catch are listed in ``docs/exercises.md``.
"""
from __future__ import annotations

import functools
import math
import os
import pickle
import re
import shutil
import tempfile
import textwrap
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Seconds a collective may wait inside a checker's worker before it raises
#: (``DDP_LESSON_CHECK_TIMEOUT_S`` overrides it when a check starts; the tests use a shorter one).
COLLECTIVE_TIMEOUT_S = 10.0


def collective_timeout_s() -> float:
    """The per-collective timeout a check starts its workers with, in seconds."""
    return float(os.environ.get("DDP_LESSON_CHECK_TIMEOUT_S", COLLECTIVE_TIMEOUT_S))
#: Wall-clock seconds one checker launch of one candidate may take (start-up of R processes
#: included); each further candidate in the launch adds :func:`candidate_allowance_s`.
LAUNCH_TIMEOUT_S = 90.0

#: The line a checker's worker writes to its stderr as it starts candidate N (``.format(N)``):
#: what a rank wrote after it is about that candidate.
CANDIDATE_MARK = "--- ddp_lesson.exercises: candidate {} ---"


@dataclass
class Verdict:
    """What :func:`~ddp_lesson.exercises.check` found.

    Attributes:
        exercise: the exercise id, e.g. ``"02.1"``.
        title: the exercise's short title.
        passed: True when every case matched the reference.
        problems: what went wrong, the most telling first (empty when passed); the text
            shows the first only.
        checked: one line saying what was run (world sizes, cases).

    ``bool(verdict)`` is ``passed``; ``print(verdict)`` or the notebook's display shows the
    text: a first line with the outcome, then the first problem and a hint.
    """

    exercise: str
    title: str
    passed: bool
    problems: list[str] = field(default_factory=list)
    checked: str = ""

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            lines = [f"PASSED {self.exercise} ({self.title})"]
        else:
            lines = [f"NOT YET {self.exercise} ({self.title})"]
            lines += ["  " + p for p in self.problems[:1]]
            if len(self.problems) > 1:
                lines.append(f"  (and {len(self.problems) - 1} more problem(s): fix this one "
                             "first; all are in verdict.problems)")
        if self.checked:
            lines.append(f"  checked: {self.checked}")
        return "\n".join(lines)

    __repr__ = __str__

    def wrapped(self, width: int = 100) -> str:
        """The text of ``str(verdict)`` with every line wrapped at spaces to ``width`` characters
        (continuations indented), so a notebook's output area never breaks a word."""
        out = []
        for line in str(self).split("\n"):
            indent = " " * (len(line) - len(line.lstrip(" ")))
            out += textwrap.wrap(line, width, subsequent_indent=indent + "  ",
                                 break_long_words=False, break_on_hyphens=False) or [""]
        return "\n".join(out)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's display of the last expression
        printer.text(self.wrapped())


@dataclass
class Exercise:
    """One checkable exercise.

    Attributes:
        id: ``"NN.K"``: notebook NN, exercise K of its Exercises list.
        title: a few words.
        task: what to write, with the signature, in a sentence or three.
        signature: the call the checker makes, e.g. ``"fn(grad, count) -> Tensor"``.
        reference: the package's solution (a function or class).
        kind: ``"local"`` or ``"distributed"``.
        world_size: processes a distributed checker starts.
        world_sizes: for a distributed checker, the world sizes a candidate is run at, judged
            in this order (default: ``(world_size,)``). The launch starts ``max(world_sizes)``
            processes and rebuilds the default process group for each size, so a constant
            standing in for ``dist.get_world_size()`` fails at one of them.
        run_local: ``run_local(fn) -> list[str]`` problems (local exercises).
        run_rank: ``run_rank(fn, rank, world_size) -> result`` (distributed; runs in a worker;
            returns something picklable).
        judge: ``judge(results_by_rank) -> list[str]`` problems (distributed).
        checked: the "checked:" line of the verdict.

    A distributed candidate that raises on any rank stops at that world size, and the next
    candidate runs in a fresh process group (its collectives may have left the ranks out of
    step); a ``run_rank`` that catches a case's error itself raises :class:`StopCandidate` to
    the same effect.
    """

    id: str
    title: str
    task: str
    signature: str
    reference: Any
    kind: str = "local"
    world_size: int = 1
    world_sizes: tuple = ()
    run_local: Callable | None = None
    run_rank: Callable | None = None
    judge: Callable | None = None
    checked: str = ""


    def sizes(self) -> tuple:
        """The world sizes a candidate runs at, in judging order."""
        return tuple(self.world_sizes) or (self.world_size,)


REGISTRY: dict[str, Exercise] = {}


def register(ex: Exercise) -> Exercise:
    """Add ``ex`` to the registry (ids are unique)."""
    if ex.id in REGISTRY:
        raise ValueError(f"exercise {ex.id} registered twice")
    if ex.kind not in ("local", "distributed"):
        raise ValueError(f"exercise {ex.id}: kind {ex.kind!r} is not 'local' or 'distributed'")
    if ex.kind == "distributed" and ex.world_sizes:
        ex.world_size = max(ex.world_sizes)
    REGISTRY[ex.id] = ex
    return ex


def get(exercise_id: str) -> Exercise:
    """The registered exercise ``exercise_id``; KeyError listing the known ids otherwise."""
    key = str(exercise_id).strip()
    if re.fullmatch(r"\d\.\d+", key):  # "2.1" means "02.1"
        key = "0" + key
    try:
        return REGISTRY[key]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise KeyError(f"no exercise {exercise_id!r}; the checkable ones are: {known}") from None


# ----------------------------------------------------------------------------- errors

class StopCandidate(Exception):
    """Raised by a ``run_rank`` that caught a case's error itself: ``result`` is what it has,
    and the candidate stops there; the next one runs in a fresh process group (the ranks may
    be out of step in this one)."""

    def __init__(self, result):
        super().__init__("stop after this candidate")
        self.result = result


class WrongReturn(Exception):
    """The candidate returned something the exercise cannot use (raised by the checker)."""


class CaseTimeout(BaseException):
    """A local candidate did not return within :func:`case_timeout_s` on one case (a
    BaseException, so that a learner's ``except Exception`` does not swallow it)."""


#: Seconds one case of a local check may run (``DDP_LESSON_CHECK_CASE_TIMEOUT_S`` overrides it).
CASE_TIMEOUT_S = 10.0


def case_timeout_s() -> float:
    """The per-case time limit of a local check, in seconds."""
    return float(os.environ.get("DDP_LESSON_CHECK_CASE_TIMEOUT_S", CASE_TIMEOUT_S))


def call_case(fn, args: tuple, case: str):
    """``fn(*args)`` with a time limit: :class:`CaseTimeout` naming ``case`` after
    :func:`case_timeout_s` seconds, so an endless loop ends in a verdict, not a frozen cell.

    The limit is a ``SIGALRM`` timer, which interrupts Python code (a notebook kernel runs
    cells in its main thread); off the main thread, or where there is no such timer
    (Windows), the call runs without a limit.
    """
    import signal
    import threading

    limit = case_timeout_s()
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer") or limit <= 0):
        return fn(*args)

    def expired(signum, frame):
        raise CaseTimeout(f"case {case} did not return within {limit:g} s: an endless loop, "
                          "or work that grows much faster than the inputs?")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a string "4" shows as '4', not 4."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def returned(value, what: str, convert):
    """``convert(value)``, or :class:`WrongReturn` saying what came back instead of ``what``."""
    if value is None:
        raise WrongReturn(f"your function returned None (missing return?); the exercise "
                          f"expects {what}")
    try:
        return convert(value)
    except Exception:
        raise WrongReturn(f"your function returned {shown(value)} ({type(value).__name__}); "
                          f"the exercise expects {what}") from None


def as_number(value) -> float:
    """A real number as float; str, bytes, bool and None are refused (``float("0.2")`` would
    accept a string). A 0-d or 1-element tensor or numpy scalar is fine."""
    import numbers

    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError("not a number")
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1:  # a tensor
        return float(value.reshape(()).item())
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:  # a numpy scalar or array
        return float(value.item())
    raise TypeError("not a number")


def as_whole(value) -> int:
    """A whole number as int (4.0 is 4); anything else is refused."""
    x = as_number(value)
    if x != x or x in (float("inf"), float("-inf")) or x != int(x):
        raise TypeError("not a whole number")
    return int(x)


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Folders of code that is not the learner's: Python's own modules, installed packages
    (torch, cloudpickle, IPython...) and this package; lower-case, '/'-separated."""
    import sysconfig

    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    for mod in ("torch", "cloudpickle", "numpy"):
        try:
            m = __import__(mod)
            roots.add(os.path.dirname(os.path.dirname(m.__file__)))
        except Exception:
            pass
    roots.add(str(Path(__file__).resolve().parent.parent))  # ddp_lesson/
    return tuple(sorted({os.path.realpath(r).replace(os.sep, "/").lower().rstrip("/") + "/"
                         for r in roots}))


def is_library_frame(filename: str) -> bool:
    """True for a frame in Python's own modules, an installed package (torch, ...) or
    ddp_lesson itself: a traceback skips those to show the learner's line."""
    if filename.startswith("<frozen") or filename.startswith("<built-in"):
        return True
    path = filename.replace(os.sep, "/").lower()
    if "/site-packages/" in path or "/dist-packages/" in path:
        return True
    try:
        real = os.path.realpath(filename).replace(os.sep, "/").lower()
    except (OSError, ValueError):
        real = path
    return any(real.startswith(root) or path.startswith(root) for root in _library_roots())


def error_record(exc: BaseException) -> dict:
    """A picklable summary of an exception raised by a candidate: type, message (every line)
    and the innermost frame of the learner's own code (library frames are skipped)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for fr in reversed(frames):
        if is_library_frame(fr.filename):
            continue
        where = f"line {fr.lineno} ({fr.line.strip() if fr.line else fr.name})"
        break
    message = str(exc).strip()
    return {"error": type(exc).__name__, "message": message[:2000], "where": where}


def format_error(rec: dict) -> str:
    """``Type: message at line N (source)``; a message of several lines is joined into one."""
    if rec["error"] in ("WrongReturn", "CaseTimeout"):
        return rec["message"]
    message = " / ".join(line.strip() for line in (rec.get("message") or "").splitlines()
                         if line.strip())
    if len(message) > 300:
        message = message[:297] + "..."
    text = rec["error"] + (f": {message}" if message else "")
    if rec.get("where"):
        text += f" at {rec['where']}"
    return text


_SIZE_MISMATCH = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")


def size_mismatch(text: str) -> tuple[int, int] | None:
    """(bytes that arrived, bytes the receiving buffer holds) when gloo stopped a rank because
    a message was larger than the buffer posted for it, else None."""
    m = _SIZE_MISMATCH.search(text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_timeout_error(rec: dict) -> bool:
    """True for the error a rank gets when a peer never joined its collective."""
    msg = (rec.get("message") or "").lower()
    return ("timed out" in msg or "timeout" in msg or "connection closed by peer" in msg
            or "connection reset" in msg or rec.get("error") == "DistBackendError")


def first_error(results: dict[int, Any]) -> tuple[int, dict] | None:
    """The rank and error record of the most telling failure among ``results``.

    A rank whose own code raised is preferred over ranks that merely timed out waiting for it.
    """
    errors = [
        (r, res) for r, res in sorted(results.items()) if isinstance(res, dict) and "error" in res
    ]
    if not errors:
        return None
    for r, rec in errors:
        if not is_timeout_error(rec):
            return r, rec
    for r, rec in errors:  # a rank that timed out itself, rather than one whose peer left
        if "timed out" in (rec.get("message") or "").lower():
            return r, rec
    return errors[0]


# ----------------------------------------------------------------------------- formatting

def fmt_num(x: float, digits: int = 4) -> str:
    """A float rounded for a verdict: 4 significant digits, no float noise."""
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return str(x)
    if x != x:
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def fmt_list(values, digits: int = 4, limit: int = 8) -> str:
    vals = [fmt_num(v, digits) for v in list(values)[:limit]]
    more = ", ..." if len(list(values)) > limit else ""
    return "[" + ", ".join(vals) + more + "]"


def close(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Element-wise closeness of two equal-length number lists (or two numbers)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    a, b = list(a), list(b)
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=atol)
                                    for x, y in zip(a, b))


# ----------------------------------------------------------------------------- running

def _code_objects(fn) -> list:
    """The code objects of a candidate function, or of a candidate class's methods."""
    import inspect

    targets = [fn] + ([v for v in vars(fn).values() if inspect.isfunction(v)]
                      if isinstance(fn, type) else [])
    return [t.__code__ for t in targets if hasattr(t, "__code__")]


def _source_lines(fn) -> list[str]:
    """Source lines of the file (notebook cell, test file) a candidate was written in.

    cloudpickle renames the file of code it sends by value, so the workers register these
    lines under the new name (``linecache``): a traceback from the candidate then shows the
    learner's line, not just its number.
    """
    import linecache

    for code in _code_objects(fn):
        lines = linecache.getlines(code.co_filename)
        if lines:
            return lines
    return []


def _pickle_candidates(candidates: list, exercise_ids: list[str]) -> bytes:
    """cloudpickle the candidates (with their source lines and each one's exercise id); modules
    the workers cannot import go by value."""
    import sys

    import cloudpickle

    for fn in candidates:
        mod = getattr(fn, "__module__", None)
        if mod == "__main__" or mod is None:
            continue
        if mod and mod != "__main__" and not mod.startswith("ddp_lesson") and mod in sys.modules:
            module = sys.modules[mod]
            if getattr(module, "__file__", None) and "site-packages" not in module.__file__:
                try:
                    cloudpickle.register_pickle_by_value(module)
                except ValueError:
                    pass
    try:
        return cloudpickle.dumps({"exercises": list(exercise_ids), "candidates": candidates,
                                  "sources": [_source_lines(fn) for fn in candidates]})
    except Exception as exc:
        raise TypeError(
            "check() sends your code to the worker processes with cloudpickle, and something "
            f"it uses cannot be sent: {type(exc).__name__}: {exc}. Create such objects (locks, "
            "open files, process groups, ...) inside your function instead.") from None


def run_candidates(exercise_id: str, candidates: list) -> list[Verdict]:
    """Judge several candidates for one exercise; one verdict each, in order.

    Local exercises call each candidate here. Distributed ones run as many candidates as
    possible in one torchrun launch. A candidate that raises or waits in vain on some rank
    (a collective timeout) is judged from what each rank recorded, and when every rank came
    back from it the next candidate runs in a fresh process group of the same launch. A
    candidate that a rank does not come back from (it exits, loops, or gloo aborts the
    process on a size mismatch) ends its launch, and the ones after it get a fresh launch: put
    such candidates last. Each verdict is built from its own candidate's records; what the
    launch as a whole left (stderr, exit codes, the wall clock) is read only for the
    candidate the launch stopped in.

    Synchronisation: none in this process; each launch is a separate job of
    ``world_size`` processes.
    """
    get(exercise_id)  # an unknown id is refused even with no candidates
    return run_pairs([(exercise_id, fn) for fn in candidates])


def run_pairs(pairs: list) -> list[Verdict]:
    """Judge ``(exercise id, candidate)`` pairs, of one exercise or several; one verdict each,
    in the order given.

    Each is judged as :func:`run_candidates` judges it, and distributed candidates of
    exercises that start the same number of processes (``Exercise.world_size``, the largest
    of their world sizes) share launches, in the order given: a test suite judges many
    exercises' candidates in a few launches. Put the candidates that end a launch (a rank
    exits, a size mismatch) last among those of their number of processes.

    Raises:
        KeyError: an unknown exercise id.

    Synchronisation: none in this process; each launch is a separate job.
    """
    items = [(get(exercise_id), fn) for exercise_id, fn in pairs]
    verdicts: list = [None] * len(items)
    by_size: dict[int, list[int]] = {}  # processes -> the items' indices, in order
    for k, (ex, fn) in enumerate(items):
        if ex.kind == "local":
            verdicts[k] = _verdict(ex, _problems_local(ex, fn))
        else:
            by_size.setdefault(ex.world_size, []).append(k)
    for pending in by_size.values():
        while pending:
            done, problems = _launch([items[k] for k in pending])
            for k, found in zip(pending, problems):
                verdicts[k] = _verdict(items[k][0], found)
            pending = pending[done:]
    return verdicts


def _verdict(ex: Exercise, problems: list[str]) -> Verdict:
    return Verdict(ex.id, ex.title, passed=not problems, problems=problems, checked=ex.checked)


def _problems_local(ex: Exercise, fn) -> list[str]:
    try:
        return ex.run_local(fn)
    except WrongReturn as exc:
        return [str(exc) + "."]
    except CaseTimeout as exc:
        return [str(exc)]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the candidate raised (SystemExit included) on some case
        return [f"your function raised {format_error(error_record(exc))}"]


def candidate_allowance_s(ex: Exercise, timeout_s: float) -> float:
    """Wall-clock seconds a launch allows for each candidate after its first: one collective
    timeout and one wait at the ranks' barrier per world size, and a margin."""
    return len(ex.sizes()) * (2 * timeout_s + 5.0)


def _launch(items: list) -> tuple[int, list[list[str]]]:
    """One torchrun launch over ``items`` (``(exercise, candidate)`` pairs whose exercises
    start the same number of processes); returns (how many got a verdict, their problems).

    The launch reached a candidate when some rank saved a record of it. It survived every
    reached candidate but the last (a rank starts the next one only once every rank came back
    from this one), so the launch's own evidence (stderr, the wall clock) is read for the last
    one only; the candidates after it were never run and are left to a fresh launch.
    """
    from ..launch import TorchrunTimeout, run_torchrun

    timeout_s = collective_timeout_s()
    launch_size = max(ex.world_size for ex, _ in items)
    limit_s = LAUNCH_TIMEOUT_S + sum(candidate_allowance_s(ex, timeout_s) for ex, _ in items[1:])
    tmp = Path(tempfile.mkdtemp(prefix="ddp_lesson_check_"))
    try:
        payload = tmp / "candidates.pkl"
        payload.write_bytes(_pickle_candidates([fn for _, fn in items],
                                               [ex.id for ex, _ in items]))
        timed_out = False
        try:
            result = run_torchrun("ddp_lesson.exercises._runner", module=True,
                                  args=[str(payload), str(tmp), str(timeout_s)],
                                  nproc_per_node=launch_size, backend="gloo",
                                  timeout=limit_s, check=False)
        except TorchrunTimeout:
            timed_out, result = True, None
        per_rank = {}
        for r in range(launch_size):
            f = tmp / f"result{r}.pkl"
            try:  # written atomically by the worker; a missing file is a rank that died early
                per_rank[r] = pickle.loads(f.read_bytes()) if f.exists() else []
            except (EOFError, pickle.UnpicklingError):
                per_rank[r] = []
        # Where the launch stopped: the last candidate some rank began (its mark on stderr;
        # a rank gloo aborted may have recorded nothing of it) or recorded; the first
        # candidate gets a verdict even when no rank did either.
        recorded = max(len(records) for records in per_rank.values()) - 1
        last = min(len(items) - 1, max(0, recorded, _last_started(result)))
        problems_all = []
        for i, (ex, _) in enumerate(items[:last + 1]):
            records = {r: rs[i] for r, rs in per_rank.items() if len(rs) > i}
            if i < last:  # survived: every rank came back from it; its records say it all
                problems = _judge_candidate(ex, records, {}, True, False, timeout_s, limit_s)
            else:  # where the launch stopped
                problems = _judge_candidate(ex, records,
                                            None if result is None else _last_words(result),
                                            result is not None, timed_out, timeout_s, limit_s)
            problems_all.append(problems)
        return last + 1, problems_all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_MARK_RE = re.compile(re.escape(CANDIDATE_MARK).replace(r"\{\}", r"(\d+)"))


def _last_started(result) -> int:
    """The highest candidate index any rank of the launch began (its mark), -1 for none."""
    if result is None:
        return -1
    return max((int(m.group(1)) for text in result.errors.values()
                for m in _MARK_RE.finditer(text or "")), default=-1)


def _last_words(result) -> dict[int, str]:
    """Each rank's stderr from the start of the last candidate it began (the launch's
    earlier candidates may have left lines there that say nothing about how it ended)."""
    prefix = CANDIDATE_MARK.split("{}")[0]
    out = {}
    for r, text in result.errors.items():
        text = text or ""
        at = text.rfind(prefix)
        if at >= 0:  # what follows the mark's line
            end = text.find("\n", at)
            text = text[end + 1:] if end >= 0 else ""
        out[r] = text
    return out


def _judge_candidate(ex: Exercise, records: dict, errors: dict | None, finished: bool,
                     timed_out: bool, timeout_s: float, limit_s: float) -> list[str]:
    """Problems of one candidate from ``records`` (rank -> {world size: what it got}), size by
    size in judging order, stopping at the first size with a problem or a failure."""
    problems: list[str] = []
    for W in ex.sizes():
        results = {r: rec[W] for r, rec in records.items() if r < W and W in rec}
        problems, stop = _judge_size(ex, W, results, errors, finished, timed_out, timeout_s,
                                     limit_s)
        if problems or stop:
            break
    return problems


def _judge_size(ex: Exercise, W: int, results: dict, errors: dict | None, finished: bool,
                timed_out: bool, timeout_s: float, limit_s: float) -> tuple[list[str], bool]:
    """Problems of one candidate run at world size ``W`` (``results``: rank -> what it got),
    and whether the candidate stopped there (an error, a hang, a missing rank).

    ``errors``: rank -> its stderr about this candidate (None: none to read); ``finished``:
    the launch ended by itself rather than by its wall clock (``limit_s`` seconds) or was
    survived past this candidate; ``timed_out``: the wall clock ended it in this candidate.
    """
    prefix = f"with {W} processes: " if len(ex.sizes()) > 1 and W != ex.sizes()[0] else ""
    mismatch = _mismatch_problem(errors, W)
    if len(results) == W:
        err = first_error(results)
        if err is None:
            return [prefix + p for p in ex.judge(results)], False
        r, rec = err
        if mismatch:
            return [prefix + mismatch], True
        if is_timeout_error(rec):
            return [prefix + _waiting_problem(results, timeout_s)], True
        return [prefix + _error_problem(r, rec, timeout_s)], True
    # Some rank never finished this candidate: it exited, was still running when the
    # job was ended, or waited for ever.
    missing = sorted(set(range(W)) - set(results))
    err = first_error(results)
    if mismatch:
        return [prefix + mismatch], True
    if err is not None and not is_timeout_error(err[1]):
        r, rec = err
        return [prefix + _error_problem(r, rec, timeout_s)], True
    if err is not None:
        who = ", ".join(map(str, missing))
        why = _crash_reason(errors, missing) if finished else "still running"
        return [prefix +
                f"rank(s) {who} did not finish your function: {why}. The other ranks waited "
                f"for {'it' if len(missing) == 1 else 'them'} in a collective and gave up "
                f"after the checker's {timeout_s:g} s timeout. Does your function exit "
                "(sys.exit, os._exit), loop for a long time, or do slow work on some ranks "
                "only? (For slow but correct code, set DDP_LESSON_CHECK_TIMEOUT_S higher.)"], True
    if timed_out:
        return [prefix +
                f"the run did not finish within {limit_s:.0f} s: rank(s) "
                f"{', '.join(map(str, missing))} still waiting. A rank that waits for a message "
                "nobody sends (a blocking send/recv in the same order on every rank, or a "
                "collective one rank skips) hangs; use isend/irecv for the exchange."], True
    why = _crash_reason(errors, missing)
    return [prefix + f"rank(s) {', '.join(map(str, missing))} died before finishing: {why}"], True


def _mismatch_problem(errors: dict | None, world_size: int) -> str | None:
    """The verdict for a message larger than the buffer posted for it: gloo ends the
    receiving process (SIGABRT), so its peers only see a closed connection or a timeout.
    ``errors``: rank -> its stderr about this candidate."""
    if not errors:
        return None
    for r in range(world_size):
        found = size_mismatch(errors.get(r) or "")
        if found:
            got, room = found
            return (f"size mismatch on the wire: rank {r} received a message of {got} bytes "
                    f"into a buffer of {room} bytes, and gloo stopped the process. A send and "
                    "its matching recv must have the same number of elements and dtype, and "
                    "every rank must pass the same shape to a collective (pad uneven pieces "
                    "to one size).")
    return None


def _crash_reason(errors: dict | None, missing) -> str:
    if errors is None:
        return "no result"
    for r in missing:
        err = [line for line in (errors.get(r) or "").strip().splitlines()
               if "Warning" not in line]
        if err:
            return f"its last words: {err[-1][:300]}"
    return ("no error message: it was still running when the job was ended, or it left "
            "without one (os._exit)")


def _waiting_problem(results: dict, timeout_s: float) -> str:
    """Every rank that failed only waited: say where each one waited, grouped by line."""
    by_where: dict[str, list[int]] = {}
    finished = []
    for r, res in sorted(results.items()):
        if isinstance(res, dict) and "error" in res:
            by_where.setdefault(res.get("where") or "an unknown line", []).append(r)
        else:
            finished.append(r)
    places = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_join(rs)} at {where}"
                       for where, rs in by_where.items())
    text = (f"ranks waited for peers that never answered and gave up after the checker's "
            f"{timeout_s:g} s timeout: {places}")
    if finished:
        text += f"; rank{'s' if len(finished) > 1 else ''} {_join(finished)} finished"
    return text + (". Do all ranks call the same collectives, in the same order, with the same "
                   "shapes? Does every recv have a matching send that is not itself waiting "
                   "(blocking send/recv in the same order on every rank deadlocks; use "
                   "isend/irecv)? (If one rank is only slow, set DDP_LESSON_CHECK_TIMEOUT_S "
                   "higher.)")


def _join(ranks) -> str:
    return ", ".join(map(str, ranks))


def _error_problem(rank: int, rec: dict, timeout_s: float) -> str:
    if rec["error"] == "WrongReturn":
        return f"rank {rank}: {rec['message']}."
    if not is_timeout_error(rec):
        return f"rank {rank} raised {format_error(rec)}"
    return _waiting_problem({rank: rec}, timeout_s)
