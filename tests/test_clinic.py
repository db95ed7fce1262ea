"""The hang clinic (ddp_lesson.labs.clinic): every broken program ends in a clear error within
its timeout instead of hanging, and every ``--fixed`` version succeeds.

The errors asserted are torch's and gloo's own messages: a collective that waits past the
process group's timeout raises "Timed out waiting <ms>ms for recv operation" (or send); with
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch names a mismatched collective; DDP's constructor
names a parameter whose shape differs between ranks. A 2 s timeout keeps the test short (the
programs default to 5 s). All broken runs start at once (``run_all``): they mostly wait.
"""
import os

import pytest
from notebook_cells import stream_text

from ddp_lesson.labs.clinic import CASES, diagnose, run_all, split_cases, telling_line
from ddp_lesson.launch import run_torchrun

TIMEOUT_MS = "Timed out waiting 2000ms for"  # ... recv (or send) operation to complete
NB = "06_failures_and_multinode.ipynb"


@pytest.fixture(scope="module")
def clinic():
    """Every broken case, shape_mismatch again with DETAIL, and the repairs' job, at once."""
    runs = {name: (name, ["--timeout", "2"]) for name in CASES}
    runs["detail"] = ("shape_mismatch", ["--timeout", "2"], {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    runs["fixed"] = ("fixed", ["--timeout", "10"])
    return run_all(runs, timeout=120)


def _broken(clinic, name):
    r = clinic[name]
    assert r.returncode != 0
    return r, r.errors[0] + r.errors[1]


def test_collective_called_by_one_rank_times_out(clinic):
    r, err = _broken(clinic, "partial_collective")
    assert "rank 0 enters all_reduce; the other ranks do not" in r.rank_lines(0)
    assert TIMEOUT_MS in r.errors[0]
    assert diagnose(r) == "timeout"
    assert telling_line("partial_collective", r) == "RuntimeError: Timed out waiting 2000ms"


def test_all_reduce_with_different_shapes_times_out(clinic):
    r, err = _broken(clinic, "shape_mismatch")
    assert "rank 1: all_reduce of shape (3,)" in r.rank_lines(1)
    assert TIMEOUT_MS in err  # the elements the longer tensor has and the other lacks
    assert diagnose(r) == "timeout"
    assert telling_line("shape_mismatch", r) == "RuntimeError: Timed out waiting 2000ms"


def test_debug_detail_names_the_mismatched_collective(clinic):
    r, err = _broken(clinic, "detail")
    assert diagnose(r) == "mismatched collectives"
    assert "Detected mismatch between collectives on ranks" in err
    assert "TensorShape=[2]" in err and "TensorShape=[3]" in err


def test_uneven_batches_time_out_in_the_extra_backward(clinic):
    r, err = _broken(clinic, "uneven_batches")
    assert r.rank_lines(0)[:1] == ["rank 0: 3 batches"]
    assert r.rank_lines(1)[:1] == ["rank 1: 4 batches"]
    assert TIMEOUT_MS in err  # rank 1's 4th backward, or rank 0 waiting for it in barrier()
    assert diagnose(r) == "timeout"
    assert telling_line("uneven_batches", r) == "RuntimeError: Timed out waiting 2000ms"


def test_rank_that_never_joins_fails_at_start_within_the_timeout(clinic):
    r, err = _broken(clinic, "missing_rank")
    for rank in (0, 1):
        assert r.rank_lines(rank) == [f"rank {rank}: torchrun started 2 processes; "
                                      "joining a group of 3"]
    assert "DistStoreError: wait timeout after 2000ms" in err
    assert diagnose(r) == "a rank never joined"
    assert telling_line("missing_rank", r) == "DistStoreError: wait timeout after 2000ms"


def test_model_differing_between_ranks_is_refused_by_ddp(clinic):
    r, err = _broken(clinic, "model_mismatch")
    assert ("params[0] in this process with sizes [9, 4] appears not to match sizes of the "
            "same param in process 0") in r.errors[1]
    assert diagnose(r) == "model differs between ranks"
    assert telling_line("model_mismatch", r) == (
        "RuntimeError: [1]: params[0] in this process with sizes [9, 4] appears not to "
        "match sizes of the same param in process 0.")


@pytest.fixture(scope="module")
def fixed(clinic):
    """Each case's ``--fixed`` output, per rank, cut from the one repairs' job."""
    assert diagnose(clinic["fixed"]) == "finished"
    return {rank: split_cases(clinic["fixed"].rank_lines(rank)) for rank in (0, 1)}


def test_every_fixed_version_succeeds(fixed):
    assert list(fixed[0]) == list(fixed[1]) == list(CASES)  # every case ran, in order
    assert fixed[0]["partial_collective"] == ["mean loss over 2 ranks: 1.50"]  # (1+2)/2
    for rank in (0, 1):
        # [0, 1] + [0, 1, 2] after padding to 3
        assert fixed[rank]["shape_mismatch"] == [f"rank {rank}: padded to 3, sum [0.0, 2.0, 2.0]"]
        assert fixed[rank]["uneven_batches"][-2:] == [
            f"rank {rank}: BucketedDDP under Join: weights equal on all ranks: True",
            f"rank {rank}: done; weights equal on all ranks: True"]
        assert f"rank {rank}: one step done with DDP" in fixed[rank]["model_mismatch"]
        assert fixed[rank]["missing_rank"] == [
            f"rank {rank}: torchrun started 2 processes; joining a group of 2",
            f"rank {rank}: all 2 ranks joined"]


def test_split_cases_cuts_at_the_headers():
    lines = ["before", "== a", "x", "y", "== b", "== c", "z"]
    assert split_cases(lines) == {"a": ["x", "y"], "b": [], "c": ["z"]}


def test_notebook_clinic_cells_as_stored():
    """Notebook 06's stored clinic outputs: the verdicts and errors of a 3 s timeout."""
    assert stream_text(NB, "clinic = run_all(runs)") == (
        "partial_collective   ends with: timeout\n"
        "                     RuntimeError: Timed out waiting 3000ms\n"
        "shape_mismatch       ends with: timeout\n"
        "                     RuntimeError: Timed out waiting 3000ms\n"
        "uneven_batches       ends with: timeout\n"
        "                     RuntimeError: Timed out waiting 3000ms\n"
        "model_mismatch       ends with: model differs between ranks\n"
        "                     RuntimeError: [1]: params[0] in this process with sizes [9, 4] "
        "appears not to\n"
        "                       match sizes of the same param in process 0.\n"
        "missing_rank         ends with: a rank never joined\n"
        "                     DistStoreError: wait timeout after 3000ms\n")
    assert stream_text(NB, 'detail = clinic["shape_mismatch, DETAIL"]') == (
        "with DETAIL it ends with: mismatched collectives\n"
        "shapes named in the error: ['TensorShape=[2]', 'TensorShape=[3]']\n")
    assert stream_text(NB, "fixed = {rank: split_cases") == (
        "the repairs' job: finished\n"
        "partial_collective   --fixed: rank 0 says 'mean loss over 2 ranks: 1.50'\n"
        "shape_mismatch       --fixed: rank 0 says 'rank 0: padded to 3, sum [0.0, 2.0, 2.0]'\n"
        "uneven_batches       --fixed: rank 0 says 'rank 0: done; weights equal on all ranks: "
        "True'\n"
        "model_mismatch       --fixed: rank 0 says 'rank 0: one step done with DDP'\n"
        "missing_rank         --fixed: rank 0 says 'rank 0: all 2 ranks joined'\n")


def test_diagnose_reads_the_signatures():
    from types import SimpleNamespace

    from ddp_lesson.labs.clinic import diagnose

    def res(rc, *errs):
        return SimpleNamespace(returncode=rc, errors=dict(enumerate(errs)))

    assert diagnose(res(0, "")) == "finished"
    assert diagnose(res(1, "Timed out waiting 5000ms", "Connection closed by peer")) == "timeout"
    assert diagnose(res(1, "Connection closed by peer")) == "a peer crashed"
    assert diagnose(res(1, "boom")) == "other error"


def test_telling_line_keeps_only_the_stable_text():
    from types import SimpleNamespace

    raw = ("[rank0]: Traceback (most recent call last):\n"
           "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
           "unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete\n")
    res = SimpleNamespace(errors={0: raw, 1: "torch.distributed.DistStoreError: wait timeout "
                                             "after 5000ms, keys: /default_pg/0//cpu//0/0\n"})
    assert telling_line("partial_collective", res) == "RuntimeError: Timed out waiting 5000ms"
    assert telling_line("missing_rank", res) == "DistStoreError: wait timeout after 5000ms"
    assert telling_line("model_mismatch", res).startswith("(no line matches")
    with pytest.raises(KeyError, match="'nope' is not a clinic case"):
        telling_line("nope", res)


def _worker_pids(module: str) -> dict[int, int]:
    """rank -> pid of the live workers running ``module`` (read from /proc: Linux only)."""
    from pathlib import Path

    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddp_lesson._worker" in cmd and module.encode() in cmd:
            for var in environ:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
    return found


def _catches_sigusr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (``SigCgt`` in /proc/PID/status):
    before that, the signal's default action would end it."""
    import signal

    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGUSR1 - 1) & 1)


def test_stack_dump_on_sigusr1_shows_where_a_rank_waits():
    """``kill -USR1`` on a stuck worker prints its Python stack (faulthandler) and lets it run
    on: the stuck rank's stack ends in the line of the collective it waits in."""
    import signal
    import threading
    import time

    module = "ddp_lesson.labs.clinic.partial_collective"
    sent = {}

    def dump_rank0_when_stuck():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "pid" not in sent:
            pids = _worker_pids(module)
            if 0 in pids and _catches_sigusr1(pids[0]):  # faulthandler is registered
                time.sleep(3)  # by now rank 0 waits inside all_reduce (timeout 15 s)
                os.kill(pids[0], signal.SIGUSR1)
                sent["pid"] = pids[0]
            time.sleep(0.1)

    thread = threading.Thread(target=dump_rank0_when_stuck)
    thread.start()
    r = run_torchrun(module, ["--timeout", "15"], module=True, nproc_per_node=2, timeout=90,
                     live=False, backend="gloo", check=False)
    thread.join()
    assert "pid" in sent
    dump = r.errors[0]
    assert "Current thread" in dump or "Thread 0x" in dump  # faulthandler's format
    stuck_line = [ln for ln in dump.splitlines() if "partial_collective.py" in ln]
    assert stuck_line and "in run" in stuck_line[0]  # the program's body, inside all_reduce
    assert TIMEOUT_MS.replace("2000", "15000") in dump  # and then the collective still timed out
