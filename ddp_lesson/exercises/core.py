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
  group has a short timeout and the whole launch a wall-clock limit.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: Seconds a collective may wait inside a checker's worker before it raises
#: (``DDP_LESSON_CHECK_TIMEOUT_S`` overrides it when a check starts; the tests use a shorter one).
COLLECTIVE_TIMEOUT_S = 10.0


def collective_timeout_s() -> float:
    """The per-collective timeout a check starts its workers with, in seconds."""
    return float(os.environ.get("DDP_LESSON_CHECK_TIMEOUT_S", COLLECTIVE_TIMEOUT_S))
#: Wall-clock seconds one checker launch may take (start-up of R processes included).
LAUNCH_TIMEOUT_S = 90.0


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

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's display of the last expression
        printer.text(str(self))


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
        run_local: ``run_local(fn) -> list[str]`` problems (local exercises).
        run_rank: ``run_rank(fn, rank, world_size) -> result`` (distributed; runs in a worker;
            returns something picklable).
        judge: ``judge(results_by_rank) -> list[str]`` problems (distributed).
        checked: the "checked:" line of the verdict.

    A distributed candidate that raises on any rank ends its launch (its collectives may have
    left the ranks out of step); a ``run_rank`` that catches a case's error itself raises
    :class:`StopCandidate` to the same effect.
    """

    id: str
    title: str
    task: str
    signature: str
    reference: Any
    kind: str = "local"
    world_size: int = 1
    run_local: Callable | None = None
    run_rank: Callable | None = None
    judge: Callable | None = None
    checked: str = ""


REGISTRY: dict[str, Exercise] = {}


def register(ex: Exercise) -> Exercise:
    """Add ``ex`` to the registry (ids are unique)."""
    if ex.id in REGISTRY:
        raise ValueError(f"exercise {ex.id} registered twice")
    if ex.kind not in ("local", "distributed"):
        raise ValueError(f"exercise {ex.id}: kind {ex.kind!r} is not 'local' or 'distributed'")
    REGISTRY[ex.id] = ex
    return ex


def get(exercise_id: str) -> Exercise:
    """The registered exercise ``exercise_id``; KeyError listing the known ids otherwise."""
    from . import _load_all

    _load_all()
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
    and no further candidate may run in this launch (the ranks may be out of step)."""

    def __init__(self, result):
        super().__init__("stop after this candidate")
        self.result = result


class WrongReturn(Exception):
    """The candidate returned something the exercise cannot use (raised by the checker)."""


def returned(value, what: str, convert):
    """``convert(value)``, or :class:`WrongReturn` saying what came back instead of ``what``."""
    try:
        return convert(value)
    except Exception:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise WrongReturn(f"your function returned {shown} ({type(value).__name__}); "
                          f"the exercise expects {what}") from None


def error_record(exc: BaseException) -> dict:
    """A picklable summary of an exception raised by a candidate: type, message, last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for fr in reversed(frames):  # the innermost frame of the learner's own code, if any
        path = fr.filename.replace(os.sep, "/")
        if "/ddp_lesson/" in path or "/site-packages/" in path or "/lib/python" in path:
            continue
        where = f"line {fr.lineno} ({fr.line.strip() if fr.line else fr.name})"
        break
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return {"error": type(exc).__name__, "message": message[:300], "where": where}


def format_error(rec: dict) -> str:
    if rec["error"] == "WrongReturn":
        return rec["message"]
    text = rec["error"] + (f": {rec['message']}" if rec.get("message") else "")
    if rec.get("where"):
        text += f" at {rec['where']}"
    return text


def is_timeout_error(rec: dict) -> bool:
    """True for the error a rank gets when a peer never joined its collective."""
    msg = (rec.get("message") or "").lower()
    return ("timed out" in msg or "timeout" in msg or "connection closed by peer" in msg
            or "connection reset" in msg or rec.get("error") == "DistBackendError")


def first_error(results: dict[int, Any]) -> tuple[int, dict] | None:
    """The rank and error record of the most telling failure among ``results``.

    A rank whose own code raised is preferred over ranks that merely timed out waiting for it.
    """
    errors = [(r, res) for r, res in sorted(results.items()) if isinstance(res, dict) and "error" in res]
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


def _pickle_candidates(candidates: list) -> bytes:
    """cloudpickle the candidates (and their source lines); modules the workers cannot import go by value."""
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
        return cloudpickle.dumps({"candidates": candidates,
                                  "sources": [_source_lines(fn) for fn in candidates]})
    except Exception as exc:
        raise TypeError(
            "check() sends your code to the worker processes with cloudpickle, and something "
            f"it uses cannot be sent: {type(exc).__name__}: {exc}. Create such objects (locks, "
            "open files, process groups, ...) inside your function instead.") from None


def run_candidates(exercise_id: str, candidates: list) -> list[Verdict]:
    """Judge several candidates for one exercise; one verdict each, in order.

    Local exercises call each candidate here. Distributed ones run as many candidates as
    possible in one torchrun launch: a candidate that raises or hangs ends its launch (the
    ranks may be out of step), and the ones after it get a fresh launch.

    Synchronisation: none in this process; each launch is a separate job of
    ``world_size`` processes.
    """
    ex = get(exercise_id)
    if not candidates:
        return []
    if ex.kind == "local":
        return [_verdict(ex, _problems_local(ex, fn)) for fn in candidates]
    verdicts: list[Verdict] = []
    pending = list(candidates)
    while pending:
        done, problems = _launch(ex, pending)
        verdicts += [_verdict(ex, p) for p in problems]
        pending = pending[done:]
    return verdicts


def _verdict(ex: Exercise, problems: list[str]) -> Verdict:
    return Verdict(ex.id, ex.title, passed=not problems, problems=problems, checked=ex.checked)


def _problems_local(ex: Exercise, fn) -> list[str]:
    try:
        return ex.run_local(fn)
    except WrongReturn as exc:
        return [str(exc) + "."]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the candidate raised (SystemExit included) on some case
        return [f"your function raised {format_error(error_record(exc))}"]


def _launch(ex: Exercise, candidates: list) -> tuple[int, list[list[str]]]:
    """One torchrun launch over ``candidates``; returns (how many got a verdict, their problems)."""
    from ..launch import TorchrunTimeout, run_torchrun

    timeout_s = collective_timeout_s()
    tmp = Path(tempfile.mkdtemp(prefix="ddp_lesson_check_"))
    try:
        payload = tmp / "candidates.pkl"
        payload.write_bytes(_pickle_candidates(candidates))
        timed_out = False
        try:
            result = run_torchrun("ddp_lesson.exercises._runner", module=True,
                                  args=[ex.id, str(payload), str(tmp), str(timeout_s)],
                                  nproc_per_node=ex.world_size, backend="gloo",
                                  timeout=LAUNCH_TIMEOUT_S, live=False, check=False)
        except TorchrunTimeout:
            timed_out, result = True, None
        per_rank = {}
        for r in range(ex.world_size):
            f = tmp / f"result{r}.pkl"
            per_rank[r] = pickle.loads(f.read_bytes()) if f.exists() else []
        problems_all: list[list[str]] = []
        for i in range(len(candidates)):
            results = {r: per_rank[r][i] for r in per_rank if len(per_rank[r]) > i}
            if not results and i > 0:  # the launch stopped after the previous candidate
                return i, problems_all
            if len(results) == ex.world_size:
                err = first_error(results)
                if err is not None:
                    r, rec = err
                    if is_timeout_error(rec):
                        problems_all.append([_waiting_problem(results, timeout_s)])
                    else:
                        problems_all.append([_error_problem(r, rec, timeout_s)])
                    return i + 1, problems_all
                problems_all.append(ex.judge(results))
                continue
            # Some rank never finished this candidate: it exited, was still running when the
            # job was ended, or waited for ever.
            missing = sorted(set(range(ex.world_size)) - set(results))
            err = first_error(results)
            if err is not None and not is_timeout_error(err[1]):
                r, rec = err
                problems_all.append([_error_problem(r, rec, timeout_s)])
            elif err is not None:
                who = ", ".join(map(str, missing))
                why = _crash_reason(result, missing) if result is not None else "still running"
                problems_all.append([
                    f"rank(s) {who} did not finish your function: {why}. The other ranks waited "
                    f"for {'it' if len(missing) == 1 else 'them'} in a collective and gave up "
                    f"after the checker's {timeout_s:g} s timeout. Does your function exit "
                    "(sys.exit, os._exit), loop for a long time, or do slow work on some ranks "
                    "only? (For slow but correct code, set DDP_LESSON_CHECK_TIMEOUT_S higher.)"])
            elif timed_out:
                problems_all.append([
                    f"the run did not finish within {LAUNCH_TIMEOUT_S:.0f} s: rank(s) "
                    f"{', '.join(map(str, missing))} still waiting. A rank that waits for a message "
                    "nobody sends (a blocking send/recv in the same order on every rank, or a "
                    "collective one rank skips) hangs; use isend/irecv for the exchange."])
            else:
                why = _crash_reason(result, missing)
                problems_all.append([f"rank(s) {', '.join(map(str, missing))} died before "
                                     f"finishing: {why}"])
            return i + 1, problems_all
        return len(candidates), problems_all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _crash_reason(result, missing) -> str:
    if result is None:
        return "no result"
    for r in missing:
        err = [line for line in (result.errors.get(r) or "").strip().splitlines()
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
