"""No module of ``ddp_lesson`` uses another module's private name (issue 42).

A name that starts with one underscore is private to its module: a second module that needs it
gets a public name (with a docstring) or the code moves to where it is used. Read with ``ast``,
nothing is imported. The check fails for

* ``from ddp_lesson.x import _name`` and ``from .x import _name`` (any level);
* ``m._name`` where ``m`` is a ddp_lesson module bound by ``import`` (``import ddp_lesson.x as m``,
  ``from ddp_lesson import x``, ``from . import x``), and ``ddp_lesson.x._name``.

Allowed: a private *module* (``_worker``, ``exercises._runner``, ``catalog._shared``: the
underscore says "not for learners", the package's own modules may use it), dunder names
(``__version__``, ``__file__``), and a module's use of its own private names. A private
module's private names are private too (``_worker._x`` fails).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ddp_lesson"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_module(dotted: list[str]) -> bool:
    base = PKG.parent.joinpath(*dotted)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _absolute(path: Path, node: ast.ImportFrom) -> list[str] | None:
    """The dotted module an ``ImportFrom`` names, or None outside ddp_lesson."""
    if not node.level:
        mod = (node.module or "").split(".")
        return mod if mod[0] == "ddp_lesson" else None
    here = _module_of(path)
    base = here if path.name == "__init__.py" else here[:-1]
    base = base[: len(base) - (node.level - 1)]
    return base + (node.module.split(".") if node.module else [])


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, list[str]] = {}  # local name -> the ddp_lesson module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _absolute(path, node)
            if mod is None:
                continue
            for alias in node.names:
                target = mod + [alias.name]
                if _is_module(target):
                    modules[alias.asname or alias.name] = target
                elif _is_private(alias.name):
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} imports "
                                 f"{'.'.join(target)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ddp_lesson":
                    local = alias.asname or "ddp_lesson"
                    modules[local] = alias.name.split(".") if alias.asname else ["ddp_lesson"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, inner = [], node.value
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in modules:
                target = modules[inner.id] + chain
                if _is_module(target) and not _is_module(target + [node.attr]):
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} uses "
                                 f"{'.'.join(target + [node.attr])}")
    return found


def test_no_private_names_cross_modules():
    found = [v for p in sorted(PKG.rglob("*.py")) for v in violations(p)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_catches_each_form(tmp_path, monkeypatch):
    pkg = tmp_path / "ddp_lesson"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "_priv.py", "sub/__init__.py", "sub/b.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "b.py").write_text(
        "import ddp_lesson.a as a\nfrom ddp_lesson import a as a2\nfrom .. import _priv\n"
        "from ..a import _x, y, __version__\nimport ddp_lesson\n"
        "a._f(); a2._g(); _priv._h(); ddp_lesson.a._k(); a.__file__\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    got = violations(pkg / "sub" / "b.py")
    assert sorted(g.split(" ", 2)[2] for g in got) == [
        "ddp_lesson._priv._h", "ddp_lesson.a._f", "ddp_lesson.a._g", "ddp_lesson.a._k",
        "ddp_lesson.a._x"]
