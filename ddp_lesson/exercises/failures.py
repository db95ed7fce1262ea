"""The verdict on a distributed candidate at each world size, from what its ranks recorded.

:func:`judge_candidate` hands a world size whose every rank came back cleanly to the
exercise's own ``judge``; otherwise it says what went wrong with the run itself, in words
that name the ranks: one raised (its error and line), all only waited (where each waited),
a rank never finished (its last words on stderr), the wall clock ran out, or gloo stopped a
process for a message larger than its buffer.
"""
from __future__ import annotations

from .registry import Exercise
from .values import first_error, format_error, is_timeout_error, ranks_text, size_mismatch


def judge_candidate(ex: Exercise, records: dict, errors: dict | None, finished: bool,
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
    err = first_error(results)
    if len(results) == W and err is None:
        return [prefix + p for p in ex.judge(results)], False
    # Some rank raised, waited in vain, or never finished (it exited, was still running when
    # the job was ended, or waited for ever).
    missing = sorted(set(range(W)) - set(results))
    who = ", ".join(map(str, missing))
    mismatch = _mismatch_problem(errors, W)
    if mismatch:
        problem = mismatch
    elif err is not None and not is_timeout_error(err[1]):
        problem = _error_problem(*err)
    elif not missing:
        problem = _waiting_problem(results, timeout_s)
    elif err is not None:
        why = _crash_reason(errors, missing) if finished else "still running"
        problem = (f"rank(s) {who} did not finish your function: {why}. The other ranks waited "
                   f"for {'it' if len(missing) == 1 else 'them'} in a collective and gave up "
                   f"after the checker's {timeout_s:g} s timeout. Does your function exit "
                   "(sys.exit, os._exit), loop for a long time, or do slow work on some ranks "
                   "only? (For slow but correct code, set DDP_LESSON_CHECK_TIMEOUT_S higher.)")
    elif timed_out:
        problem = (f"the run did not finish within {limit_s:.0f} s: rank(s) {who} still "
                   "waiting. A rank waits for ever for a message nobody sends: a blocking "
                   "send/recv in the same order on every rank (isend/irecv avoid it), or a "
                   "collective one rank skips.")
    else:
        problem = f"rank(s) {who} died before finishing: {_crash_reason(errors, missing)}"
    return [prefix + problem], True


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
    places = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {ranks_text(rs)} at {where}"
                       for where, rs in by_where.items())
    text = (f"ranks waited for peers that never answered and gave up after the checker's "
            f"{timeout_s:g} s timeout: {places}")
    if finished:
        text += f"; rank{'s' if len(finished) > 1 else ''} {ranks_text(finished)} finished"
    return text + (". Do all ranks call the same collectives, in the same order, with the same "
                   "shapes? Does every recv have a matching send that is not itself waiting "
                   "(blocking send/recv in the same order on every rank deadlocks; use "
                   "isend/irecv)? (If one rank is only slow, set DDP_LESSON_CHECK_TIMEOUT_S "
                   "higher.)")


def _error_problem(rank: int, rec: dict) -> str:
    if rec["error"] == "WrongReturn":
        return f"rank {rank}: {rec['message']}."
    return f"rank {rank} raised {format_error(rec)}"
