"""The teaching cores (``ddp_lesson/core/``) keep their rules: short, self-contained, torch only.

Each core module is printed whole by its notebook (``inspect.getsource(module)``), so it must
stay readable in one sitting: at most 300 lines including docstrings, importing only torch,
the standard library and other ``ddp_lesson.core`` modules, never the layers on top
(``ddp_lesson.collectives`` and its siblings) nor display code: read from the source, no process
group. One launch of 2 gloo ranks then checks when the cores communicate: the bucketed core's
first all-reduce leaves from a gradient hook while backward still runs, the naive core's only
after backward, and neither sends anything inside ``no_sync()``. The cores' numbers are
checked against torch's DDP in tests/ddp/test_ddp_equality.py.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "ddp_lesson" / "core"
MAX_LINES = 300
CORE_FILES = sorted(p for p in CORE.glob("*.py") if p.name != "__init__.py")


def _imports(path: Path) -> list[tuple[str, int]]:
    """``(what is imported, relative level)`` for every import in ``path``, functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level))
    return out


def _allowed(name: str, level: int) -> bool:
    if level == 1:  # ``from .naive_ddp import ...``: a sibling inside ddp_lesson.core
        return True
    if level > 1:   # ``from ..collectives import ...`` leaves the core
        return False
    top = name.split(".")[0]
    if name == "ddp_lesson.core" or name.startswith("ddp_lesson.core."):
        return True
    return top in ("torch", "__future__") or (top in sys.stdlib_module_names
                                              and top != "ddp_lesson")


def test_the_ddp_cores_exist():
    names = {p.name for p in CORE_FILES}
    assert {"naive_ddp.py", "bucketed_ddp.py"} <= names


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_file_is_at_most_300_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.name} has {n} lines (at most {MAX_LINES}, docstrings included)"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_file_imports_only_torch_stdlib_and_the_core(path):
    bad = [f"{'.' * level}{name}" for name, level in _imports(path) if not _allowed(name, level)]
    assert bad == [], f"{path.name} imports {bad}"


def test_import_rule_refuses_the_hardened_layer_and_display():
    assert not _allowed("ddp_lesson.collectives", 0)
    assert not _allowed("collectives", 2)
    assert not _allowed("matplotlib.pyplot", 0)
    assert not _allowed("ipywidgets", 0)
    assert _allowed("torch.distributed", 0) and _allowed("contextlib", 0)
    assert _allowed("naive_ddp", 1) and _allowed("ddp_lesson.core.naive_ddp", 0)


def test_printed_module_is_the_whole_file():
    from ddp_lesson.core import bucketed_ddp, naive_ddp

    for module in (naive_ddp, bucketed_ddp):
        assert inspect.getsource(module) == Path(module.__file__).read_text()


RUNS_THE_CORES = ["labs/ddp_three_ways.py", "labs/ddp_overlap.py", "labs/ddp_hooks.py",
                  "exercises/solutions.py"]


def _wrapper_imports(tree) -> dict[str, str]:
    """``{NaiveDDP/BucketedDDP: the module it is imported from}`` for every import in ``tree``."""
    return {a.name: "." * node.level + (node.module or "") for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for a in node.names
            if a.name in ("NaiveDDP", "BucketedDDP")}


@pytest.mark.parametrize("rel", RUNS_THE_CORES)
def test_labs_and_exercise_references_construct_the_core_classes(rel):
    # What notebook 04 prints is what its labs, the overlap figures' lab and the exercises'
    # references run: every NaiveDDP / BucketedDDP they name comes from ddp_lesson.core.
    found = _wrapper_imports(ast.parse((CORE.parent / rel).read_text()))
    assert found, f"{rel} names no DDP wrapper"
    assert all(m.lstrip(".").replace("ddp_lesson.", "").startswith("core.")
               for m in found.values()), found


def test_notebook_04_cells_construct_the_core_classes():
    import json

    nb = json.loads((CORE.parents[1] / "notebooks" / "04_ddp_from_scratch.ipynb").read_text())
    found: dict[str, str] = {}
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
        lines = [ln for ln in src.splitlines() if not ln.startswith("%")]  # cell magics
        found.update(_wrapper_imports(ast.parse("\n".join(lines))))
    assert set(found) == {"NaiveDDP", "BucketedDDP"}, found
    assert set(found.values()) <= {"ddp_lesson.core.naive_ddp",
                                   "ddp_lesson.core.bucketed_ddp"}, found


def test_the_cores_carry_the_labs_seam_and_the_learners_checks():
    # the seam the labs need (a comm hook and a recorder) and the argument checks are the
    # cores' own: no layer on top adds them
    from ddp_lesson.core.bucketed_ddp import BucketedDDP
    from ddp_lesson.core.naive_ddp import NaiveDDP

    assert {"comm_hook", "recorder"} <= set(inspect.signature(NaiveDDP).parameters)
    assert {"comm_hook", "recorder", "overlap"} <= set(inspect.signature(BucketedDDP).parameters)
    assert issubclass(BucketedDDP, NaiveDDP)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number >= 0, got -1"):
        BucketedDDP(None, bucket_cap_mb=-1)       # before any collective
    import torch.distributed as dist
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="NaiveDDP needs a process group"):
            NaiveDDP(None)


OVERLAP_WORKER = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ddp_lesson.core.bucketed_ddp import MB, BucketedDDP
    from ddp_lesson.core.naive_ddp import NaiveDDP
    from ddp_lesson.env import cleanup, init_distributed
    from ddp_lesson.labs.ddp_toys import TiedToy, shard, toy_batch

    env = init_distributed(timeout=60)
    R, rank = env.world_size, env.rank
    seen = []                                  # per all-reduce: gradients already there
    real_all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        if tensor.numel() > 1:                 # a gradient message, not a scalar check
            seen.append(sum(p.grad is not None for p in model.parameters()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = spy
    for name in ("naive", "bucketed"):
        torch.manual_seed(0)
        model = TiedToy()
        ddp = NaiveDDP(model) if name == "naive" else BucketedDDP(model, bucket_cap_mb=0)
        x, y = toy_batch(0, 2 * R)
        seen.clear()
        with ddp.no_sync():
            F.cross_entropy(ddp(shard(x, rank, R)), shard(y, rank, R)).backward()
        print(f"{name} no_sync all-reduces: {len(seen)}")
        model.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(shard(x, rank, R)), shard(y, rank, R)).backward()
        total = sum(1 for _ in model.parameters())
        print(f"{name} all-reduces: {len(seen)} of {total} parameters")
        print(f"{name} first all-reduce before the last gradient: {seen[0] < total}")
    dist.all_reduce = real_all_reduce
    cleanup()
""")


@pytest.mark.slow
def test_bucketed_core_launches_from_the_hooks_while_backward_runs():
    from ddp_lesson.launch import run_torchrun

    result = run_torchrun(code=OVERLAP_WORKER, nproc_per_node=2, timeout=120, live=False,
                          backend="gloo")
    for rank in (0, 1):
        assert result.rank_lines(rank) == [
            "naive no_sync all-reduces: 0",
            "naive all-reduces: 7 of 7 parameters",
            "naive first all-reduce before the last gradient: False",  # after backward
            "bucketed no_sync all-reduces: 0",
            "bucketed all-reduces: 7 of 7 parameters",                 # cap 0: one each
            "bucketed first all-reduce before the last gradient: True",  # from a hook
        ], result.rank_lines(rank)
