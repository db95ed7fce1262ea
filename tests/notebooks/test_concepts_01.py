"""Notebook 01's concept checks: each numeric answer is what the package computes."""
from __future__ import annotations

import pytest
from notebook_cells import concept_checks, numbers_in

from ddp_lesson.gradients import scalar_squared_error_grad as grad_w
from ddp_lesson.gradients import scale_lr, weighted_average

NB = "01_data_parallelism.ipynb"


def test_linear_rule_for_8_ranks_of_64():
    question, answer = concept_checks(NB)[0]
    assert "lr 0.1 with global batch 256" in question and "8 ranks × 64" in question
    assert numbers_in(answer)[0] == scale_lr(0.1, base_batch=256, global_batch=8 * 64) == 0.2


def test_plain_and_weighted_average_of_unequal_shards():
    question, answer = concept_checks(NB)[1]
    assert "`[1, 2, 3]` and `[4]`" in question
    shards = [[1, 2, 3], [4]]
    g = [grad_w(1.0, s) for s in shards]
    plain, weighted = sum(g) / 2, weighted_average(g, [len(s) for s in shards])
    stated = numbers_in(answer)
    assert stated[0] == pytest.approx(plain, abs=5e-4)          # 20.667
    assert stated[1:3] == [round(g[0], 3), round(g[1], 3)]        # 9.333, 32
    assert weighted == pytest.approx(grad_w(1.0, [1, 2, 3, 4])) == stated[4] == 15


def test_sum_loss_fraction_on_4_ranks():
    question, answer = concept_checks(NB)[2]
    assert "4 ranks" in question
    x = [1, 2, 3, 4]                                   # one sample per rank
    ddp = sum(grad_w(1.0, [v], "sum") for v in x) / 4  # DDP averages the ranks' gradients
    assert numbers_in(answer)[0] == ddp / grad_w(1.0, x, "sum") == 0.25
