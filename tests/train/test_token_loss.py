"""The token-loss lab (ddp_lesson/labs/token_loss.py): with variable-length padded sequences over
2 ranks x 2 micro-batches, only the global-token-count normalisation gives one process's
gradient on the global batch; and the fp16 order (divide before the sum)."""
from __future__ import annotations

import json

import pytest

from ddp_lesson.labs.token_loss import IGNORE, METHODS, normalised, padded_batch
from ddp_lesson.launch import run_torchrun

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def lab():
    r = run_torchrun("ddp_lesson.labs.token_loss", ["--json"], module=True, nproc_per_node=2,
                     backend="gloo", live=False, timeout=180)
    return r, {k: json.loads(r.rank_lines(k)[-1]) for k in (0, 1)}


def test_the_batch_has_unequal_token_counts(lab):
    _, res = lab
    counts = [res[0]["tokens_per_micro_batch"], res[1]["tokens_per_micro_batch"]]
    assert counts == [[14, 26], [19, 28]]
    assert res[0]["tokens_global"] == res[1]["tokens_global"] == 87 == sum(map(sum, counts))


def test_only_the_global_token_count_matches_one_process(lab):
    _, res = lab
    for rank in (0, 1):
        m = res[rank]["methods"]
        assert [m[k]["matches"] for k in METHODS] == [False, False, False, True]
        assert m["global token count"]["rel_err"] < 1e-6
        assert [round(m[k]["rel_err"], 2) for k in METHODS[:3]] == [0.20, 0.32, 0.08]
    assert res[0]["methods"] == res[1]["methods"]  # DDP: every rank holds the same gradient


def test_fp16_divide_before_the_sum(lab):
    _, res = lab
    for rank in (0, 1):
        f = res[rank]["fp16"]
        assert f["sum_then_divide_finite"] is False
        assert f["divide_then_sum_finite"] is True
        assert f["divide_then_sum_rel_err"] < 1e-3


def test_printed_lines(lab):
    r, _ = lab
    assert r.rank_lines(0)[:-1] == [
        "valid tokens per micro-batch, by rank: [[14, 26], [19, 28]]",
        "valid tokens in the global batch: 87",
        "  micro-batch mean: relative error 0.20, matches: False",
        "  padded positions: relative error 0.32, matches: False",
        "  rank token count: relative error 0.08, matches: False",
        "global token count: relative error 0.00, matches: True",
        "fp16, scale 2^16, sum then divide: finite False",
        "fp16, scale 2^16, divide then sum: finite True",
        "divide then sum within fp16 precision (< 1e-3): True",
    ]
    assert all(len(f"[rank 0] {line}") <= 100 for line in r.rank_lines(0)[:-1])


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
