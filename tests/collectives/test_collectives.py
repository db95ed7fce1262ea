"""Ring, pipelined ring and naive all-reduce against torch's own ``dist.all_reduce``.

Pure schedule logic runs without a process group. Multi-process checks run real torchrun jobs
on gloo: one 4-process job covers world sizes 4, 3, 2 and 1 (subgroups of the first k ranks),
one 3-process job covers an odd world and the notebook's demonstrations. Integers must match
torch bit for bit; floats within rounding. The stored outputs of notebook 03 are checked
against values worked out here.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_cells import stream_text

from ddp_lesson.collectives import (
    chunk_bounds,
    holdings_line,
    naive_all_reduce,
    piece_bounds,
    pipelined_ring_all_reduce,
    ring_all_reduce,
    ring_recv_chunk,
    ring_send_chunk,
)
from ddp_lesson.launch import run_torchrun

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- pure schedule


@given(st.integers(0, 500), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_chunks_tile_the_tensor_evenly(numel, R):
    bounds = chunk_bounds(numel, R)
    assert len(bounds) == R
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == numel


def test_chunks_when_fewer_elements_than_ranks():
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        chunk_bounds(4, 0)


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 50))
def test_pieces_tile_a_chunk(start, length, p):
    pieces = piece_bounds(start, start + length, p)
    covered = [i for a, b in pieces for i in range(a, b)]
    assert covered == list(range(start, start + length))
    assert all(0 < b - a <= p for a, b in pieces)


@pytest.mark.parametrize("R", [2, 3, 4, 5, 8])
def test_schedule_is_a_ring_reduce_scatter_then_all_gather(R):
    # Written from the description (Patarasuk & Yuan; Baidu): in reduce-scatter step s rank r
    # sends chunk r-s; in all-gather step s rank r sends chunk r+1-s (mod R), always to r+1.
    for s in range(R - 1):
        for r in range(R):
            assert ring_send_chunk(r, s, R) == (r - s) % R
            assert ring_send_chunk(r, R - 1 + s, R) == (r + 1 - s) % R
    for step in range(2 * (R - 1)):
        for r in range(R):
            # what r receives is what its left neighbour sends
            assert ring_recv_chunk(r, step, R) == ring_send_chunk((r - 1) % R, step, R)
            # what r receives now it forwards next step (the pipelining property)
            if step + 1 < 2 * (R - 1):
                assert ring_send_chunk(r, step + 1, R) == ring_recv_chunk(r, step, R)
    # reduce-scatter: each rank adds R-1 distinct chunks, never its own chunk r+... and then
    # owns chunk r+1, which it sends first in the all-gather
    for r in range(R):
        got = [ring_recv_chunk(r, s, R) for s in range(R - 1)]
        assert len(set(got)) == R - 1 and got[-1] == (r + 1) % R
    for step in range(2 * (R - 1)):   # each step every rank sends a distinct chunk
        assert sorted(ring_send_chunk(r, step, R) for r in range(R)) == list(range(R))


def test_holdings_line_is_machine_independent():
    line = holdings_line("broadcast", torch.tensor([0.0, 0.0]), torch.tensor([7.0, 8.0]))
    assert line == "broadcast       before [0, 0]             after [7, 8]"
    assert holdings_line("x", [1.5, 2.0], "(unspecified)").endswith("after (unspecified)")
    assert "[0.3333]" in holdings_line("x", [1 / 3], None)


def test_calls_without_a_process_group_fail_clearly():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for fn in (ring_all_reduce, pipelined_ring_all_reduce, naive_all_reduce):
        with pytest.raises(ValueError, match="process group has not been initialized"):
            fn(torch.ones(3))           # torch's own words (distributed_c10d._get_default_group)


@pytest.mark.slow
def test_world_of_one_and_argument_errors(world_of_one):
    for fn in (ring_all_reduce, pipelined_ring_all_reduce, naive_all_reduce):
        for dtype in (torch.int64, torch.float32):
            x = torch.arange(7, dtype=dtype).reshape(7, 1)
            ref = x.clone()
            dist.all_reduce(ref)
            assert fn(x) is x and torch.equal(x, ref)
        y = torch.tensor([2.0, 4.0])
        assert torch.equal(fn(y, op=dist.ReduceOp.AVG), torch.tensor([2.0, 4.0]))
        with pytest.raises(TypeError, match="AVG of an integer tensor"):
            fn(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
        with pytest.raises(TypeError, match="complex tensors"):
            fn(torch.ones(3, dtype=torch.complex64))
        for op in ("median", dist.ReduceOp.BAND):
            with pytest.raises(ValueError, match="is not one of SUM, AVG, PRODUCT, MIN, MAX"):
                fn(torch.ones(3), op=op)
    with pytest.raises(ValueError, match="piece_numel must be >= 1, got 0"):
        pipelined_ring_all_reduce(torch.ones(3), piece_numel=0)


# ----------------------------------------------------------------------------- multi-process


def _lines(result) -> list[str]:
    return result.rank_lines(0)


@pytest.mark.slow
def test_against_all_reduce_world_sizes_one_to_four():
    # one 4-process job: the world (R=4) plus subgroups of the first 1, 2 and 3 ranks
    result = run_torchrun("ddp_lesson.labs.collectives_check",
                          ["--quick", "--group-sizes", "1,2,3"], module=True,
                          nproc_per_node=4, timeout=150, live=False)
    lines = _lines(result)
    for where, k in (("world", 4), ("subgroup", 1), ("subgroup", 2), ("subgroup", 3)):
        for label in ("ring", "pipelined ring", "naive"):
            pat = re.compile(rf"{where} of {k}, {label}: (\d+) cases, bit-equal ints: True, "
                             r"floats within rounding: True$")
            hits = [ln for ln in lines if pat.match(ln)]
            assert len(hits) == 1, (where, k, label, lines)
            assert int(pat.match(hits[0]).group(1)) >= 50
    assert "strided view reduced in place: True" in lines


ODD_WORLD = textwrap.dedent(r"""
    import torch, torch.distributed as dist
    from ddp_lesson.env import init_distributed, cleanup
    from ddp_lesson.collectives import (ring_all_reduce, pipelined_ring_all_reduce,
                                        naive_all_reduce, ring_reduce_scatter)
    env = init_distributed(timeout=60)
    R, rank = env.world_size, env.rank
    ok = True
    for dtype in (torch.int32, torch.int64, torch.float64, torch.float32, torch.bfloat16):
        for numel in (1, 2, 5, 7, 1000, 4099):
            for fn in (ring_all_reduce, pipelined_ring_all_reduce, naive_all_reduce,
                       lambda t: pipelined_ring_all_reduce(t, piece_numel=2)):
                g = torch.Generator().manual_seed(numel * 10 + rank)
                if dtype.is_floating_point:
                    x = torch.randn(numel, generator=g).to(dtype)
                else:
                    x = torch.randint(-2**20, 2**20, (numel,), generator=g, dtype=dtype)
                ref = x.clone(); dist.all_reduce(ref)
                mine = fn(x.clone())
                if dtype.is_floating_point:
                    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
                    ok &= bool(torch.allclose(mine.double(), ref.double(), rtol=tol, atol=tol))
                else:
                    ok &= torch.equal(mine, ref)
    print("odd world all equal:", ok)
    # integer overflow wraps the same way in any order
    big = torch.full((6,), 2**62 + rank, dtype=torch.int64)
    ref = big.clone(); dist.all_reduce(ref)
    print("overflow wraps alike:", torch.equal(ring_all_reduce(big.clone()), ref))
    # reduce-scatter: the ring's owned chunk equals torch's reduce_scatter, relabelled
    x = torch.arange(9, dtype=torch.int64) * (rank + 1)
    y = x.clone()
    a, b = ring_reduce_scatter(y)
    total = x.clone(); dist.all_reduce(total)
    print("ring reduce-scatter chunk:", (a, b), torch.equal(y[a:b], total[a:b]))
    cleanup()
""")


@pytest.mark.slow
def test_odd_world_dtypes_and_reduce_scatter():
    result = run_torchrun(code=ODD_WORLD, nproc_per_node=3, timeout=120, live=False)
    for rank in range(3):
        lines = result.rank_lines(rank)
        assert "odd world all equal: True" in lines
        assert "overflow wraps alike: True" in lines
        # rank r owns chunk (r+1) mod 3 of 9 elements: elements 3(r+1)..3(r+1)+3
        c = (rank + 1) % 3
        assert f"ring reduce-scatter chunk: ({3 * c}, {3 * c + 3}) True" in lines


CORE_VS_TORCH = textwrap.dedent(r"""
    import torch, torch.distributed as dist
    from ddp_lesson.core import ring as core
    from ddp_lesson.env import init_distributed, cleanup
    env = init_distributed(timeout=60)
    rank = env.rank
    results = {"core": True}
    for name, fn in (("core", core.ring_all_reduce),):
        for dtype in (torch.int64, torch.float32, torch.float64):
            for numel in (1, 2, 3, 7, 1000, 1001):
                ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                       dist.ReduceOp.MAX] + [dist.ReduceOp.AVG] * dtype.is_floating_point
                for op in ops:
                    g = torch.Generator().manual_seed(numel * 7 + rank)
                    if dtype.is_floating_point:
                        x = torch.randn(numel, generator=g).to(dtype)
                    else:
                        x = torch.randint(-2**40, 2**40, (numel,), generator=g, dtype=dtype)
                    ref = x.clone(); dist.all_reduce(ref, op=op)
                    got = fn(x.clone().reshape(numel, 1), op=op).reshape(-1)
                    if dtype.is_floating_point:
                        results[name] &= bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-6))
                    else:
                        results[name] &= torch.equal(got, ref)
    for name, ok in results.items():
        print(f"{name} ring equals dist.all_reduce:", ok)
    cleanup()
""")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_core_ring_equals_torch_all_reduce_for_every_op(world):
    result = run_torchrun(code=CORE_VS_TORCH, nproc_per_node=world, timeout=120, live=False,
                          backend="gloo")
    for rank in range(world):
        lines = result.rank_lines(rank)
        assert "core ring equals dist.all_reduce: True" in lines, (rank, lines)


def test_the_package_ring_is_the_core_ring():
    from ddp_lesson.core import ring as core

    for name in ("ring_all_reduce", "ring_send_chunk", "ring_recv_chunk", "chunk_bounds"):
        assert getattr(core, name) is globals()[name], name


def _loops_with_send_and_recv(path: Path) -> list[str]:
    """Functions of ``path`` holding a ``for ... in range(...)`` loop whose body (local helpers
    included) calls both ``isend``/``send`` and ``irecv``/``recv``: a loop of ring steps."""
    import ast

    tree = ast.parse(path.read_text())
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def calls(node, seen=()) -> set[str]:
        out = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                out.add(name)
                if name in defs and name not in seen:      # a local helper: look inside
                    out |= calls(defs[name], (*seen, name))
        return out

    hits = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)
                         and isinstance(n.iter, ast.Call)
                         and getattr(n.iter.func, "id", "") == "range"):
                got = set().union(*(calls(stmt) for stmt in loop.body))
                if got & {"isend", "send"} and got & {"irecv", "recv"}:
                    hits.append(fn.name)
                    break
    return hits


def test_one_ring_loop_in_the_package():
    pkg = ROOT / "ddp_lesson"
    found = {f"{p.relative_to(pkg)}:{name}" for p in pkg.rglob("*.py")
             for name in _loops_with_send_and_recv(p)}
    # the core's loop, and the pipelined ring (deep dive 03): another algorithm, whose loop
    # forwards pieces as they arrive. No second copy of the ring's step loop.
    assert found == {"core/ring.py:ring_all_reduce",
                     "collectives.py:pipelined_ring_all_reduce"}, found
    assert len(_loops_with_send_and_recv(ROOT / "ddp_lesson" / "core" / "ring.py")) == 1


# ---------------------------------------------------------------------------- notebook 03's outputs


def _cell_text(marker: str) -> str:
    return stream_text("03_collectives.ipynb", marker)


_HOLD = re.compile(
    r"^\[rank (\d)\] (.+?)\s+before (\S.*?)\s+after (.+?)(?:\s+\(chunk (\d+) of the sum\))?$"
)


def _holdings(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = _HOLD.match(line)
        if m:
            out[(m.group(2).strip(), int(m.group(1)))] = (
                m.group(3).strip(),
                m.group(4).strip(),
                m.group(5),
            )
    return out


def _l(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def test_notebook_03_point_to_point_outputs():
    got = _holdings(_cell_text("dist.send(t, dst=1)"))
    R = 3
    assert got[("send 0 -> 1", 0)][:2] == (_l([1, 2, 3]), _l([1, 2, 3]))
    assert got[("send 0 -> 1", 1)][:2] == (_l([0, 0, 0]), _l([1, 2, 3]))
    assert got[("send 0 -> 1", 2)][:2] == (_l([0, 0, 0]), _l([0, 0, 0]))
    for r in range(R):   # every rank receives its left neighbour's 10·(left+1)
        assert got[("isend right", r)][:2] == (_l([10 * (r + 1)]), _l([10 * ((r - 1) % R + 1)]))


def test_notebook_03_collective_outputs():
    R = 3
    got = _holdings(_cell_text("dist.broadcast(t, src=0)"))
    inputs = {r: [r + 1, 10 * (r + 1)] for r in range(R)}
    total = [sum(v[i] for v in inputs.values()) for i in range(2)]       # [6, 60]
    for r in range(R):
        assert got[("broadcast", r)][:2] == (_l([7, 8]) if r == 0 else _l([0, 0]), _l([7, 8]))
        assert got[("reduce to 0", r)][:2] == (
            _l(inputs[r]),
            _l(total) if r == 0 else "(unspecified)",
        )
        assert got[("all_reduce", r)][:2] == (_l(inputs[r]), _l(total))
    text = _cell_text("dist.all_gather(everyone, mine)")
    got = _holdings(text)
    for r in range(R):
        x = [(r + 1) * c for c in (1, 2, 3)]
        summed = [sum((q + 1) * c for q in range(R)) for c in (1, 2, 3)]   # [6, 12, 18]
        assert got[("all_gather", r)][:2] == (_l([r + 1]), _l([1, 2, 3]))
        assert got[("reduce_scatter", r)][:2] == (_l(x), _l([summed[r]]))
        owned = (r + 1) % R
        assert got[("ring's half", r)] == (_l(x), _l([summed[owned]]), str(owned))
        assert f"[rank {r}] barrier: markers seen after it: 3 of 3" in text.splitlines()


def test_notebook_03_ring_check_outputs():   # the run moved to the deep dive
    text = stream_text("deep/03_collective_costs.ipynb", "def check(fn, x, op=dist.ReduceOp.SUM)")
    lines = text.splitlines()
    for label in ("int64, 1000 elements, bit-equal to all_reduce:",
                  "float32, 1001 elements, equal within rounding:",
                  "2 elements on 3 ranks (an empty chunk):", "AVG and MAX:",
                  "pipelined ring, bit-equal:", "naive (via rank 0), bit-equal:"):
        assert f"[rank 0] {label} True" in lines
    assert not any("False" in ln for ln in lines)


def _imported_names(source: str, package: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` in ``source`` (cell magics and
    ``%`` lines dropped; relative imports resolved against ``package``)."""
    import ast
    import importlib.util

    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("%"))
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = importlib.util.resolve_name("." * node.level + mod, package)
            out += [(mod, a.name) for a in node.names]
    return out


def test_notebooks_02_03_and_the_labs_run_the_cores():
    """What the notebooks 02/03 (and their deep dives) and the labs import as the sampler or
    the ring is the very object in ``ddp_lesson.core``: one implementation runs everywhere."""
    import importlib

    import nbformat

    sources = []
    for pattern in ("02_*.ipynb", "03_*.ipynb", "deep/02_*.ipynb", "deep/03_*.ipynb"):
        for path in sorted((ROOT / "notebooks").glob(pattern)):
            nb = nbformat.read(path, as_version=4)
            sources += [(c.source, "ddp_lesson") for c in nb.cells if c.cell_type == "code"]
    sources += [(p.read_text(), "ddp_lesson.labs") for p in (ROOT / "ddp_lesson/labs").glob("*.py")]
    core_of = {"DistributedSampler": "ddp_lesson.core.sampler",
               "ring_all_reduce": "ddp_lesson.core.ring"}
    seen = set()
    for source, package in sources:
        for mod, name in _imported_names(source, package):
            if name in core_of and mod.startswith("ddp_lesson"):
                obj = getattr(importlib.import_module(mod), name)
                assert obj.__module__ == core_of[name], (mod, name, obj.__module__)
                seen.add((mod, name))
    # the notebooks' and labs' own imports, all of them cores
    assert {("ddp_lesson.sampler", "DistributedSampler"),
            ("ddp_lesson.core.sampler", "DistributedSampler"),
            ("ddp_lesson.collectives", "ring_all_reduce"),
            ("ddp_lesson.core.ring", "ring_all_reduce")} <= seen, seen
