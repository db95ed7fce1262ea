"""The cores NaiveDDP and BucketedDDP where torch's DDP works: docs/pitfalls.md B40 (passes
that differentiate for something other than the parameters) and B41 (sparse gradients: the
naive core averages them, the bucketed core fails in backward).

One torchrun launch per world size (2 and 3; gloo, 20 s process-group timeout) runs every case
of ``tests/programs/ddp_where_torch_works.py``; each core's gradients are compared with
torch's ``DistributedDataParallel`` on the same rank-dependent inputs (max |Δ| asserted).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_lesson.launch import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "ddp_where_torch_works.py"
CASES = ("pgd", "pgd_uneven", "penalty", "inputs", "func", "param_grad", "eval_no_grad",
         "eval_grad")
OURS = ("naive", "bucketed")
#: gloo sums a flat tensor chunk by chunk around the ring; a gradient's place in its bucket
#: may change the order of the R terms, so sums may differ in the last bit.
TOL = 1e-6


def _launch(nproc: int) -> dict:
    r = run_torchrun(str(PROGRAM), nproc_per_node=nproc, timeout=240, live=False,
                     backend="gloo")
    out: dict = {}
    for rank in range(nproc):
        for line in r.rank_lines(rank):
            if line.startswith("{"):
                d = json.loads(line)
                out.setdefault(d.pop("scenario"), {})[d.pop("rank")] = d
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return {2: _launch(2), 3: _launch(3)}


def _is_error(value) -> bool:
    return isinstance(value, list) and bool(value) and value[0] == "error"


def _max_diff(a: list, b: list) -> float:
    assert not _is_error(a), a
    assert not _is_error(b), b
    assert len(a) == len(b) and None not in a and None not in b, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3])
def test_input_gradient_passes_give_torchs_gradients(runs, world):
    """PGD (two ``autograd.grad`` passes w.r.t. the input, then the training backward; also
    with rank + 1 attack steps per rank), a gradient penalty (``create_graph=True``),
    ``backward(inputs=[x])``, ``torch.func.grad`` w.r.t. the input, ``autograd.grad`` w.r.t.
    the parameters, and evaluation forwards with and without ``no_grad``: each wrapper's
    ``.grad`` equals torch's DDP's on every rank."""
    lab = runs[world]["input_gradients"]
    for rank in range(world):
        got = lab[rank]
        for case in CASES:
            ref = got[f"torch {case}"]
            for v in OURS:
                diff = _max_diff(got[f"{v} {case}"], ref)
                print(f"world {world} rank {rank} {v} {case}: max |Δ| {diff:.1e}")
                assert diff <= TOL, (world, rank, v, case, diff)
            if case != "param_grad":  # averaged: the same on every rank
                assert ref == lab[0][f"torch {case}"], (rank, case)
        # torch's find_unused_parameters=True cannot run under torch.func (its _DDPSink has no
        # setup_context); the cores give the gradients of torch without the flag
        kind, cls, msg = got["torch+unused func"]
        assert (kind, cls) == ("error", "RuntimeError") and "setup_context" in msg, msg
    # autograd.grad w.r.t. the parameters is local, in torch's DDP as in the cores
    assert lab[0]["torch param_grad"] != lab[1]["torch param_grad"]


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_gradients_are_averaged_by_the_naive_core_only(runs, world):
    lab = runs[world]["features"]
    for rank in range(world):
        got = lab[rank]
        assert _max_diff(got["naive sparse"], got["torch sparse"]) <= TOL
        # the bucketed core flattens each gradient into its bucket: torch refuses a sparse one
        for case in ("sparse", "functional_sparse"):
            assert got[f"bucketed {case}"] == [
                "error", "RuntimeError", "reshape is not implemented for sparse tensors"], case
        # F.embedding(..., sparse=True) on a bare parameter: torch's DDP cannot see it at
        # construction and fails inside backward; NaiveDDP averages it (row k: the mean
        # over ranks of how often rank r's indices [r, r + 1, 5] hit it)
        assert got["torch functional_sparse"][:2] == ["error", "NotImplementedError"]
        counts = [sum((k in (r, r + 1)) + (k == 5) for r in range(world)) / world
                  for k in range(6)]
        assert _max_diff(got["naive functional_sparse"],
                         [c for c in counts for _ in range(3)]) <= TOL


@pytest.mark.parametrize("world", [2, 3])
def test_complex_channels_last_and_mixed_dtypes_match_torch(runs, world):
    """Complex parameters, channels_last convolution gradients and a float32 + float64 model
    (never in one bucket): both cores' gradients equal torch's DDP's, on every rank."""
    lab = runs[world]["features"]
    for rank in range(world):
        for case in ("complex", "channels_last", "mixed_dtypes"):
            ref = lab[rank][f"torch {case}"]
            assert ref == lab[0][f"torch {case}"], (rank, case)  # averaged by torch
            for v in ("naive", "bucketed"):
                assert _max_diff(lab[rank][f"{v} {case}"], ref) <= TOL, (world, rank, v, case)
