"""Notebook 04's concept checks: each numeric answer is what the package's own functions give.

The pairs come from the notebook's ``## Concept checks`` cell (``notebook_cells.concept_checks``);
the buckets from ``ddp_lesson.core.buckets.ddp_buckets`` (torch's rule), the link times from
``ddp_lesson.commsim.SimulatedLink.cost_s`` (the α-β ring formula of notebook 03), DeepLab's
sizes from the model itself. No process group.
"""
from __future__ import annotations

import torch
from notebook_cells import concept_checks, numbers_in

from ddp_lesson.commsim import SimulatedLink
from ddp_lesson.core.buckets import MB, ddp_buckets
from ddp_lesson.labs.ddp_hooks import small_mlp
from ddp_lesson.models import build_model

NB = "04_ddp_from_scratch.ipynb"


def _deeplab_nbytes() -> list[int]:
    torch.manual_seed(0)
    return [p.numel() * p.element_size() for p in build_model("deeplab", width=16).parameters()]


def test_notebook_04_has_at_least_three_concept_checks():
    assert len(concept_checks(NB)) >= 3


def test_bucket_count_for_the_small_mlp_at_100_bytes():
    question, answer = concept_checks(NB)[0]
    sizes = [p.numel() * p.element_size() for p in small_mlp(seed=0).parameters()]
    assert sizes == [128, 32, 256, 32, 32, 4]           # the sizes the question lists
    assert "128, 32, 256, 32, 32 and 4 bytes" in question and "100 bytes" in question
    buckets = ddp_buckets(sizes, 100 / MB)
    assert buckets == [[5, 4, 3, 2], [1, 0]]            # 4 + 32 + 32 + 256, then 32 + 128
    assert numbers_in(answer)[0] == len(buckets) == 2


def test_latency_of_naive_ddp_on_deeplab_over_four_ranks():
    question, answer = concept_checks(NB)[1]
    nbytes = _deeplab_nbytes()
    assert len(nbytes) == 43 and "43 tensors" in question and "R = 4" in question
    link = SimulatedLink(latency_s=0.5e-3, bandwidth_bytes_per_s=100e6)
    latency_ms = sum(link.cost_s(0, 4) for _ in nbytes) * 1e3   # zero bytes: α terms only
    assert round(latency_ms, 1) == numbers_in(answer)[0] == 129.0


def test_one_all_reduce_of_deeplab_over_four_ranks():
    question, answer = concept_checks(NB)[2]
    nbytes = _deeplab_nbytes()
    assert sum(nbytes) == 1_149_964 and "1,149,964 bytes" in question
    link = SimulatedLink(latency_s=0.5e-3, bandwidth_bytes_per_s=100e6)
    ms = link.cost_s(sum(nbytes), 4) * 1e3
    assert round(ms, 1) == numbers_in(answer)[0] == 20.2
    assert round(link.cost_s(0, 4) * 1e3, 1) == 3.0 and "6 α = 3 ms" in answer
