"""What an exercise is: :class:`Exercise`, the :class:`Verdict` a check returns, and the registry.

Each module of :mod:`ddp_lesson.exercises.catalog` builds one :class:`Exercise` (its reference
solution, how to run a candidate, how to judge what came back) and calls :func:`register`;
:func:`get` finds it by id.
"""
from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Verdict:
    """What :func:`~ddp_lesson.exercises.check` found: the exercise id and title, whether
    every case matched the reference (``bool(verdict)``), the problems (most telling first;
    the text shows the first only) and the "checked:" line saying what was run."""

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
        """``str(verdict)`` wrapped at spaces to ``width`` characters (continuations indented),
        so a notebook's output area never breaks a word."""
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
        title, task: a few words; what to write, with the signature.
        signature: the call the checker makes, e.g. ``"fn(grad, count) -> Tensor"``.
        reference: the package's solution (a function or class).
        kind: ``"local"`` or ``"distributed"``.
        world_size: processes a distributed checker starts (``max(world_sizes)``).
        world_sizes: the world sizes a distributed candidate runs at, in judging order
            (default ``(world_size,)``); the default group is rebuilt for each.
        run_local: ``run_local(fn) -> list[str]`` problems (local exercises).
        run_rank: ``run_rank(fn, rank, world_size) -> result`` (picklable; in a worker).
        judge: ``judge(results_by_rank) -> list[str]`` problems (distributed).
        checked: the "checked:" line of the verdict.

    A distributed candidate that raises on any rank (or whose ``run_rank`` raises
    :class:`StopCandidate`) stops at that world size; the next runs in a fresh process group.
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


class StopCandidate(Exception):
    """Raised by a ``run_rank`` that caught a case's error itself: ``result`` is what it has,
    and the candidate stops there (the ranks may be out of step)."""

    def __init__(self, result):
        super().__init__("stop after this candidate")
        self.result = result
