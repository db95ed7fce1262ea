"""Auto-checked exercises: ``check("02.1", MySampler)`` judges your code against the package's.

The exercises you can code have an id ``"NN.K"`` (notebook NN, exercise K) and a checker::

    from ddp_lesson.exercises import check, describe
    describe("02.1")            # the task and the call the checker makes
    check("02.1", MySampler)    # PASSED, or NOT YET with what went wrong on which rank

Distributed exercises run your code on several real processes through torchrun (gloo on CPU,
a few seconds each): a collective that hangs or a rank that raises ends in a verdict naming the
rank. ``reference("02.1")`` returns a reference solution (:mod:`.solutions`, spoilers); each
checker is a module of :mod:`.catalog` (``catalog/ex_02_1_sampler.py``, ...).
"""
from __future__ import annotations

# importing the catalogue registers every exercise (here, so the registry never imports it)
from . import catalog  # noqa: F401
from .core import run_candidates
from .registry import REGISTRY, Exercise, Verdict, get

__all__ = ["check", "describe", "reference", "exercise_ids", "Verdict", "Exercise"]


def exercise_ids(notebook: str | None = None) -> list[str]:
    """Ids of the checkable exercises, sorted; only notebook ``"02"``'s when given."""
    return sorted(i for i in REGISTRY if notebook is None or i.split(".")[0] == notebook)


def describe(exercise_id: str) -> str:
    """The exercise's task, the call its checker makes, and what it runs, as text; KeyError
    (listing the known ids) for an unknown id."""
    ex = get(exercise_id)
    where = "runs" if ex.kind == "distributed" else "runs in this process"
    kind = "class" if isinstance(ex.reference, type) else "function"
    return (
        f"{ex.id} · {ex.title}\n{ex.task}\nchecked as: {ex.signature}\n"
        f"{where}: {ex.checked}\n"
        f'check it with: check("{ex.id}", your_{kind})'
    )


def reference(exercise_id: str):
    """The package's reference solution of ``exercise_id`` (a function or class). Spoiler."""
    return get(exercise_id).reference


def check(exercise_id: str, candidate) -> Verdict:
    """Run ``candidate`` as exercise ``exercise_id`` (``"NN.K"``) asks and judge it against
    the reference; a :class:`Verdict`, truthy when passed, whose text says what went wrong where.

    A distributed exercise's ``candidate`` (function or class) is sent by value to each
    worker (cloudpickle, the notebook's globals with it): import what it needs in its body.

    Raises:
        KeyError: unknown ``exercise_id``.
        TypeError: ``candidate`` is not callable.

    Synchronisation: none here. A distributed checker starts and ends its own torchrun job
    (about 5 s on a laptop CPU); do not call it from inside a ``%%torchrun`` cell.
    """
    if not callable(candidate):
        raise TypeError(f"check({exercise_id!r}, ...) needs your function or class, got "
                        f"{type(candidate).__name__}")
    return run_candidates(exercise_id, [candidate])[0]
