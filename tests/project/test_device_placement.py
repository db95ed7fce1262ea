"""Every tensor and module that reaches a collective or a DDP wrapper is on the rank's device.

``ddp_lesson.env.init_distributed`` creates an NCCL group where every local rank has a GPU, and
NCCL reduces CUDA tensors only (``ProcessGroupNCCL``'s check of every tensor: "Tensors must be
CUDA and dense", ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``, read in the CUDA build's
``libtorch_cuda``; torch 2.14.1). A lab or a notebook cell that builds a CPU tensor and hands it to
``dist.all_reduce`` runs on the CI's gloo and crashes on a GPU machine. No device other than
the CPU exists on the CI machine that gloo would carry (gloo takes CPU tensors, and CUDA ones
in a CUDA build), so this is a static check, with ``ast``, of:

* ``ddp_lesson/labs/`` (the clinic too), ``ddp_lesson/bench/``, ``ddp_lesson/seedfix/``;
* every ``%%torchrun`` and ``%%ranks`` cell of every notebook (a notebook's ``%%ranks`` cells
  read as one program, in order: their ranks keep state between cells);
* the README's and docs' ``%%torchrun`` / ``%%ranks`` examples.

**What it catches.** A *sink* is a tensor argument of a ``dist`` collective or point-to-point
call, of the package's ring all-reduces, or the module given to a DDP wrapper
(``DistributedDataParallel``, ``DDP``, ``NaiveDDP``, ``BucketedDDP``, ``wrap``, ``wrapper``,
``_wrap``), and, through one level of calls inside the same file or cell, an argument of a
local function whose parameter reaches a sink. Each sink's expression is traced back through
the assignments of its function (or cell) to where the value was made: a torch factory
(``torch.tensor``, ``zeros``, ``randn``, ...) without ``device=``, a module or value built
by a call from constants only (``make_toy_model(seed=0)``, ``Scalar()``), or ``.cpu()``, is
*unplaced*; ``device=...``, ``.to(<something naming a device>)`` and ``.cuda()`` place it.
A sink whose value is unplaced fails the test.

**What it cannot catch.** A value that comes from a function's parameter, a global or another
module (the callee's own sinks are checked where they are written), an in-place move
(``module.to(device)`` as a statement: write ``model = build().to(device)`` instead), a value
built with the device chosen wrongly (``device="cpu"`` under NCCL), collectives reached through
``getattr`` or a dictionary of functions, and ``.numpy()`` on a CUDA tensor (a separate check
below covers the package's ``.numpy()`` calls). A file or cell that pins gloo
(``init_distributed(backend="gloo")``, ``init_process_group("gloo")``, ``%%torchrun
--backend gloo``, the clinic) is skipped: there CPU tensors are right. The exercises' checkers
pin gloo in their runner (``ddp_lesson/exercises/_runner.py``) and are not swept.
"""
from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

import pytest

from ddp_lesson import seedfix

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddp_lesson"

PLACED, UNPLACED, UNKNOWN = "placed", "unplaced", "unknown"
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace",
             "randn", "rand", "randint", "randperm", "eye"}
LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
        "randint_like"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "send", "recv", "isend", "irecv",
               "all_to_all", "all_to_all_single", "gather", "scatter"}
RINGS = {"ring_all_reduce", "pipelined_ring_all_reduce", "naive_all_reduce",
         "ring_reduce_scatter", "core_ring", "all_reduce_sum", "sum_over_ranks"}
WRAPPERS = {"DistributedDataParallel", "DDP", "NaiveDDP", "BucketedDDP", "wrap", "wrapper",
            "_wrap"}
PASS_THROUGH = {"list", "tuple", "sorted", "reversed"}
BUILTINS = set(dir(builtins))
PINS_GLOO = re.compile(r"""backend\s*=\s*["']gloo["']|init_process_group\(\s*["']gloo["']|"""
                       r"""--backend gloo""")
NAMES_NCCL = re.compile(r"""["']nccl["']|--backend nccl""")


def _names_device(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return any(w in text for w in ("device", "cuda", "dev"))


class _Scope:
    """One function body (or a whole file/cell): its bindings, read in source order."""

    def __init__(self, node: ast.AST, parent: _Scope | None):
        self.node, self.parent = node, parent
        # name -> [(first line, last line, kind, value)]
        self.bindings: dict[str, list[tuple[int, int, str, ast.AST | None]]] = {}
        self.params: set[str] = set()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                if arg is not None:
                    self.params.add(arg.arg)
        for child in _own_nodes(node):
            if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                if child.value is not None:
                    for t in targets:
                        self._bind(t, child, "value", child.value)
            elif isinstance(child, (ast.For, ast.comprehension)):
                self._bind(child.target, child if isinstance(child, ast.For) else child.iter,
                           "element", child.iter)
            elif isinstance(child, ast.withitem) and child.optional_vars is not None:
                self._bind(child.optional_vars, child.context_expr, "value",
                           child.context_expr)
            elif isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                self.bindings.setdefault(child.name, []).append(
                    (child.lineno, child.lineno, "def", None, ()))

    def _bind(self, target, stmt, kind, value, path=()):
        """Bind the names of ``target``; ``path``: where in a tuple unpacking each sits."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for i, elt in enumerate(target.elts):
                self._bind(elt, stmt, kind, value, path + (i,))
            return
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                self.bindings.setdefault(n.id, []).append(
                    (stmt.lineno, stmt.end_lineno, kind, value, path if kind == "value" else ()))

    def lookup(self, name: str, line: int):
        """``(scope, binding)`` of ``name`` as seen at ``line``, or None (global/unknown)."""
        scope = self
        while scope is not None:
            found = scope.bindings.get(name)
            if found:
                # an assignment counts once it is complete (``x = f(x)`` reads the earlier x);
                # a loop's or comprehension's variable inside it
                before = [b for b in found
                          if b[1] < line or (b[2] != "value" and b[0] <= line)]
                return scope, (max(before, key=lambda b: b[0]) if before else found[0])
            if name in scope.params:
                return scope, None
            scope = scope.parent
        return None


def _own_nodes(node: ast.AST):
    """The nodes of ``node``'s body, not those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))


def _opaque(result):
    """Unknown, but not from constants: a parameter reaches a sink only directly (by name, a
    method of it, an index into it), not as one argument among others of a call or an
    operator (``raw / n_global``: ``n_global`` is a count)."""
    state, params = result
    return (state, {"<opaque>"}) if params else result


def _combine(states):
    states = list(states)
    if any(s == PLACED for s, _ in states):
        return PLACED, set()
    if any(s == UNPLACED for s, _ in states):
        return UNPLACED, set()
    return UNKNOWN, set().union(*(p for _, p in states)) if states else set()


class Checker:
    """Trace sinks of one file or cell back to where their values were made."""

    def __init__(self, tree: ast.AST):
        self.tree = tree
        self.scopes: dict[ast.AST, _Scope] = {}
        self._build(tree, None)
        self.functions = {n.name: n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.param_sinks: dict[str, set[int]] = {}

    def _build(self, node, parent):
        scope = _Scope(node, parent)
        self.scopes[node] = scope
        for child in _own_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                self._build(child, scope)

    def scope_of(self, node) -> _Scope:
        best = None
        for owner, scope in self.scopes.items():
            if owner is self.tree or _contains(owner, node):
                if best is None or _contains(best.node, owner):
                    best = scope
        return best

    # -- evaluation ------------------------------------------------------------------------
    def value(self, expr, scope: _Scope, depth: int = 0):
        """``(state, parameters it came from)`` of ``expr`` in ``scope``."""
        if depth > 25 or expr is None:
            return UNKNOWN, set()
        v = lambda e: self.value(e, scope, depth + 1)  # noqa: E731
        if isinstance(expr, ast.Call):
            if any(k.arg == "device" for k in expr.keywords):
                return PLACED, set()
            f = expr.func
            if isinstance(f, ast.Attribute):
                if f.attr == "cuda" or (f.attr == "to" and any(
                        _names_device(a) for a in expr.args + [k.value for k in expr.keywords])):
                    return PLACED, set()
                if f.attr == "cpu":
                    return UNPLACED, set()
                if isinstance(f.value, ast.Name) and f.value.id == "torch":
                    if f.attr in FACTORIES:
                        return UNPLACED, set()
                    if f.attr in LIKE:
                        return v(expr.args[0]) if expr.args else (UNKNOWN, set())
                    return _opaque(_combine(v(a) for a in expr.args))
                root = f.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if not (isinstance(root, ast.Name) and scope.lookup(root.id, expr.lineno) is None):
                    return v(f.value)  # a method: where its receiver lives
                # a module's function or class (nn.Linear(1, 1)): as a plain call, below
            if isinstance(f, (ast.Name, ast.Attribute)):
                if isinstance(f, ast.Attribute):
                    return self._call(expr, scope, depth, local=None)
                if f.id in PASS_THROUGH:
                    return _combine(v(a) for a in expr.args)
                if f.id in BUILTINS:
                    return UNKNOWN, set()
                found = scope.lookup(f.id, expr.lineno)
                if found is not None and found[1] is None:
                    # a callable parameter: what it returns is the caller's business
                    return UNKNOWN, {f.id if found[0] is scope else f"<outer {f.id}>"}
                return self._call(expr, scope, depth, local=self.functions.get(f.id))
            return UNKNOWN, set()
        if isinstance(expr, ast.Name):
            found = scope.lookup(expr.id, getattr(expr, "lineno", 10**9))
            if found is None:
                return UNKNOWN, set()
            owner, binding = found
            if binding is None:  # a parameter: of this function, or of an enclosing one
                return UNKNOWN, {expr.id if owner is scope else f"<outer {expr.id}>"}
            _, _, kind, value, path = binding
            if kind == "def":
                return UNKNOWN, set()
            return self.unpacked(value, path, owner, depth + 1)
        if isinstance(expr, (ast.Attribute, ast.Subscript, ast.Starred)):
            return v(expr.value)
        if isinstance(expr, ast.UnaryOp):
            return v(expr.operand)
        if isinstance(expr, ast.BinOp):
            return _opaque(_combine([v(expr.left), v(expr.right)]))
        if isinstance(expr, (ast.IfExp, ast.List, ast.Tuple, ast.Set)):
            parts = ([expr.body, expr.orelse] if isinstance(expr, ast.IfExp) else expr.elts)
            states = [v(p) for p in parts]
            if any(s == UNPLACED for s, _ in states):
                return UNPLACED, set()  # one CPU branch is enough to crash
            return _combine(states)
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return self.value(expr.elt, self.scope_of(expr.elt), depth + 1)
        return UNKNOWN, set()

    def unpacked(self, value, path, scope, depth):
        """The value of element ``path`` of ``value`` (``a, (b, c) = ...``): a tuple's own
        element, a local function's returned tuples' elements, else the whole value."""
        if not path:
            return self.value(value, scope, depth)
        i, rest = path[0], path[1:]
        if isinstance(value, (ast.Tuple, ast.List)) and i < len(value.elts) and not any(
                isinstance(e, ast.Starred) for e in value.elts):
            return self.unpacked(value.elts[i], rest, scope, depth + 1)
        f = value.func if isinstance(value, ast.Call) else None
        if isinstance(f, ast.Name) and f.id in self.functions and depth < 20:
            local = self.functions[f.id]
            inner = self.scopes[local]
            parts = [self.unpacked(r.value, path, inner, depth + 1) for r in _own_nodes(local)
                     if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)]
            if parts:
                return _opaque(_combine(parts))
        return self.value(value, scope, depth)

    def _call(self, expr, scope, depth, local):
        """A function's or class's result: where its local definition's ``return`` puts it,
        else from its arguments; from constants only, on the CPU."""
        if local is not None and depth < 20:
            inner = self.scopes[local]
            returns = [self.value(r.value, inner, depth + 1) for r in _own_nodes(local)
                       if isinstance(r, ast.Return) and r.value is not None]
            if any(s == PLACED for s, _ in returns):
                return PLACED, set()
            if returns and all(s == UNPLACED for s, _ in returns):
                return UNPLACED, set()
        state, params = _combine([self.value(a, scope, depth + 1) for a in expr.args]
                                 + [self.value(k.value, scope, depth + 1) for k in expr.keywords])
        if state == UNKNOWN and all(p.startswith("<outer ") for p in params):
            # built from constants only, or from an enclosing function's arguments (sizes,
            # settings: ``build_model("deeplab", width=width)`` in a closure): on the CPU
            return UNPLACED, set()
        return _opaque((state, params))

    # -- sinks -----------------------------------------------------------------------------
    def sinks(self):
        """``(call, argument)`` pairs: every tensor or module that must be on the device."""
        for call in ast.walk(self.tree):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            on_dist = (isinstance(f, ast.Attribute) and ast.unparse(f.value)
                       in ("dist", "torch.distributed"))
            if on_dist and name in COLLECTIVES:
                yield from ((call, a) for a in call.args)
            elif name in RINGS:
                yield from ((call, a) for a in call.args[:1])
            elif name in WRAPPERS and call.args:
                yield call, call.args[-1] if name == "_wrap" else call.args[0]
            elif name in self.param_sinks and isinstance(f, ast.Name):
                yield from ((call, call.args[i]) for i in sorted(self.param_sinks[name])
                            if i < len(call.args))

    def unplaced(self) -> list[str]:
        """One line per sink whose value is made on the CPU: ``line: call``."""
        for _ in range(3):  # parameters that reach a sink, through local calls
            for call, arg in list(self.sinks()):
                scope = self.scope_of(call)
                state, params = self.value(arg, scope)
                fn = scope.node
                if state == UNKNOWN and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                    for p in params:
                        if p in names:
                            self.param_sinks.setdefault(fn.name, set()).add(names.index(p))
        bad = []
        for call, arg in self.sinks():
            if self.value(arg, self.scope_of(call))[0] == UNPLACED:
                bad.append(f"line {call.lineno}: {ast.unparse(call)[:90]}")
        return sorted(set(bad))


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    if outer is inner:
        return False
    lo, hi = getattr(outer, "lineno", 0), getattr(outer, "end_lineno", 10**9)
    return (lo <= getattr(inner, "lineno", -1) <= hi and inner in set(ast.walk(outer)))


def unplaced_in(source: str) -> list[str]:
    """The sinks of ``source`` (Python, IPython magics stripped) made on the CPU."""
    lines = [("#" + ln) if ln.lstrip().startswith(("%", "!")) else ln
             for ln in source.splitlines()]
    return Checker(ast.parse("\n".join(lines))).unplaced()


# --------------------------------------------------------------------------- the sweeps

def _package_files():
    for folder in ("labs", "bench", "seedfix"):
        yield from sorted((PACKAGE / folder).rglob("*.py"))


def _notebook_programs():
    """``(label, source)``: each ``%%torchrun`` cell, and each notebook's ``%%ranks`` cells
    joined in order (one program: the ranks keep their state between cells)."""
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        ranks = []
        for i, cell in enumerate(cells):  # i: the cell's index in the notebook, from 0
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            first = src.split("\n", 1)[0]
            if first.startswith("%%torchrun"):
                yield f"{path.relative_to(ROOT)} code cell {i}", src
            elif first.startswith("%%ranks"):
                ranks.append(src)
        if ranks:
            yield f"{path.relative_to(ROOT)} %%ranks cells", "\n".join(ranks)


def _doc_programs():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
        ranks = [b for b in blocks if b.startswith("%%ranks")]
        for i, block in enumerate(blocks):
            if block.startswith("%%torchrun"):
                yield f"{path.relative_to(ROOT)} block {i}", block
        if ranks:
            yield f"{path.relative_to(ROOT)} %%ranks blocks", "\n".join(ranks)


def _pins_gloo(source: str) -> bool:
    """Gloo and only gloo: no NCCL backend named anywhere, as a string or a flag (the seed's
    later versions choose NCCL or gloo: checked). A program that only asks whether NCCL exists
    (``dist.is_nccl_available()``, a variable named ``nccl``) still pins gloo."""
    return bool(PINS_GLOO.search(source)) and not NAMES_NCCL.search(source)


PROGRAMS = ([(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in _package_files()]
            + [(f"ddp_lesson/seedfix/{v}.py", seedfix.source(v)) for v in seedfix.VERSIONS
               if not seedfix.path(v).is_file()]  # seed_v1 ... seed_v9: made from seed_v0
            + list(_notebook_programs()) + list(_doc_programs()))


@pytest.mark.parametrize("label,source", PROGRAMS, ids=[label for label, _ in PROGRAMS])
def test_collectives_get_tensors_on_the_ranks_device(label, source):
    if _pins_gloo(source):
        pytest.skip("pins gloo: CPU tensors are right there")
    if "/clinic/" in label:
        pytest.skip("the clinic joins gloo (labs/clinic/_common.py: start)")
    bad = unplaced_in(source)
    assert not bad, (f"{label}: these reach a collective or a DDP wrapper from the CPU; under "
                     f"NCCL they crash (put them on env.device / reduce_device()):\n"
                     + "\n".join(bad))


def test_the_sweep_finds_the_programs():
    """The sweep reads the programs it should (a renamed folder would empty it silently)."""
    labels = [label for label, _ in PROGRAMS]
    assert sum(label.startswith("ddp_lesson/labs/") for label in labels) >= 20
    assert sum("%%ranks cells" in label for label in labels) >= 3
    assert sum("code cell" in label for label in labels) >= 30
    assert any(label.startswith("README.md") for label in labels)


# --------------------------------------------------------------------------- the checker itself

# the instances this check was written for, as they stood before the fix (issue 40)
OLD = {
    "notebook 01 cell 25": """
env = init_distributed(timeout=60)
x = torch.tensor([[1.0], [2.0]]) if env.rank == 0 else torch.tensor([[3.0], [4.0]])
for label in ("mean",):
    model = torch.nn.Linear(1, 1, bias=False)
    ddp = DDP(model)
    ddp(x).sum().backward()
""",
    "notebook 01 cell 7": """
model = make_toy_model(seed=0)
x, y = make_toy_batch(8, seed=1)
xs, ys = split_batch(x, y, env.world_size)[env.rank]
g = batch_gradient(model, xs, ys)
dist.all_reduce(g, op=dist.ReduceOp.SUM)
""",
    "notebook 03 cell 19": """
gen = torch.Generator().manual_seed(env.rank)
def check(fn, x, op=dist.ReduceOp.SUM):
    ref = x.clone()
    dist.all_reduce(ref, op=op)
    return fn(x.clone(), op=op)
ints = torch.randint(-1000, 1000, (1000,), generator=gen)
print0(check(ring_all_reduce, ints))
""",
    "ddp_pitfalls.no_sync_accumulation": """
def _wrap(wrapper, module, **kwargs):
    return wrapper(module, **kwargs)
def no_sync_accumulation(wrapper, order):
    ddp = _wrap(wrapper, Scalar(), recorder=recorder)
""",
    "sampler_streams._equalised_loop": """
def _equalised_loop(batches):
    for batch in batches:
        flag = torch.tensor([0 if batch is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
""",
    "ddp_three_ways.max_difference": """
def max_difference(a, b):
    worst = torch.tensor(max(float((p - q).abs().max())
                             for p, q in zip(a.parameters(), b.parameters())),
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
""",
    "a %%ranks cell": """
%%ranks
x = torch.tensor([float(rank + 1)])
%%ranks
dist.all_reduce(x)
""",
}

FIXED = {
    "notebook 01 cell 25": """
env = init_distributed(timeout=60)
x = torch.tensor([[1.0], [2.0]] if env.rank == 0 else [[3.0], [4.0]], device=env.device)
model = torch.nn.Linear(1, 1, bias=False).to(env.device)
ddp = DDP(model)
""",
    "drawn on the CPU, moved": """
g = torch.Generator().manual_seed(0)
x = torch.randn(4, generator=g).to(env.device)
y = x.clone() * 2
dist.all_reduce(y)
everyone = [torch.zeros_like(y) for _ in range(2)]
dist.all_gather(everyone, y)
""",
    "a parameter: the caller's business": """
def mean_(t):
    dist.all_reduce(t)
    return t
""",
    "a dtype is not a device": """
x = torch.randn(4).to(torch.float64).to(reduce_device())
dist.all_reduce(x)
""",
}


@pytest.mark.parametrize("name", sorted(OLD))
def test_the_checker_flags_the_old_code(name):
    assert unplaced_in(OLD[name]), f"{name}: the CPU tensor was not flagged"


@pytest.mark.parametrize("name", sorted(FIXED))
def test_the_checker_passes_placed_code(name):
    assert unplaced_in(FIXED[name]) == []


def test_a_dtype_conversion_does_not_place_a_tensor():
    bad = unplaced_in("x = torch.randn(4).to(torch.float64)\ndist.all_reduce(x)\n")
    assert bad == ["line 2: dist.all_reduce(x)"]


# --------------------------------------------------------------------------- .numpy()

def test_numpy_is_called_on_cpu_tensors():
    """``Tensor.numpy()`` raises for a CUDA tensor ("can't convert cuda:0 device type tensor
    to numpy. Use Tensor.cpu() ...", ``torch/csrc/utils/tensor_numpy.cpp``, in torch 2.13's
    ``libtorch_python``): in the package every ``.numpy()`` follows ``.cpu()`` in its chain."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "numpy" and ".cpu()" not in ast.unparse(node.func)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not bad, "\n".join(bad)
