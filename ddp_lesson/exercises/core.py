"""Running candidates: :func:`run_candidates` and :func:`run_pairs`, behind
:func:`ddp_lesson.exercises.check` (what an exercise is lives in :mod:`.registry`).

A ``local`` candidate is called in this process on a table of cases, each under a time limit
(:func:`~ddp_lesson.exercises.values.call_case`). A ``distributed`` one is cloudpickled (a
function typed into a notebook cell travels by value) and run by ``world_size`` real processes
(:func:`ddp_lesson.launch.run_torchrun`, gloo on CPU); each rank writes what it got to a file
of its own and the judge compares every rank with the reference. A rank that raises, or waits
in a collective the others never join, ends in a verdict naming it: each worker's group has a
short timeout and the launch a wall-clock limit. An exercise's world sizes
(``Exercise.world_sizes``) run in the same launch, so that a constant standing in for
``dist.get_world_size()`` fails at one of them. ``docs/exercises.md`` lists the shortcuts
each checker catches.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
from pathlib import Path

from .failures import judge_candidate
from .registry import Exercise, Verdict, get
from .values import CaseTimeout, WrongReturn, error_record, format_error

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
    """Source lines of the file (notebook cell, test file) a candidate was written in: the
    workers register them under the name cloudpickle gives the code (``linecache``), so a
    traceback shows the learner's line, not just its number."""
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
        name = getattr(fn, "__module__", None) or "__main__"
        module = sys.modules.get(name)
        if (name != "__main__" and not name.startswith("ddp_lesson") and module is not None
                and "site-packages" not in (getattr(module, "__file__", None) or "site-packages")):
            with contextlib.suppress(ValueError):
                cloudpickle.register_pickle_by_value(module)
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

    Distributed ones share one torchrun launch while they can: after a candidate that raised
    or timed out on some rank, but that every rank came back from, the next runs in a fresh
    process group of the same launch; one that a rank does not come back from (it exits,
    loops, gloo aborts it on a size mismatch) ends the launch, and the rest get a fresh one
    (put such candidates last). What the launch as a whole left (stderr, exit codes, the wall
    clock) is read only for the candidate it stopped in.

    Synchronisation: none in this process; each launch is a separate job.
    """
    get(exercise_id)  # an unknown id is refused even with no candidates
    return run_pairs([(exercise_id, fn) for fn in candidates])


def run_pairs(pairs: list) -> list[Verdict]:
    """Judge ``(exercise id, candidate)`` pairs, of one exercise or several; one verdict each,
    in the order given, as :func:`run_candidates` does. Distributed candidates of exercises
    that start as many processes (``Exercise.world_size``) share launches, in that order.

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
    """One torchrun launch over ``items`` (``(exercise, candidate)`` pairs that start as many
    processes); returns (how many got a verdict, their problems). The launch survived every
    candidate some rank recorded but the last (a rank starts the next one only once every rank
    came back), so its stderr and wall clock are read for that last one only; those after it
    are left to a fresh launch."""
    from ..launch import TorchrunTimeout, run_torchrun

    timeout_s = collective_timeout_s()
    launch_size = max(ex.world_size for ex, _ in items)
    limit_s = LAUNCH_TIMEOUT_S + sum(candidate_allowance_s(ex, timeout_s) for ex, _ in items[1:])
    with tempfile.TemporaryDirectory(prefix="ddp_lesson_check_",
                                     ignore_cleanup_errors=True) as name:
        tmp = Path(name)
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
            per_rank[r] = []  # written atomically by the worker; none: a rank that died early
            with contextlib.suppress(FileNotFoundError, EOFError, pickle.UnpicklingError):
                per_rank[r] = pickle.loads(f.read_bytes())
        # Where the launch stopped: the last candidate some rank began (its mark on stderr;
        # a rank gloo aborted may have recorded nothing of it) or recorded; the first
        # candidate gets a verdict even when no rank did either.
        recorded = max(len(records) for records in per_rank.values()) - 1
        last = min(len(items) - 1, max(0, recorded, _last_started(result)))
        problems_all = []
        for i, (ex, _) in enumerate(items[:last + 1]):
            records = {r: rs[i] for r, rs in per_rank.items() if len(rs) > i}
            if i < last:  # survived: every rank came back from it; its records say it all
                args = ({}, True, False)
            else:  # where the launch stopped
                args = (None if result is None else _last_words(result), result is not None,
                        timed_out)
            problems_all.append(judge_candidate(ex, records, *args, timeout_s, limit_s))
        return last + 1, problems_all


_MARK_RE = re.compile(re.escape(CANDIDATE_MARK).replace(r"\{\}", r"(\d+)"))


def _last_started(result) -> int:
    """The highest candidate index any rank of the launch began (its mark), -1 for none."""
    if result is None:
        return -1
    return max((int(m.group(1)) for text in result.errors.values()
                for m in _MARK_RE.finditer(text or "")), default=-1)


def _last_words(result) -> dict[int, str]:
    """Each rank's stderr from the mark of the last candidate it began on."""
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
