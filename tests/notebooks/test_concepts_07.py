"""Notebook 07's concept checks: each numeric answer equals what the package (or torch) computes."""
import re
import signal

from notebook_cells import concept_checks, stream_text

from ddp_lesson.exercises.solutions import global_rank

NB = "07_failures_and_multinode.ipynb"


def _number(answer: str) -> int:
    return int(re.match(r"-?\d+", answer).group(0))


def test_there_are_at_least_three_checks():
    assert len(concept_checks(NB)) >= 3


def test_global_rank_of_local_rank_3_on_node_1():
    question, answer = concept_checks(NB)[0]
    assert "--nnodes 2 --nproc-per-node 4" in question and "LOCAL_RANK` 3" in question
    assert _number(answer) == global_rank(node_rank=1, local_rank=3, nproc_per_node=4)


def test_an_oom_killed_rank_exits_minus_sigkill():
    _, answer = concept_checks(NB)[1]
    assert _number(answer) == -signal.SIGKILL
    # the deep dive's plain-torchrun run shows the same exit code for a SIGKILLed rank
    text = stream_text("deep/07_debugging_a_real_job.ipynb", 'run_plain("kill")')
    assert f"exitcode  : {_number(answer)} (SIGKILL)" in text


def test_gloos_default_timeout_in_seconds():
    from torch.distributed import constants

    _, answer = concept_checks(NB)[2]
    assert _number(answer) == constants.default_pg_timeout.total_seconds()


def test_steps_computed_twice_after_the_kill():
    """The stored run: rank 1 killed after step 5, the restart resumes from step 4's checkpoint."""
    from ddp_lesson.labs.restart_jobs import JOBS

    _, answer = concept_checks(NB)[3]
    extra = JOBS["killed"][1]
    killed_after = int(extra[extra.index("--simulate-failure-at-step") + 1])
    run = stream_text(NB, "story(killed)")
    resumed = int(re.search(r"resuming from .*\(global step (\d+)\)", run).group(1))
    assert _number(answer) == killed_after - resumed
