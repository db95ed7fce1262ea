"""Auto-checked exercises: ``check("02.1", MySampler)`` judges your code against the package's.

Every notebook ends with exercises; the ones you can code have an id ``"NN.K"`` (notebook NN,
exercise K) and a checker::

    from ddp_lesson.exercises import check, describe
    describe("02.1")            # the task and the call the checker makes
    check("02.1", MySampler)    # PASSED, or NOT YET with what went wrong on which rank

Distributed exercises run your function or class on several real processes through
torchrun (gloo on CPU, whatever the hardware; a few seconds each), so a collective that
hangs or a rank that raises ends in a verdict naming the rank, not a frozen notebook.
The reference solutions live in :mod:`ddp_lesson.exercises.solutions` (spoilers);
``reference("02.1")`` returns one. Each exercise's checker is a module of its own in
:mod:`ddp_lesson.exercises.catalog` (``catalog/ex_02_1_sampler.py``, ...).
"""
from __future__ import annotations

# the catalogue registers every exercise in registry.REGISTRY when imported; importing it here
# (rather than from registry.get) keeps the registry free of an import of its own exercises
from . import catalog  # noqa: F401
from .core import run_candidates
from .registry import REGISTRY, Exercise, Verdict, get

__all__ = ["check", "describe", "reference", "exercise_ids", "Verdict", "Exercise"]


def exercise_ids(notebook: str | None = None) -> list[str]:
    """Ids of the checkable exercises, sorted; only notebook ``"02"``'s when given."""
    return sorted(i for i in REGISTRY if notebook is None or i.split(".")[0] == notebook)


def describe(exercise_id: str) -> str:
    """The exercise's task, the call its checker makes, and what it runs, as text.

    Raises:
        KeyError: an unknown id (the message lists the known ones).
    """
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
    """Run ``candidate`` as exercise ``exercise_id`` asks and judge it against the reference.

    Args:
        exercise_id: ``"NN.K"``, e.g. ``"02.1"``; see :func:`exercise_ids`.
        candidate: your function (or class, for a sampler). For distributed exercises it is
            sent by value to each worker (cloudpickle), so define what it needs inside it or
            import it at the top of its own body; globals of the notebook go along by value.

    Returns:
        A :class:`Verdict`: truthy when passed; its text says what went wrong where.

    Raises:
        KeyError: unknown ``exercise_id``.
        TypeError: ``candidate`` is not callable.

    Synchronisation: none here. A distributed checker starts and ends its own torchrun job
    of ``world_size`` processes (about 5 s on a laptop CPU); do not call it from inside a
    ``%%torchrun`` cell.
    """
    if not callable(candidate):
        raise TypeError(f"check({exercise_id!r}, ...) needs your function or class, got "
                        f"{type(candidate).__name__}")
    return run_candidates(exercise_id, [candidate])[0]
