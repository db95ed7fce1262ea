"""Notebook 03's concept checks: each number an answer states is what the package computes."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in

from ddp_lesson.core.ring import chunk_bounds, ring_recv_chunk
from ddp_lesson.cost_model import ring_bytes_sent_per_rank


def test_notebook_03_concept_answers():
    checks = concept_checks("03_collectives.ipynb")
    assert len(checks) >= 3
    (q1, a1), (q2, a2), (q3, a3), (q4, a4) = checks[:4]
    assert "1,000,000 float32" in q1 and "R = 4" in q1
    assert numbers_in(a1)[0] == ring_bytes_sent_per_rank(1_000_000 * 4, 4) == 6_000_000
    assert "R = 64" in q2
    assert numbers_in(a2)[0] == ring_bytes_sent_per_rank(1_000_000 * 4, 64)
    assert "10 elements" in q3 and "R = 4" in q3
    assert numbers_in(a3)[0] == max(b - a for a, b in chunk_bounds(10, 4))
    assert "R = 4" in q4
    # the chunk rank 0 receives at the last reduce-scatter step is the one it then owns
    assert a4.startswith(f"Chunk {ring_recv_chunk(0, 4 - 2, 4)},")
