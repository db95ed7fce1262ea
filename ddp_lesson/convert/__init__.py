"""A single-process training script and its data-parallel version, side by side.

``single.py`` is the kind of script a learner starts from; ``ddp.py`` is the same script
converted to ``DistributedDataParallel``, changed only where data parallelism needs it, so the
unified diff of the two files is the conversion. Notebook 05 shows that diff, computed here
from the files at run time (it cannot drift from the code), and runs both. The two scripts
are plain torch: they import only the package's toy data and model (``ddp_lesson.gradients``).
"""
from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SINGLE, DDP = HERE / "single.py", HERE / "ddp.py"

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _docstring_end(lines: list[str]) -> int:
    """The last line (1-based) of a module's docstring, 0 for none."""
    tree = ast.parse("".join(lines))
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        return first.end_lineno or 0
    return 0


def conversion_hunks(single: Path = SINGLE, ddp: Path = DDP) -> list[str]:
    """The hunks of ``difflib.unified_diff(single, ddp, n=0)``, each a string of its header and
    its ``-``/``+`` lines, with line numbers of the real files; the module docstrings (which
    describe each script, and differ throughout) are left out.

    Raises:
        OSError: a file cannot be read.
    """
    a = single.read_text().splitlines(keepends=True)
    b = ddp.read_text().splitlines(keepends=True)
    skip = _docstring_end(a)
    hunks: list[list[str]] = []
    for line in difflib.unified_diff(a, b, "single.py", "ddp.py", n=0):
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            hunks.append([])
        hunks[-1].append(line if line.endswith("\n") else line + "\n")
    kept = []
    for hunk in hunks:
        start, count = _HUNK.match(hunk[0]).group(1, 2)
        last = int(start) + (1 if count is None else int(count)) - 1
        if last > skip or (count == "0" and int(start) >= skip):
            kept.append("".join(hunk))
    return kept


class ConversionDiff:
    """The conversion's hunks, shown a few at a time with :meth:`show`, so that prose can
    explain each right below it; :meth:`unshown` says what no :meth:`show` has printed yet.

    Example::

        diff = ConversionDiff()
        diff.show("DistributedSampler", "set_epoch")   # every hunk naming either
        diff.unshown()                                 # [] once every hunk was shown
    """

    def __init__(self, single: Path = SINGLE, ddp: Path = DDP):
        self.hunks = conversion_hunks(single, ddp)
        self.shown: set[int] = set()

    def changed_lines(self) -> tuple[int, int]:
        """``(removed, added)``: lines of ``single.py`` replaced, lines of ``ddp.py`` added."""
        minus = sum(line.startswith("-") for h in self.hunks for line in h.splitlines())
        plus = sum(line.startswith("+") for h in self.hunks for line in h.splitlines())
        return minus, plus

    def show(self, *needles: str) -> None:
        """Print every hunk whose text contains one of ``needles`` (in file order), and mark
        it shown.

        Raises:
            LookupError: no hunk contains any of ``needles`` (the files changed under the
                prose that explains them).
        """
        picked = [i for i, h in enumerate(self.hunks) if any(n in h for n in needles)]
        if not picked:
            raise LookupError(f"no hunk of the conversion contains {needles}")
        self.shown.update(picked)
        print("".join(self.hunks[i] for i in picked), end="")

    def unshown(self) -> list[str]:
        """The hunks no :meth:`show` has printed yet."""
        return [h for i, h in enumerate(self.hunks) if i not in self.shown]
