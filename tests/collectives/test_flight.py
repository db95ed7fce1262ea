"""``python -m ddp_lesson.flight``: per-rank ledgers and the diverging rank, from real gloo jobs'
flight-recorder dumps (torch 2.13 records on gloo), some written by torch's own calls."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lesson import flight
from ddp_lesson.launch import run_torchrun, run_torchrun_many

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = str(ROOT / "tests" / "programs" / "flight_case.py")
CASES = ("differ", "shape", "skip", "silent", "ok")


def _at(code: str, nth: int = 1) -> str:
    """``flight_case.py:N`` of the ``nth`` line of the program holding ``code``."""
    lines = [i for i, line in enumerate(Path(PROGRAM).read_text().splitlines(), 1)
             if code in line]
    return f"flight_case.py:{lines[nth - 1]}"


SECOND = _at("dist.all_reduce(x)", 2)          # collective #2, the same on both ranks
DIFFER = _at("dist.all_reduce(torch.ones(3)) if rank == 0 else dist.broadcast(x, 0)")
SKIPPED = _at("            dist.all_reduce(x)")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Each case's folder of dumps, after one launch of all five two-rank jobs at once."""
    dirs = {c: tmp_path_factory.mktemp(f"fr_{c}") for c in CASES}
    jobs = {c: dict(target=PROGRAM, args=[c, str(d)], nproc_per_node=2, backend="gloo",
                    timeout=120, check=False) for c, d in dirs.items()}
    results = run_torchrun_many(jobs, live=False)
    for c, r in results.items():
        assert r.rank_lines(0)[-1:] == ["done"], (
            c, r.returncode, {rank: err[-1500:] for rank, err in r.errors.items()},
            r.launcher_stderr[-1500:])
    return dirs


def _report(d):
    return flight.report(d)


@pytest.mark.slow
def test_ranks_that_called_different_collectives(dumps):
    """torch's raw pickle, written by the ranks themselves under NCCL's default file name."""
    assert sorted(p.name for p in dumps["differ"].iterdir()) == [
        "nccl_trace_rank_0", "nccl_trace_rank_1"]
    assert _report(dumps["differ"]) == [
        f"rank 0 last completed: #2 all_reduce [4] Float ({SECOND})",
        f"rank 0 first unfinished: #3 all_reduce [3] Float ({DIFFER})",
        f"rank 1 last completed: #2 all_reduce [4] Float ({SECOND})",
        f"rank 1 first unfinished: #3 broadcast [4] Float ({DIFFER})",
        f"verdict: #3 differs: rank 0 all_reduce [[3]] ({DIFFER}); "
        f"rank 1 broadcast [[4]] ({DIFFER})",
    ]


@pytest.mark.slow
def test_an_all_reduce_of_different_sizes_returns_on_one_rank(dumps):
    """torch's JSON form (no stacks: callers unknown). gloo completes the 3-element all_reduce
    on rank 0 while rank 1's 4-element one waits: the record shows the mismatch anyway."""
    rows = flight.ledgers(flight.load_dumps(dumps["shape"]))
    assert [(r.last_completed.seq, r.first_unfinished and r.first_unfinished.seq) for r in rows] \
        == [(3, None), (2, 3)]
    assert flight.verdict(flight.load_dumps(dumps["shape"])) == (
        "#3 differs: rank 0 all_reduce [[3]]; rank 1 all_reduce [[4]]")


@pytest.mark.slow
def test_a_rank_that_never_called_the_collective(dumps):
    assert _report(dumps["skip"])[-3:] == [
        f"rank 1 last completed: #2 all_reduce [4] Float ({SECOND})",
        "rank 1 first unfinished: none",
        f"verdict: rank 1 never called #3 all_reduce ({SKIPPED}), rank 0 did",
    ]
    assert _report(dumps["skip"])[1] == (
        f"rank 0 first unfinished: #3 all_reduce [4] Float ({SKIPPED})")


@pytest.mark.slow
def test_a_rank_that_died_without_a_record(dumps):
    assert [p.name for p in dumps["silent"].iterdir()] == ["trace_0"]
    assert flight.verdict(flight.load_dumps(dumps["silent"])) == (
        "rank 1 wrote no trace: it died or never got there")


@pytest.mark.slow
def test_a_job_that_went_well(dumps):
    assert _report(dumps["ok"])[-1] == "verdict: nothing unfinished: every rank completed " \
        "collective #3"


@pytest.mark.slow
def test_the_command_line_prints_the_ledger_and_exits_2_without_dumps(dumps, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ddp_lesson.flight", str(dumps["skip"])],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0
    assert r.stdout.splitlines() == _report(dumps["skip"])
    r = subprocess.run([sys.executable, "-m", "ddp_lesson.flight", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2
    assert "no flight-recorder dump" in r.stderr


@pytest.mark.slow
def test_torchs_own_analyzer_stops_on_gloo_dumps(dumps, tmp_path):
    """What the module docstring says of torch 2.13's fr_trace on these dumps. (If a torch
    release fixes it, this test fails: update the docstring and docs/pitfalls.md C6.)"""
    for p in dumps["differ"].iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    r = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                        str(tmp_path), "-p", "nccl_trace_rank_"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "KeyError: ('0', 0)" in r.stderr


def _entry(seq, op="all_reduce", size=(4,), done=True):
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": [list(size)],
            "input_dtypes": ["Float"], "process_group": ("0", "default_pg"), "is_p2p": False,
            "frames": [{"filename": "/x/site-packages/torch/distributed/c10d.py", "line": 1},
                       {"filename": "/home/me/train.py", "line": 42}], "retired": done}


def _dump(entries, completed):
    return {"version": "2.10", "pg_config": {"": {"name": "", "ranks": "[0, 1, 2]"}},
            "pg_status": {"0": {"last_completed_collective": completed}}, "entries": entries}


def test_a_group_that_never_formed():
    """A rank stuck in ``init_process_group`` (the clinic's missing_rank) has no group yet:
    its record is empty, and the verdict says so instead of "nothing unfinished"."""
    empty = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}
    assert flight.verdict({0: empty, 1: empty}) == (
        "no rank recorded process group 0: the group never formed")
    assert flight.Collective(1, "barrier", (), (), "env.py:9").text() == "#1 barrier [] (env.py:9)"


def test_a_status_that_lags_the_retired_entries_reads_as_completed():
    """The record of rank 1 of a job that went well, as torch wrote it (1 of 4 runs): status 2,
    all three entries retired. It reads completed through #3, not waiting in #3."""
    lagging = _dump([_entry(1), _entry(2), _entry(3)], 2)
    assert flight.completed_through(lagging) == 3
    # a stuck collective is not retired: the status decides below it
    assert flight.completed_through(_dump([_entry(1), _entry(2, done=False)], 1)) == 1
    ok = {0: _dump([_entry(1), _entry(2), _entry(3)], 3), 1: lagging, 2: lagging}
    assert flight.verdict(ok) == "nothing unfinished: every rank completed collective #3"


def test_settle_waits_for_a_completion_marked_late_and_gives_up_on_a_pending_one():
    """A collective that returned is marked completed a moment later (the work's thread):
    ``settle`` waits for the mark; one really pending ends the wait at ``timeout_s``."""
    watch = object.__new__(flight.HangWatch)  # no thread, no group: only the status is faked
    late = iter([(1, 0), (1, 0), (1, 1)])
    watch._status = lambda: next(late)
    assert watch.settle(timeout_s=5.0, poll_s=0.0) is True
    with pytest.raises(StopIteration):  # it stopped at the third look, the completed one
        watch._status()
    calls = []
    watch._status = lambda: calls.append(1) or (2, 1)
    assert watch.settle(timeout_s=0.05, poll_s=0.01) is False and len(calls) >= 2


def test_verdicts_on_hand_made_records(tmp_path):
    base = [_entry(1), _entry(2)]
    same = {r: _dump(base + [_entry(3, done=False)], 2) for r in range(3)}
    assert flight.verdict(same) == (
        "every rank waits in #3 all_reduce (train.py:42): the records match")
    ahead = {**same, 2: _dump(base + [_entry(3), _entry(4, "barrier", (), False)], 3)}
    assert flight.verdict(ahead) == "rank 0, 1 never called #4 barrier (train.py:42), rank 2 did"
    # a buffer that dropped the oldest entries: compare only what every rank still holds
    wrapped = {**same, 0: _dump([_entry(2), _entry(3, done=False)], 2)}
    assert flight.verdict(wrapped).startswith("every rank waits in #3")
    for r, d in same.items():
        (tmp_path / f"trace_{r}").write_bytes(pickle.dumps(d))
    (tmp_path / "trace_0.tmp").write_bytes(b"half a dump")
    assert sorted(flight.load_dumps(tmp_path)) == [0, 1, 2]
    (tmp_path / "other_0").write_bytes(pickle.dumps(same[0]))
    with pytest.raises(ValueError, match="several prefixes"):
        flight.load_dumps(tmp_path)
    assert sorted(flight.load_dumps(tmp_path, prefix="trace_")) == [0, 1, 2]


LATE_PEER = str(ROOT / "tests" / "programs" / "clinic_late_peer.py")


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 2.5])
def test_a_peer_behind_a_failed_rank_is_recorded_stuck(delay, tmp_path):
    """The kind of CI's red nb07 replay (clinic ``model_mismatch`` on a loaded machine): rank 1
    fails outside any collective, rank 0 reaches its broadcast with it ``delay`` s later (2.5:
    past the 2 s timeout). The failed rank waits until every record is final (HangWatch), so
    rank 0 is recorded stuck instead of leaving its broadcast completed (it failed at once:
    the peer was gone) or no record (torchrun stopped it first), as before the wait. A mark
    left by an earlier launch in the folder does not count."""
    (tmp_path / "trace_0.final").write_text("an earlier launch")
    r = run_torchrun(LATE_PEER, args=[str(delay), "--timeout", "2", "--flight-dir",
                                      str(tmp_path)],
                     nproc_per_node=2, backend="gloo", timeout=90, check=False)
    assert r.returncode != 0
    assert "RuntimeError: rank 1 fails outside any collective" in r.errors[1]
    assert r.rank_lines(0) == ["rank 0 enters broadcast"]
    assert "Timed out waiting 2000ms for send" in r.errors[0]  # not "Connection closed"
    assert flight.report(tmp_path) == [
        "rank 0 last completed: #1 barrier []",
        "rank 0 first unfinished: #2 broadcast [49] Float",
        "rank 1 last completed: #1 barrier []",
        "rank 1 first unfinished: none",
        "verdict: rank 1 never called #2 broadcast, rank 0 did"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "trace_0", "trace_0.final", "trace_1", "trace_1.final"]
    assert (tmp_path / "trace_0.final").read_text() == (tmp_path / "trace_1.final").read_text()


def test_a_record_without_stacks_shows_no_caller():
    """A dump without stacks has caller "?": the line leaves it out rather than print "(?)"."""
    bare = flight.Collective(2, "all_reduce", ((3,),), ("Float",), "?")
    assert bare.text() == "#2 all_reduce [3] Float"
    assert flight.Collective(2, "barrier", (), (), "job.py:9").text() == "#2 barrier [] (job.py:9)"
