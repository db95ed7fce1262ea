"""Notebook 08's concept checks: each numeric answer is what the package's memory functions give."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in

from ddp_lesson.memory import (
    GB,
    max_params_per_memory,
    memory_per_rank,
    per_rank_bytes,
    smallest_stage,
)


def test_08_concept_checks_answers_are_the_packages():
    checks = concept_checks("08_beyond_ddp_zero_fsdp.ipynb")
    assert len(checks) >= 3
    (q1, a1), (q2, a2), (q3, a3), (q4, a4) = checks
    assert "7B-parameter" in q1 and "8 GPUs" in q1 and "ZeRO-1" in q1
    assert numbers_in(a1)[0] == memory_per_rank(7e9, 8, 1).total_bytes / GB == 38.5
    assert "30 GB of activations" in q2 and "80 GB" in q2
    assert smallest_stage(7e9, 30e9, 8, 80e9) == 1 and a2.startswith("ZeRO-1")
    assert numbers_in(a2)[1] == per_rank_bytes(7e9, 30e9, 8, 1) / GB == 68.5
    assert f"{per_rank_bytes(7e9, 30e9, 8, 0) / GB:g} GB" in a2      # DDP's 142 GB
    assert "64 GPUs of 80 GB" in q3
    assert numbers_in(a3)[0] == max_params_per_memory(80e9, 64, 3) / 1e9 == 320
    # activations per rank do not depend on the world size: the rule adds them undivided
    assert "8 to 16 GPUs" in q4 and a4.startswith("1 ")
    for s in range(4):
        assert (per_rank_bytes(7e9, 30e9, 16, s) - memory_per_rank(7e9, 16, s).total_bytes
                == per_rank_bytes(7e9, 30e9, 8, s) - memory_per_rank(7e9, 8, s).total_bytes)
