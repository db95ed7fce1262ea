"""Running candidates: :func:`run_candidates` and :func:`run_pairs`, behind
:func:`ddp_lesson.exercises.check`.

What an exercise is lives in :mod:`.registry`; this module runs candidates and collects the
verdicts.

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

Local candidates run case by case under a time limit
(:func:`~ddp_lesson.exercises.values.call_case`). The shortcuts each checker is built to catch
are listed in ``docs/exercises.md``.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

from .errors import error_record, format_error
from .failures import judge_candidate
from .registry import Exercise, Verdict, get
from .values import CaseTimeout, WrongReturn

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


def code_objects(fn) -> list:
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

    for code in code_objects(fn):
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
                problems = judge_candidate(ex, records, {}, True, False, timeout_s, limit_s)
            else:  # where the launch stopped
                problems = judge_candidate(ex, records,
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
