"""Notebook 02's concept checks: each number an answer states is what the core sampler gives."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in

from ddp_lesson.core.sampler import DistributedSampler
from ddp_lesson.sampler import padding_count


def test_notebook_02_concept_answers():
    checks = concept_checks("02_sampler_sharding.ipynb")
    assert len(checks) >= 3
    (q1, a1), (q2, a2), (q3, a3) = checks[:3]
    assert "N = 1,000" in q1 and "R = 16" in q1 and "drop_last=False" in q1
    per_rank = {d: {len(DistributedSampler(range(1000), 16, r, drop_last=d)) for r in range(16)}
                for d in (False, True)}
    assert per_rank == {False: {numbers_in(a1)[0]}, True: {numbers_in(a2)[0]}}
    assert "drop_last=True" in q2
    assert "N = 3" in q3 and "R = 8" in q3
    assert numbers_in(a3)[0] == padding_count(3, 8)
    assert padding_count(3, 8) == 8 * len(DistributedSampler(range(3), 8, 0)) - 3
