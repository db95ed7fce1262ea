"""The hang clinic (ddp_lesson.labs.clinic): every broken program ends in a clear error within
its timeout instead of hanging, and every ``--fixed`` version succeeds.

The errors asserted are torch's and gloo's own messages: a collective that waits past the
process group's timeout raises "Timed out waiting <ms>ms for recv operation" (or send); with
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch names a mismatched collective; DDP's constructor
names a parameter whose shape differs between ranks.

One job, one launch (docs/architecture.md): notebook 07's clinic cell starts exactly these
launches (every broken case with a 3 s timeout and its flight record, shape_mismatch again with
DETAIL, the repairs' job) and prints, per case, how it ended, the telling line of its error and
the flight recorder's verdict (gloo, written while the case hangs), then shape_mismatch's
ledger rank by rank. The tests below read that stored output, after
asserting the cell's source starts those very launches; nbval's replay of the notebook reruns
the cell and fails unless it prints exactly what is stored. Only the SIGUSR1 stack dump
launches here.
"""
import os
from pathlib import Path

import pytest
from notebook_cells import cell_with, stream_text
from procfs import descends_from

from ddp_lesson.labs.clinic import CASES, split_cases, telling_line
from ddp_lesson.launch import run_torchrun

NB = "07_failures_and_multinode.ipynb"
CLINIC_CELL = "clinic = run_all(runs, timeout=300)"
FIXED_CELL = "split_cases(clinic[\"fixed\"]"
TIMEOUT_LINE = "RuntimeError: Timed out waiting 3000ms"
ROOT = Path(__file__).resolve().parents[2]


def _line_of(path: str, code: str) -> str:
    """``file.py:N``, the line of ``path`` (relative to the repository) that holds ``code``."""
    lines = [i for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
             if code in line]
    assert len(lines) == 1, (path, code, lines)
    return f"{Path(path).name}:{lines[0]}"


#: Where the clinic's verdict for partial_collective (the case recorded with stacks) points.
BUG_AT = _line_of("ddp_lesson/labs/clinic/partial_collective.py",
                  "dist.all_reduce(loss)  # BUG")
LEDGER = "shape_mismatch, rank by rank:"


def _blocks(text: str) -> dict[str, dict]:
    """A clinic cell's printed text, per case: ``{case: {"head": text after "case: ",
    "rest": [its indented lines, wrapped ones joined]}}``."""
    blocks: dict[str, dict] = {}
    for line in text.splitlines():
        if not line.startswith(" "):
            name, _, head = line.partition(": ")
            block = blocks.setdefault(name, {"head": head.strip(), "rest": []})
        elif line.startswith("    ") and block["rest"]:  # a textwrap continuation
            block["rest"][-1] += " " + line.strip()
        else:
            block["rest"].append(line.strip())
    return blocks


@pytest.fixture(scope="module")
def clinic():
    """Notebook 07's stored clinic verdicts, after checking the cell starts the launches the
    tests expect: each case with ``--timeout 3``, DETAIL on shape_mismatch, the repairs' job."""
    source = cell_with(NB, CLINIC_CELL).source
    for line in ('runs = {name: (name, ["--timeout", "3", *flight_args(name)]) for name in CASES}',
                 'stacks = ["--flight-stacks"] if name == "partial_collective" else []',
                 'return ["--flight-dir", f"runs/nb07/flight/{name}", *stacks]',
                 'runs["shape_mismatch, DETAIL"] = ("shape_mismatch", ["--timeout", "3"],',
                 '{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})',
                 'runs["fixed"] = ("fixed", ["--timeout", "10"])',
                 "clinic = run_all(runs, timeout=300)",
                 'flight.report(f"runs/nb07/flight/{name}")[-1]',
                 'flight.report("runs/nb07/flight/shape_mismatch")[:-1]'):
        assert line in source, line
    blocks = _blocks(stream_text(NB, CLINIC_CELL))
    assert list(blocks) == [*CASES, LEDGER]
    return blocks


def _broken(clinic, name, verdict):
    block = clinic[name]
    assert block["head"] == verdict  # diagnose(): not "finished", so rc != 0
    return block


def test_collective_called_by_one_rank_times_out(clinic):
    b = _broken(clinic, "partial_collective", "timeout")
    # the flight recorder, with stacks: rank 1 never called the all_reduce at the bug's line
    assert b["rest"] == [TIMEOUT_LINE,
                         f"verdict: rank 1 never called #2 all_reduce ({BUG_AT}), rank 0 did"]


def test_all_reduce_with_different_shapes_times_out(clinic):
    b = _broken(clinic, "shape_mismatch", "timeout")
    assert b["rest"] == [TIMEOUT_LINE,
                         "verdict: #2 differs: rank 0 all_reduce [[2]]; rank 1 all_reduce [[3]]"]
    # rank 1 waits for the element rank 0 lacks; the record shows rank 0 *completed* the
    # all_reduce (a collective is not a barrier) and waits in the next one (no stacks: no caller)
    assert clinic[LEDGER]["rest"] == [
        "rank 0 last completed: #2 all_reduce [2] Float",
        "rank 0 first unfinished: #3 barrier []",
        "rank 1 last completed: #1 barrier []",
        "rank 1 first unfinished: #2 all_reduce [3] Float"]


def test_debug_detail_names_the_mismatched_collective():
    # diagnose() says "mismatched collectives" only where the ranks' stderr holds torch's
    # "Detected mismatch between collectives on ranks" (SIGNATURES)
    assert stream_text(NB, 'detail = clinic["shape_mismatch, DETAIL"]') == (
        "with DETAIL it ends with: mismatched collectives\n"
        "shapes named in the error: ['TensorShape=[2]', 'TensorShape=[3]']\n")


def test_uneven_batches_time_out_in_the_extra_backward(clinic):
    b = _broken(clinic, "uneven_batches", "timeout")
    # #2 to #9 are DDP's constructor checks and the 3 shared steps, then rank 0's barrier
    # against rank 1's 4th gradient all-reduce
    assert b["rest"] == [TIMEOUT_LINE,
                         "verdict: #10 differs: rank 0 barrier []; rank 1 all_reduce [[5]]"]


def test_rank_that_never_joins_fails_at_start_within_the_timeout(clinic):
    b = _broken(clinic, "missing_rank", "a rank never joined")
    # no group formed: the flight recorder has nothing, and says so
    assert b["rest"] == ["DistStoreError: wait timeout after 3000ms",
                         "verdict: no rank recorded process group 0: the group never formed"]


def test_model_differing_between_ranks_is_refused_by_ddp(clinic):
    b = _broken(clinic, "model_mismatch", "model differs between ranks")
    # "[1]:": rank 1's error, naming the parameter and both sizes; rank 1 raised after the
    # shape check (#3), rank 0 waits in #4, the broadcast of its weights
    assert b["rest"] == ["RuntimeError: [1]: params[0] in this process with sizes [9, 4] "
                         "appears not to match sizes of the same param in process 0.",
                         "verdict: rank 1 never called #4 broadcast, rank 0 did"]


def test_every_fixed_version_succeeds(clinic):
    """The repairs' job (one launch, every repaired program in order): rank 0's last line of
    each case, as notebook 07 prints it."""
    assert stream_text(NB, FIXED_CELL) == (
        "the repairs' job: finished\n"
        "  partial_collective: mean loss over 2 ranks: 1.50\n"  # (1 + 2) / 2
        "  shape_mismatch: rank 0: padded to 3, sum [0.0, 2.0, 2.0]\n"  # [0, 1] + [0, 1, 2]
        "  uneven_batches: rank 0: done; weights equal on all ranks: True\n"
        "  model_mismatch: rank 0: one step done with DDP\n"
        "  missing_rank: rank 0: all 2 ranks joined\n")


def test_split_cases_cuts_at_the_headers():
    lines = ["before", "== a", "x", "y", "== b", "== c", "z"]
    assert split_cases(lines) == {"a": ["x", "y"], "b": [], "c": ["z"]}


def test_diagnose_reads_the_signatures():
    from types import SimpleNamespace

    from ddp_lesson.labs.clinic import diagnose

    def res(rc, *errs):
        return SimpleNamespace(returncode=rc, errors=dict(enumerate(errs)))

    assert diagnose(res(0, "")) == "finished"
    # rank 0's store (sharing off) waiting for a client that never comes: the same verdict
    assert diagnose(res(1, "torch.distributed.DistStoreError: Timed out after 4 seconds "
                           "waiting for clients. 2/3 clients joined.")) == "a rank never joined"
    assert diagnose(res(1, "Timed out waiting 5000ms", "Connection closed by peer")) == "timeout"
    assert diagnose(res(1, "Connection closed by peer")) == "a peer crashed"
    assert diagnose(res(1, "boom")) == "other error"


def test_missing_rank_runs_on_torchruns_shared_store(monkeypatch):
    """No clinic case can restart, so the launcher gives every one torchrun's shared store
    (every rank a client) and missing_rank's error is the ranks' wait for the missing key on
    every run, with no variable of its own; a case's own extra variables still apply."""
    import ddp_lesson.launch
    from ddp_lesson.labs import clinic as clinic_pkg
    from ddp_lesson.launch import launch_env

    seen = {}
    monkeypatch.setattr(ddp_lesson.launch, "run_torchrun_many",
                        lambda jobs, label: seen.update(jobs) or {})
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    clinic_pkg.run_all({"m": ("missing_rank", ["--timeout", "3"]),
                        "p": ("partial_collective", [], {"X_CLINIC": "1"})})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch_env(
        seen["m"]["env"], None, 2, max_restarts=seen["m"].get("max_restarts", 0))
    assert seen["m"]["target"] == "ddp_lesson.labs.clinic.missing_rank"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in seen["p"]["env"]
    assert seen["p"]["env"]["X_CLINIC"] == "1"


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
    """rank -> pid of the live workers running ``module`` that this test's own launch started
    (read from /proc: Linux only). Only this process's descendants: a second suite on the
    same machine runs the same program at the same time (it was once sent the signal)."""
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
        if (b"ddp_lesson._worker" in cmd and module.encode() in cmd
                and descends_from(int(entry.name))):
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


@pytest.mark.slow
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
    assert "Timed out waiting 15000ms for" in dump  # and then the collective still timed out


def test_the_clinic_docstrings_state_gloos_default_timeout():
    """The clinic runs on gloo: its "default timeout" is gloo's 30 minutes, NCCL's is 10
    (torch.distributed.constants; issue 40: a statement true on one backend only says which)."""
    import importlib
    import re

    from torch.distributed import constants

    gloo_minutes = constants.default_pg_timeout.total_seconds() / 60
    assert gloo_minutes == 30
    for name in ("__init__", "missing_rank", "partial_collective", "uneven_batches"):
        mod = importlib.import_module("ddp_lesson.labs.clinic" + ("" if name == "__init__"
                                                                   else f".{name}"))
        doc = " ".join(mod.__doc__.split())
        assert re.search(r"\b30[ -]min", doc) and "gloo" in doc, name
        assert re.search(r"NCCL's:? 10\b|10 on NCCL", doc), name
        assert not re.search(r"\b10[ -]minute", doc), name
