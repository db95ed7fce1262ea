"""Notebook 06's concept checks: each numeric answer is what the trainer's own arithmetic gives
(``ddp_lesson.config.derived_values``, ``layout_for``), never a number typed into the test."""
from __future__ import annotations

from notebook_cells import concept_checks, numbers_in

from ddp_lesson.config import derived_values, layout_for, parse_config

NB = "06_training_the_seed_model.ipynb"


def test_three_answered_checks():
    assert len(concept_checks(NB)) >= 3


def test_global_batch_and_steps_per_epoch():
    question, answer = concept_checks(NB)[0]
    assert "1,024 samples" in question and "`-b 8` on 4 ranks" in question
    cfg = parse_config(["--num-train", "1024", "-b", "8", "--grad-accum-steps", "2"])
    d = derived_values(cfg, world_size=4)
    # "Global batch 8 × 4 × 2 = 64; 1,024 / 64 = 16 steps per epoch."
    assert numbers_in(answer) == [8, 4, 2, d["global_batch"], 1024, d["global_batch"],
                                d["steps_per_epoch"]]


def test_learning_rate_of_that_run():
    question, answer = concept_checks(NB)[1]
    assert "`--lr 0.05`" in question and "`--base-batch 16`" in question
    cfg = parse_config(["--num-train", "1024", "-b", "8", "--grad-accum-steps", "2",
                        "--lr", "0.05", "--base-batch", "16", "--lr-scaling", "linear"])
    d = derived_values(cfg, world_size=4)
    assert numbers_in(answer)[:4] == [0.05, d["global_batch"], 16, d["effective_lr"]]


def test_resumed_on_one_process():
    question, answer = concept_checks(NB)[2]
    assert "64 samples, `-b 4` on 2 ranks" in question and "5 of its 8 steps" in question
    cfg = parse_config(["--num-train", "64", "-b", "4"])
    assert derived_values(cfg, world_size=2)["steps_per_epoch"] == 8
    resumed = derived_values(cfg, world_size=1, layout=layout_for(cfg, 64, 2, 1))
    k, g = resumed["grad_accum_steps"], resumed["global_batch"]
    # "2 micro-batches of 4 per step (K' = K·R/R' = 2): global batch 8, as before."
    assert numbers_in(answer) == [k, 4, k, g]
    assert g == derived_values(cfg, world_size=2)["global_batch"]
