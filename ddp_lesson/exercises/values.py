"""What a candidate gave back (a value or an error), and numbers in a verdict.

A checker calls the learner's code through :func:`call_case` (a time limit per case), turns
what came back into the value it compares with :func:`returned` and :func:`as_number` /
:func:`as_whole` (refusing a string where a number belongs), compares with :func:`close`, and
shows values with :func:`shown`, :func:`fmt_num`, :func:`fmt_list` and :func:`ranks_text`.

An exception becomes :func:`error_record` (type, message, the learner's innermost line:
:func:`is_library_frame` skips Python's, torch's and this package's frames), shown by
:func:`format_error`; :func:`is_timeout_error` tells a rank that only waited from one whose
own code raised, :func:`first_error` picks the most telling of the ranks' errors, and
:func:`size_mismatch` reads gloo's line for a message larger than its buffer.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import traceback
from pathlib import Path
from typing import Any


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
    return "0" if x == 0 else f"{x:.{digits}g}"  # -0.0 too


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


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Folders of code that is not the learner's: Python's own modules, installed packages
    (torch, cloudpickle, IPython...) and this package; lower-case, '/'-separated."""
    import sysconfig

    roots = [sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    for mod in ("torch", "cloudpickle", "numpy"):
        with contextlib.suppress(Exception):
            roots.append(os.path.dirname(os.path.dirname(__import__(mod).__file__)))
    roots.append(str(Path(__file__).resolve().parent.parent))  # ddp_lesson/
    return tuple(sorted({os.path.realpath(r).replace(os.sep, "/").lower().rstrip("/") + "/"
                         for r in roots if r}))


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
    where = next((f"line {fr.lineno} ({fr.line.strip() if fr.line else fr.name})"
                  for fr in reversed(traceback.extract_tb(exc.__traceback__))
                  if not is_library_frame(fr.filename)), "")
    return {"error": type(exc).__name__, "message": str(exc).strip()[:2000], "where": where}


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
    """The rank and error record of the most telling failure among ``results``: a rank whose
    own code raised before ranks that merely timed out waiting for it."""
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
