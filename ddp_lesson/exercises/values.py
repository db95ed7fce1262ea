"""Reading what a candidate returned, and writing numbers into a verdict.

A checker calls the learner's code through :func:`call_case` (a time limit per case), turns
what came back into the value it compares with :func:`returned` and :func:`as_number` /
:func:`as_whole` (refusing a string where a number belongs), compares with :func:`close`, and
shows values in its sentences with :func:`shown`, :func:`fmt_num`, :func:`fmt_list` and
:func:`ranks_text`.
"""
from __future__ import annotations

import math
import os


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
    The limit is a ``SIGALRM`` timer (main thread only, not on Windows; else no limit)."""
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


def fmt_num(x: float, digits: int = 4) -> str:
    """A float rounded for a verdict: 4 significant digits, no float noise."""
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if x != x:
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def ranks_text(ranks) -> str:
    """``[2, 0]`` -> ``"0, 2"``: ranks in a verdict, in order."""
    return ", ".join(map(str, sorted(ranks)))


def fmt_list(values, digits: int = 4, limit: int = 8) -> str:
    vals = [fmt_num(v, digits) for v in list(values)[:limit]]
    more = ", ..." if len(list(values)) > limit else ""
    return "[" + ", ".join(vals) + more + "]"


def divided_by(got, mean, world_size: int, ks=range(1, 9), **tol) -> int | None:
    """The constant k (not the world size R) for which ``got`` is R x ``mean`` / k: a sum
    over the R ranks divided by k; None when none fits (``tol``: :func:`close`'s)."""
    R = world_size
    return next((k for k in ks if k != R and close(got, [R * v / k for v in mean], **tol)), None)


def close(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Element-wise closeness of two equal-length number lists (or two numbers)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    a, b = list(a), list(b)
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=atol)
                                    for x, y in zip(a, b))
