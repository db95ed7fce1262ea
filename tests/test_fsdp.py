"""FSDP2 (``fully_shard``) on TinyGPT over gloo: DDP's losses, ~1/R of the parameter bytes."""
from __future__ import annotations

import math

import pytest
from gpt_reference import lab_value, single_process_losses

from ddp_lesson.gpt import TinyGPT

pytestmark = pytest.mark.timeout(120)


def test_fsdp_matches_ddp(fsdp_lab):
    world_size, lines = fsdp_lab
    assert lab_value(lines, "parameters are DTensors sharded on dim 0") == "True"
    assert lab_value(lines, "FSDP losses match DDP within 1e-05") == "True"
    assert lab_value(lines, "weights after 5 steps match DDP within 1e-5") == "True"
    assert lab_value(lines, "DDP  losses") == lab_value(lines, "FSDP losses")
    if world_size == 2:  # the losses notebook 07 prints, from a single-process run
        ref = single_process_losses(5, 2)
        assert lab_value(lines, "FSDP losses") == " ".join(f"{v:.3f}" for v in ref)


def test_parameter_bytes_per_rank(fsdp_lab):
    world_size, lines = fsdp_lab
    m = TinyGPT(vocab_size=103)
    full = 4 * m.num_params()
    assert lab_value(lines, "full parameters (what DDP keeps on every rank)") == f"{full:,} bytes"
    # FSDP2 shards dim 0 like torch.chunk: ceil(d0 / R) rows per rank, the last ranks fewer
    expected = [0] * world_size
    for p in m.parameters():
        d0, rest = p.shape[0], p[0].numel()
        size = math.ceil(d0 / world_size)
        for r in range(world_size):
            rows = max(0, min(size, d0 - r * size))
            expected[r] += 4 * rows * rest
    for r in range(world_size):
        v = lab_value(lines, f"rank {r} FSDP parameter shard")
        assert v.startswith(f"{expected[r]:,} bytes")
        assert abs(expected[r] * world_size / full - 1) < 0.10
