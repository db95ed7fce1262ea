"""Memory accounting (ddp_lesson.memory) against the ZeRO paper's worked example."""
from __future__ import annotations

import math

import pytest

from ddp_lesson.memory import GB, max_params_per_memory, memory_per_rank


def test_zero_paper_figure1_example():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (GB = 1e9 bytes)
    totals = [memory_per_rank(7.5e9, 64, s).total_bytes / GB for s in (0, 1, 2, 3)]
    assert round(totals[0], 1) == 120.0
    assert round(totals[1], 1) == 31.4
    assert round(totals[2], 1) == 16.6
    assert round(totals[3], 2) == 1.88
    # and the formulas behind them, in bytes
    assert totals[0] * GB == pytest.approx(16 * 7.5e9)
    assert totals[1] * GB == pytest.approx(4 * 7.5e9 + 12 * 7.5e9 / 64)
    assert totals[2] * GB == pytest.approx(2 * 7.5e9 + 14 * 7.5e9 / 64)
    assert totals[3] * GB == pytest.approx(16 * 7.5e9 / 64)


def test_breakdown_parts_and_stage_monotone():
    m = memory_per_rank(1000, 4, 2)
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (2000, 500, 3000)
    for n in (1, 2, 8):
        totals = [memory_per_rank(1e6, n, s).total_bytes for s in range(4)]
        assert totals == sorted(totals, reverse=True)
        if n == 1:
            assert len(set(totals)) == 1


def test_inverse():
    assert memory_per_rank(7.5e9, 1, 3).total_bytes == 120e9  # one rank: nothing to share
    # 80 GB with DDP fits 5B parameters of model states (16 bytes each)
    assert max_params_per_memory(80e9, 8, 0) == pytest.approx(5e9)
    assert max_params_per_memory(80e9, 64, 3) == pytest.approx(80e9 * 64 / 16)
    assert math.isclose(max_params_per_memory(80e9, 64, 1), 80e9 / (4 + 12 / 64))


def test_notebook_numbers():
    # the largest model whose states fit in 80 GB on 64 ranks (notebook 08's concept check: 320B)
    assert round(max_params_per_memory(80e9, 64, 0) / 1e9, 1) == 5.0
    assert round(max_params_per_memory(80e9, 64, 1) / 1e9, 1) == 19.1
    assert round(max_params_per_memory(80e9, 64, 2) / 1e9, 1) == 36.1
    assert round(max_params_per_memory(80e9, 64, 3) / 1e9, 1) == 320.0


@pytest.mark.parametrize("args, match", [((-1, 2, 0), "num_params"), ((10, 0, 0), "world_size"),
                                         ((10, 2, 4), "stage 4")])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        memory_per_rank(*args)


def test_notebook_table_parts():
    # notebook 08's table (GB, 2 decimals): 2 and 2 bytes of 16-bit params/grads, K = 12
    expected = {0: (15.0, 15.0, 90.0, 120.0), 1: (15.0, 15.0, 1.41, 31.4),
                2: (15.0, 0.23, 1.41, 16.6), 3: (0.23, 0.23, 1.41, 1.88)}
    for stage, (p, g, o, total) in expected.items():
        m = memory_per_rank(7.5e9, 64, stage)
        assert (round(m.params_bytes / GB, 2), round(m.grads_bytes / GB, 2),
                round(m.optimizer_bytes / GB, 2)) == (p, g, o)
        assert float(f"{m.total_bytes / GB:.3g}") == total
