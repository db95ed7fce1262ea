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

_HUNK = re.compile(r"^@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")


def code_lines(path: Path, text: str | None = None) -> tuple[int, list[str]]:
    """``(offset, lines)``: the lines of the Python file ``path`` (or of ``text``) after its
    module docstring (found with ``ast``), ``lines[0]`` being line ``offset + 1``.

    Raises:
        OSError: the file cannot be read.
        SyntaxError: it does not parse.
    """
    lines = (path.read_text() if text is None else text).splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    first = tree.body[0] if tree.body else None
    end = 0
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        end = first.end_lineno or 0
    return end, lines[end:]


def script_diff(a: Path, b: Path, context: int = 1, a_text: str | None = None,
                b_text: str | None = None) -> str:
    """The unified diff of two Python scripts ``a`` -> ``b`` (or of ``a_text``/``b_text``),
    module docstrings left out, with the files' real line numbers and ``context`` lines
    (notebook 05's conversion, the seed's repairs in ``ddp_lesson.seedfix``).

    Raises:
        OSError, SyntaxError: as :func:`code_lines`.
    """
    (a_off, a_lines), (b_off, b_lines) = code_lines(a, a_text), code_lines(b, b_text)
    out = []
    for line in difflib.unified_diff(a_lines, b_lines, a.name, b.name, n=context):
        m = _HUNK.match(line)
        if m:
            line = (f"@@ -{int(m.group(1)) + a_off}{m.group(2) or ''} "
                    f"+{int(m.group(3)) + b_off}{m.group(4) or ''} @@\n")
        out.append(line if line.endswith("\n") else line + "\n")
    return "".join(out)


def conversion_hunks(single: Path = SINGLE, ddp: Path = DDP) -> list[str]:
    """The hunks of :func:`script_diff` ``(single, ddp, context=0)``, each one string.

    Raises:
        OSError: a file cannot be read.
    """
    hunks: list[str] = []
    for line in script_diff(single, ddp, context=0).splitlines(keepends=True)[2:]:
        if line.startswith("@@"):
            hunks.append("")
        hunks[-1] += line
    return hunks


class ConversionDiff:
    """The conversion's hunks, shown a few at a time so that prose can explain each::

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
        """Print (and mark shown) every hunk containing one of ``needles``, in file order.

        Raises:
            LookupError: no hunk contains any (the files changed under their prose).
        """
        picked = [i for i, h in enumerate(self.hunks) if any(n in h for n in needles)]
        if not picked:
            raise LookupError(f"no hunk of the conversion contains {needles}")
        self.shown.update(picked)
        print("".join(self.hunks[i] for i in picked), end="")

    def unshown(self) -> list[str]:
        """The hunks no :meth:`show` has printed yet."""
        return [h for i, h in enumerate(self.hunks) if i not in self.shown]
