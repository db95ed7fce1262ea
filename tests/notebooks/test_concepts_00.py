"""Notebook 00's concept checks: each numeric answer is what the package computes."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in, stream_text

from ddp_lesson.env import choose_backend
from ddp_lesson.exercises.solutions import local_rank_from_rank

NB = "00_setup.ipynb"


def test_local_rank_of_rank_6_on_2_nodes_of_4():
    question, answer = concept_checks(NB)[0]
    assert "2 nodes × 4 processes" in question and "`RANK` 6" in question
    assert numbers_in(answer)[0] == local_rank_from_rank(6, 4) == 2


def test_sum_of_ranks_over_5_processes():
    question, answer = concept_checks(NB)[1]
    assert "5 processes" in question
    # W(W-1)/2, the rule the answer uses, is what the real runs printed at W = 2 and W = 3
    two = stream_text(NB, "all_reduce(sum of ranks)")
    three = stream_text("deep/00_torchrun_internals.ipynb", "from ddp_lesson.labs.torchrun_env")
    assert "all_reduce(sum of ranks)=1" in two and "all_reduce(sum of ranks) = 3" in three
    assert numbers_in(answer)[0] == 5 * 4 / 2 == sum(range(5))


def test_backend_for_4_processes_on_2_gpus():
    question, answer = concept_checks(NB)[2]
    assert "4 processes" in question and "2 GPUs" in question
    backend, _ = choose_backend(4, "auto", cuda_device_count=2)
    assert answer.startswith(f"{backend}:") and backend == "gloo"
