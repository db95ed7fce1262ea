"""Notebook 05's concept checks: each numeric answer is what the package computes."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in

from ddp_lesson.gradients import weighted_average
from ddp_lesson.sampler import num_samples_per_rank

NB = "05_your_script_data_parallel.ipynb"


def test_per_rank_batch_and_steps_on_4_ranks():
    question, answer = concept_checks(NB)[0]
    assert "`--batch-size 16`" in question and "4 ranks" in question and "64 samples" in question
    per_rank = 16 // 4                          # convert/ddp.py: args.batch_size // world_size
    shard = num_samples_per_rank(64, 4)
    stated = numbers_in(answer)
    assert stated[0] == per_rank == 4 and stated[3] == shard // per_rank == 4
    assert stated[4] == shard == 16


def test_the_logged_mean_loss():
    question, answer = concept_checks(NB)[1]
    assert "6.0 over 2 steps" in question and "2.0 over 2 steps" in question
    mean = weighted_average([6.0 / 2, 2.0 / 2], [2, 2])   # each rank's mean, weighted by steps
    assert numbers_in(answer)[0] == mean == 2.0
    assert "not rank 0's own 3.0" in answer
