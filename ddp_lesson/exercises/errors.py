"""What a candidate's error says: a picklable record of it, its text, and what kind it is.

A worker turns an exception into :func:`error_record` (type, message, the learner's innermost
line: :func:`is_library_frame` skips Python's, torch's and this package's frames); a verdict
shows it with :func:`format_error`. :func:`is_timeout_error` tells a rank that only waited
from one whose own code raised, and :func:`first_error` picks the most telling of the ranks'
errors; :func:`size_mismatch` reads gloo's line for a message larger than its buffer.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
from pathlib import Path
from typing import Any


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
