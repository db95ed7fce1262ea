"""Notebook 09's concept checks: each numeric answer is what the package computes."""
from __future__ import annotations

import pytest
from notebook_cells import concept_checks, numbers_in

from ddp_lesson.cost_model import HARDWARE, compute_bound_batch, ring_bytes_sent_per_rank

NB = "09_how_fast_a_step_can_go.ipynb"


def test_concept_checks_09():
    checks = concept_checks(NB)
    assert len(checks) >= 3
    (q1, a1), (q2, a2), (q3, a3) = checks[:3]
    assert "1e9 bf16 gradients over 8 GPUs" in q1
    assert 3.5e9 in numbers_in(a1) and ring_bytes_sent_per_rank(2 * 1e9, 8) == 3.5e9
    assert "2.6e9 bytes" in q2 and "2 nodes of 8 H100s" in q2
    hw = HARDWARE["h100-200g"]
    assert hw.allreduce_s(2.6e9, 16) == pytest.approx(0.104)
    assert 0.104 in numbers_in(a2)
    assert 1.75 * 2.6e9 / hw.gpu_bytes_per_s == pytest.approx(0.01, abs=0.0005)  # "only 0.01 s"
    assert "0.01 s" in a2
    b = compute_bound_batch(4e9, 2e9, HARDWARE["h100"], 8)
    assert round(b) == 1923 and 1923 in numbers_in(a3)
