"""The benchmarks' package: no import circle, one set of launcher flags, short functions.

No timing here: the flags are parsed, not run (tests/collectives/test_cost_model.py runs a tiny
sweep).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddp_lesson.bench import BENCHMARKS
from ddp_lesson.bench.common import figure_target, parse_counts, spread
from ddp_lesson.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ddp_lesson" / "bench"


def _package_imports(path: Path) -> set[str]:
    """Modules of ddp_lesson that ``path`` imports (at any depth: top level or in functions)."""
    tree = ast.parse(path.read_text())
    base = "ddp_lesson.bench"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("ddp_lesson"):
                out.add(node.module)
            elif node.level:
                parent = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{parent}.{node.module}" if node.module else parent
                out |= ({mod} if node.module else {f"{mod}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ddp_lesson")}
    return out


def test_no_import_circle_between_the_benchmarks():
    mods = {p.stem: _package_imports(p) for p in BENCH.glob("*.py")}
    assert mods["common"] == set()                   # the base layer imports nothing of ours
    for name in ("allreduce", "ddp", "scaling"):
        others = {f"ddp_lesson.bench.{o}" for o in ("allreduce", "ddp", "scaling") if o != name}
        assert not mods[name] & others, name           # no benchmark imports another
        assert "ddp_lesson.cli" not in mods[name]      # nor the command line that dispatches it
        assert "ddp_lesson.bench.common" in mods[name]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_takes_the_same_launcher_flags(name):
    p = _parser()
    opts = p.parse_args(["bench", name, "--nprocs", "2", "4", "--repeats", "3", "--out",
                         "runs/x/a.csv", "--figure", "none", "--backend", "gloo",
                         "--timeout", "30"])
    assert parse_counts(opts.nprocs) == [2, 4]
    assert (opts.repeats, opts.out, opts.backend, opts.timeout) == (3, "runs/x/a.csv", "gloo", 30)
    assert figure_target(opts) is None                 # 'none' skips the figure, never none.png
    assert figure_target(p.parse_args(["bench", name, "--figure", "NONE"])) is None
    opts = p.parse_args(["bench", name, "--out", "runs/x/b.csv", "--nprocs", "1,2"])
    assert figure_target(opts) == "runs/x/b.png" and parse_counts(opts.nprocs) == [1, 2]
    assert figure_target(p.parse_args(["bench", name, "--figure", "f.png"])) == "f.png"
    assert callable(opts.run)


def test_bad_counts_and_unknown_flags_are_refused(capsys):
    with pytest.raises(ValueError, match="--nprocs needs counts >= 1"):
        parse_counts(["2,0"])
    from ddp_lesson.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--no-such-flag", "1"])
    assert "unrecognized arguments: --no-such-flag 1" in capsys.readouterr().err


def test_spread_is_min_median_max():
    assert spread([3.0, 1.0, 2.0, 10.0]) == (1.0, 2.5, 10.0)
    with pytest.raises(ValueError):
        spread([])


def test_no_function_over_80_lines_in_the_benchmarks_and_cli():
    for path in [*BENCH.glob("*.py"), ROOT / "ddp_lesson" / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = range(node.body[0].lineno, node.end_lineno + 1)
                lines = path.read_text().splitlines()
                code = [i for i in body if lines[i - 1].strip()
                        and not lines[i - 1].strip().startswith("#")]
                assert len(code) <= 80, f"{path.name}:{node.name} has {len(code)} lines of code"
