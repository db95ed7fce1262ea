"""The package's layers, read from its source (docs/architecture.md states the same rules).

* every module belongs to one layer; a module imports only from its own layer or lower ones;
* no import circle among the package's modules (imports inside functions count too: a circle
  hidden in a function still ties two modules together);
* no function is over 80 lines of code (blank lines, comments and docstrings not counted).

Pure source reading with ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ddp_lesson"
MAX_FUNCTION_LOC = 80

#: Layer of each module, lowest first; a module's layer is that of its longest listed prefix.
#: Keep in step with docs/architecture.md.
LAYERS = {
    "teaching core": ["core"],
    "runtime": ["env", "procs", "launch", "_worker", "cluster", "doctor"],
    "lesson core": ["sampler", "layout", "collectives", "zero", "syncbn", "gradients",
                    "flight", "evaluation", "metrics", "memory", "checkpoint", "commsim",
                    "cost_model"],
    "trainer": ["config", "train", "report", "faults", "data", "models", "gpt"],
    "display": ["viz", "widgets"],
    "programs": ["labs", "bench", "convert", "seedfix", "cli", ""],  # "" = __init__
    # what runs and judges a candidate, knowing no exercise: it never imports the catalogue
    "exercise machinery": ["exercises.registry", "exercises.values", "exercises.failures",
                           "exercises.core", "exercises._runner"],
    # the package (check, describe), catalog/ (one module per exercise), the solutions
    "exercises": ["exercises"],
}
RANK = {name: i for i, name in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    """``ddp_lesson/labs/zero_check.py`` -> ``labs.zero_check``; a package's ``__init__`` is
    the package itself (``""`` for ``ddp_lesson``)."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            hit = module == prefix or (prefix and module.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    if best is None:
        raise AssertionError(f"ddp_lesson.{module} is in no layer: add it to LAYERS and "
                             "docs/architecture.md")
    return best


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module (without ``ddp_lesson.``) an ``ImportFrom`` names, or ``"-"``."""
    if node.level:
        is_pkg = MODULES[module].name == "__init__.py"
        base = module.split(".") if module else []
        base = base if is_pkg else base[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))
    name = node.module or ""
    if name == "ddp_lesson":
        return ""
    return name[len("ddp_lesson."):] if name.startswith("ddp_lesson.") else "-"


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports, anywhere in its source (functions included)."""
    deps = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "ddp_lesson" or a.name.startswith("ddp_lesson."):
                    deps.add(a.name[len("ddp_lesson."):] if "." in a.name else "")
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target == "-":
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}" if target else a.name
                deps.add(sub if sub in MODULES else target)
    deps.discard(module)
    return {d for d in deps if d in MODULES}


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_no_module_imports_a_higher_layer():
    # the reader sees relative, absolute and in-function imports (else this could pass empty)
    assert {"core.ring"} <= GRAPH["collectives"]
    assert {"bench.common", "cluster"} <= GRAPH["bench.cluster"]
    assert {"cluster", "launch"} <= GRAPH[""]
    bad = [f"ddp_lesson.{m or '__init__'} ({layer_of(m)}) imports ddp_lesson.{d} ({layer_of(d)})"
           for m, deps in GRAPH.items() for d in sorted(deps)
           if RANK[layer_of(d)] > RANK[layer_of(m)]]
    assert bad == []


def _documented_imports() -> dict[str, set[str]]:
    """docs/architecture.md's "imports from the package" table: module -> what it imports
    (backticked names outside parentheses; ``nothing`` for none)."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    table = text.split("| module | imports from the package |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        left, right = line.split("|")[1:3]
        deps = set(re.findall(r"`([\w.]+)`", re.sub(r"\([^)]*\)", "", right)))
        for m in re.findall(r"`([\w.]+)`", re.sub(r"\([^)]*\)", "", left)):
            rows[m] = deps
    return rows


def test_architecture_import_table_matches_the_code():
    # a deleted module (ddp_lesson.ddp) or a changed import must not linger in the table
    rows = _documented_imports()
    assert {"env", "train", "viz.ddp"} <= set(rows)  # the reader sees the table
    gone = sorted(m for m in rows if m not in MODULES)
    assert gone == [], f"docs/architecture.md lists modules that do not exist: {gone}"
    wrong = {m: (sorted(d), sorted(GRAPH[m])) for m, d in rows.items() if d != GRAPH[m]}
    assert wrong == {}, "docs/architecture.md's import table (documented, actual) differs"


def test_architecture_states_todays_edges_between_layers():
    text = re.sub(r"\s+", " ", (PKG.parent / "docs" / "architecture.md").read_text())
    said = text.split("Today's real edges between layers", 1)[1].split(": ", 1)[1]
    said = said.split(". Within the lower layers", 1)[0]
    documented = {}
    for part in said.split("; "):
        src, dsts = part.split(" → ")
        documented[src] = set(dsts.split(", "))
    actual: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        for d in deps:
            if layer_of(m) != layer_of(d):
                actual.setdefault(layer_of(m), set()).add(layer_of(d))
    assert documented == actual


def test_readme_layout_names_the_package_as_it_is():
    """README's Layout block: ``core/ (...)`` lists every core module, and each ``name (...)``
    it describes is a module or package of ``ddp_lesson`` (``ddp`` was deleted)."""
    text = (PKG.parent / "README.md").read_text().split("## Layout", 1)[1]
    block = text.split("```", 2)[1].split("\nnotebooks/", 1)[0]
    block = re.sub(r"\s+", " ", block.split("the package:", 1)[1])
    core = re.search(r"core/ \([^:]*: ([^)]*)\)", block).group(1)
    assert sorted(core.split(", ")) == sorted(m.split(".", 1)[1] for m in MODULES
                                               if m.startswith("core."))
    described = re.findall(r"(?:^|, )([a-z_]+)/? \(", block)
    assert {"env", "train", "viz", "labs"} <= set(described)  # the reader sees the block
    assert [n for n in described if n not in MODULES] == []


def _package_of(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]``, or None. A package's ``__init__`` importing its own
    submodules is the normal way to export them and is not an edge back from the submodule,
    so only real edges count: a submodule importing its package *is* one."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_a_circle_and_no_false_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(f"ddp_lesson.{m}" if m else "ddp_lesson" for m in cycle)


# ----------------------------------------------------------------------------- function length


def _non_code_lines(source: str, tree: ast.AST) -> set[int]:
    """Line numbers holding only a comment, only blanks, or part of a docstring."""
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    n_lines = source.count("\n") + 1
    return (set(range(1, n_lines + 1)) - code_lines) | docstrings


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """``(qualified name, lines of code)`` of every function and method in ``path``."""
    source = path.read_text()
    tree = ast.parse(source)
    skip = _non_code_lines(source, tree)
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                loc = sum(1 for n in range(first, child.end_lineno + 1) if n not in skip)
                out.append((prefix + child.name, loc))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def test_function_length_counts_code_only():
    src = ('def f(x):\n    """Doc\n\n    more doc."""\n    # a comment\n\n    y = (x +\n'
           '         1)\n    return y\n')
    p = Path(__file__).with_name("_architecture_probe.py")
    try:
        p.write_text(src)
        assert function_lengths(p) == [("f", 4)]  # def, y = (x +, 1), return
    finally:
        p.unlink(missing_ok=True)


def long_functions() -> dict[str, int]:
    return {f"ddp_lesson.{m or '__init__'}:{name}": loc
            for m, path in MODULES.items() for name, loc in function_lengths(path)
            if loc > MAX_FUNCTION_LOC}


def test_no_function_over_80_lines_of_code():
    assert long_functions() == {}


# ----------------------------------------------------------------------------- standing alone

OUTSIDE = "shared" + "/cases"  # spelled in two parts so this file does not cite it itself

def citations_outside() -> set[str]:
    """Files of the repository (package, tests, notebooks, docs, README) naming the folder of
    cases outside the repository instead of ``docs/pitfalls.md``."""
    root = PKG.parent
    files = [*root.glob("ddp_lesson/**/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("notebooks/**/*.ipynb"), *root.glob("docs/*.md"), root / "README.md"]
    return {str(p.relative_to(root)) for p in files if OUTSIDE in p.read_text()}


def test_no_citation_outside_the_repository():
    assert citations_outside() == set()


# ----------------------------------------------------------------------------- teaching cores
# The five ideas the notebooks print whole, one short file each (docs/architecture.md). A core
# imports only other cores: the lesson-core layers and the display layer build on the cores,
# never the reverse, so a printed core is all a reader needs to follow it.

CORE_FILES = ["core/sampler.py", "core/ring.py", "core/naive_ddp.py", "core/bucketed_ddp.py",
              "core/zero1.py"]
MAX_CORE_LINES = 300  # docstrings and comments included: what the notebook prints


def _is_core(module: str) -> bool:
    return module == "core" or module.startswith("core.")


def test_each_core_file_exists_and_fits_its_line_budget():
    missing = [f for f in CORE_FILES if not (PKG / f).is_file()]
    assert missing == [], f"teaching cores missing from ddp_lesson/: {missing}"
    long = {f: n for f in CORE_FILES
            if (n := len((PKG / f).read_text().splitlines())) > MAX_CORE_LINES}
    assert long == {}, f"core files over {MAX_CORE_LINES} lines: {long}"


def test_a_core_imports_only_other_cores():
    cores = [m for m in MODULES if _is_core(m)]
    assert {f"core.{Path(f).stem}" for f in CORE_FILES} <= set(cores), cores
    bad = [f"ddp_lesson.{m} imports ddp_lesson.{d or '__init__'}"
           for m in cores for d in sorted(GRAPH[m]) if not _is_core(d)]
    assert bad == []


#: Imports that are display code: figures, widgets, rich output.
DISPLAY_IMPORTS = ("matplotlib", "ipywidgets", "IPython.display", "IPython.core.display")
#: A string that is HTML markup (a tag a renderer draws), not prose that mentions a tag.
HTML_TAG = re.compile(r"<(div|span|table|thead|tbody|tr|td|th|pre|code|b|i|em|strong|small|br|"
                      r"p|ul|ol|li|h[1-6]|style|svg|img|details|summary|html|body)\b[^<>]*>",
                      re.IGNORECASE)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def display_code(source: str) -> list[str]:
    """What in ``source`` is display code: an import of :data:`DISPLAY_IMPORTS` (anywhere,
    functions included) or a string constant holding HTML markup (docstrings excepted)."""
    tree = ast.parse(source)
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [f"line {node.lineno}: import {n}" for n in names
                  if any(n == d or n.startswith(d + ".") for d in DISPLAY_IMPORTS)]
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings and HTML_TAG.search(node.value)):
            found.append(f"line {node.lineno}: HTML {node.value[:40]!r}")
    return sorted(set(found))


def test_display_code_reader_sees_imports_and_html_and_spares_prose():
    seen = display_code('import matplotlib.pyplot as plt\n'
                        'def f(x):\n    from IPython.display import HTML\n'
                        '    return f"<td style=\'a\'>{x}</td>"\n')
    assert [s.split(":")[0] for s in seen] == ["line 1", "line 3", "line 3", "line 4"], seen
    assert display_code('"""A <div> in a docstring is prose."""\nimport torch\n'
                        'x = "a < b and c > d"\nfrom IPython import get_ipython\n') == []


def lesson_modules() -> list[str]:
    """The cores and the lesson-core layer: the files a lesson reads for its algorithm."""
    prefixes = LAYERS["lesson core"]
    return [m for m in MODULES if _is_core(m)
            or any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_no_display_code_in_a_lesson_file():
    lessons = lesson_modules()
    assert {"sampler", "collectives", "zero"} <= set(lessons)
    found = {f"ddp_lesson.{m}": hits for m in lessons
             if (hits := display_code(MODULES[m].read_text()))}
    assert found == {}


# ----------------------------------------------------------------------------- test paths named

TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")


def stale_test_paths() -> dict[str, list[str]]:
    """Paths ``tests/....py`` that a file of the repository names but that do not exist (a
    test file moved into its module's folder and a mention left behind)."""
    root = PKG.parent
    files = [*root.glob("ddp_lesson/**/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("notebooks/**/*.ipynb"), *root.glob("docs/*.md"), *root.glob("tools/*.py"),
             *[root / n for n in ("README.md", "CONTRIBUTING.md", "pyproject.toml",
                                  "environment.yml", ".ci/run")]]
    stale = {}
    for p in files:
        if p.is_file():
            missing = sorted({m for m in TEST_PATH.findall(p.read_text())
                              if not (root / m).is_file()})
            if missing:
                stale[str(p.relative_to(root))] = missing
    return stale


def test_every_test_file_the_repository_names_exists():
    assert stale_test_paths() == {}
