"""The token-loss lab (ddp_lesson/labs/token_loss.py): with variable-length padded sequences over
2 ranks x 2 micro-batches, only the global-token-count normalisation gives one process's
gradient on the global batch; and the fp16 order (divide before the sum).

The lab's 2-rank run is the deep dive's own ``%%torchrun`` cell
(``notebooks/deep/06_scaling_and_mixed_precision.ipynb``; one job, one launch): the tests read
its stored output and assert the cell's source; the formulas are checked here without a launch.
"""
from __future__ import annotations

import ast
import re

import pytest
from notebook_cells import StoredRun

from ddp_lesson.labs.token_loss import IGNORE, METHODS, normalised, padded_batch

NOTEBOOK = "deep/06_scaling_and_mixed_precision.ipynb"
CELL = ("%%torchrun --nproc-per-node 2 --backend gloo\n"
        "from ddp_lesson.labs.token_loss import main\n\nmain([])")


@pytest.fixture(scope="module")
def lab():
    run = StoredRun(NOTEBOOK, "ddp_lesson.labs.token_loss", CELL)
    return run.rank_lines(0), run.rank_lines(1)


def _value(lines, prefix):
    return next(line[len(prefix):] for line in lines if line.startswith(prefix))


def _methods(lines):
    out = {}
    for k in METHODS:
        m = re.fullmatch(r"relative error (\d\.\d\d), matches: (True|False)",
                         _value(lines, f"{k:>18}: "))
        out[k] = {"rel_err": float(m[1]), "matches": m[2] == "True"}
    return out


@pytest.mark.slow
def test_the_batch_has_unequal_token_counts(lab):
    rank0, _ = lab
    counts = ast.literal_eval(_value(rank0, "valid tokens per micro-batch, by rank: "))
    assert counts == [[14, 26], [19, 28]]
    assert int(_value(rank0, "valid tokens in the global batch: ")) == 87 == sum(map(sum, counts))
    # every rank counted the same global batch (the lab compares the ranks' results)
    assert "the same count, errors and fp16 results on every rank: True" in rank0


@pytest.mark.slow
def test_only_the_global_token_count_matches_one_process(lab):
    rank0, rank1 = lab
    m = _methods(rank0)
    assert [m[k]["matches"] for k in METHODS] == [False, False, False, True]
    assert "global token count, relative error below 1e-6 on every rank: True" in rank0
    assert [m[k]["rel_err"] for k in METHODS[:3]] == [0.20, 0.32, 0.08]
    assert rank1 == []  # rank 0 prints for both: the ranks' results are compared in the lab
    assert "the same count, errors and fp16 results on every rank: True" in rank0


@pytest.mark.slow
def test_fp16_divide_before_the_sum(lab):
    rank0, _ = lab
    assert "fp16, scale 2^16, sum then divide: finite False" in rank0
    assert "fp16, scale 2^16, divide then sum: finite True" in rank0
    assert "divide then sum within fp16 precision (< 1e-3): True" in rank0


@pytest.mark.slow
def test_printed_lines(lab):
    rank0, _ = lab
    assert rank0 == [
        "valid tokens per micro-batch, by rank: [[14, 26], [19, 28]]",
        "valid tokens in the global batch: 87",
        "  micro-batch mean: relative error 0.20, matches: False",
        "  padded positions: relative error 0.32, matches: False",
        "  rank token count: relative error 0.08, matches: False",
        "global token count: relative error 0.00, matches: True",
        "global token count, relative error below 1e-6 on every rank: True",
        "fp16, scale 2^16, sum then divide: finite False",
        "fp16, scale 2^16, divide then sum: finite True",
        "divide then sum within fp16 precision (< 1e-3): True",
        "the same count, errors and fp16 results on every rank: True",
    ]
    assert all(len(f"[rank 0] {line}") <= 100 for line in rank0)


def test_padding_is_ignored_and_normalisations_are_the_formulas():
    import torch

    x, y = padded_batch(torch.arange(1000), 4, 8, seed=0)
    assert x.shape == y.shape == (4, 8)
    valid = (y != IGNORE).sum(dim=1)
    assert bool(((valid >= 1) & (valid <= 8)).all())
    for row, n in zip(y, valid.tolist()):  # padding only at the end of a sequence
        assert bool((row[:n] != IGNORE).all()) and bool((row[n:] == IGNORE).all())
    s = torch.tensor(12.0)
    assert normalised("micro-batch mean", s, 3, 10, 40, 2, 2, 8, 2) == 2.0
    assert normalised("padded positions", s, 3, 10, 40, 2, 2, 8, 2) == 12 / 32
    assert normalised("rank token count", s, 3, 10, 40, 2, 2, 8, 2) == 1.2
    assert normalised("global token count", s, 3, 10, 40, 2, 2, 8, 2) == 0.6
