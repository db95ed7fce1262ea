"""The launcher behaves as plain torchrun would, and leaves nothing behind.

Several checks share one launch where they share a world size: every launch costs seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddp_lesson.launch import TorchrunError, run_torchrun, terminal_text
from ddp_lesson.launch.output import (
    CONSEQUENCE_NS,
    collect_outputs,
    first_failures,
    read_failed_ranks,
)

pytestmark = pytest.mark.timeout(180)

# Rank 0 lists the listening TCP sockets of every torchrun agent of the run (the pids the launcher
# recorded in the run's folder, named on rank 0's command line) and of every worker
# (/proc/net/tcp and tcp6, matched to the processes' socket descriptors).
LISTENING = r'''
import os, socket

def listening(pids, agents):
    inodes = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes[link[8:-1]] = pid
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(parts[1].split(":")[0])
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                who = "agent" if inodes[parts[9]] in agents else "rank"
                found.add(f"{who} {socket.inet_ntop(family, raw)}")
    return sorted(found)
'''

ONE_RUN = LISTENING + r'''
import json, sys, warnings
import torch.distributed as dist
from tqdm import tqdm
from ddp_lesson.env import init_distributed, cleanup

env = init_distributed(timeout=30)
for _ in tqdm(range(40), file=sys.stdout, mininterval=0, ascii=True):
    pass
print("done")
warnings.warn("a warning names the cell, not a temporary path")
dist.barrier()
if env.rank == 0:
    argv = open("/proc/self/cmdline", "rb").read().split(b"\0")
    outdir = argv[argv.index(b"ddp_lesson._worker") + 1].decode()
    agents = [int(p) for p in open(os.path.join(outdir, "agents.pid")).read().split()]
    ranks = [int(p) for a in agents for p in open(f"/proc/{a}/task/{a}/children").read().split()]
    print(json.dumps(listening([*agents, *ranks], agents)), file=sys.stderr)
dist.barrier()
cleanup()
'''


@pytest.mark.slow
@pytest.mark.parametrize("nnodes", [1, 2])
def test_progress_bars_stderr_names_temp_folder_and_sockets(tmp_path, monkeypatch, nnodes):
    """Progress bars, stderr, the temporary folder and the listening sockets, on one launch each
    for 1 node x 2 and 2 simulated nodes x 1."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # the launcher's own folder
    env = {**os.environ, "TMPDIR": str(private_tmp)}           # torchrun's and the ranks'
    result = run_torchrun(code=ONE_RUN, nproc_per_node=2 // nnodes, nnodes=nnodes, timeout=120,
                          live=False, backend="gloo", env=env)
    # 5: a tqdm bar of 40 steps then "done": 2 lines per rank, the bar in its final state
    for rank in (0, 1):
        lines = result.rank_lines(rank)
        assert len(lines) == 2 and lines[1] == "done"
        assert lines[0].startswith("100%|##########| 40/40 [")
    # 9: a warning names "<torchrun cell>", never the run's temporary script path
    warn = 'warnings.warn("a warning names the cell, not a temporary path")'
    line = 1 + ONE_RUN.splitlines().index(warn)
    for rank in (0, 1):
        assert result.errors[rank].splitlines()[0] == (
            f"<torchrun cell>:{line}: UserWarning: a warning names the cell, not a temporary path")
    # 10: nothing left in $TMPDIR (torchrun's torchelastic_* folder was in the run's folder) but
    # the standard fork server's folder if this launch started it (one per launching process)
    left = os.listdir(private_tmp)
    assert len(left) <= 1 and all(n.startswith("pymp-") for n in left), left
    # 11: the workers' store (node 0's agent hosts it: a run that cannot restart shares it) and
    # gloo listen on loopback only; the agents' rendezvous store is hosted by the launcher, on
    # 127.0.0.1 too
    sockets = json.loads(result.errors[0].splitlines()[-1])
    assert sockets == ["agent 127.0.0.1", "rank 127.0.0.1"]


def test_terminal_text_keeps_what_a_terminal_shows():
    assert terminal_text("a\rbb\rc\n") == "cb\n"  # a shorter write leaves the tail
    assert terminal_text("x\r\n") == "x\n"       # a Windows line end is one line end
    assert terminal_text("\r 50%\r100%\ndone\n") == "100%\ndone\n"


# Rank 2 fails first. torchrun then sends SIGTERM to ranks 0 and 1: rank 1's handler turns it
# into an error of its own (recorded after rank 2's), rank 0 dies of it (a SIGTERM from
# torchrun is not a failure of its own). Deterministic whichever rank is lowest.
FAIL_IN_TURN = r'''
import os, signal, time
rank = int(os.environ["RANK"])
if rank == 1:
    def stop(signum, frame):
        raise ValueError("rank 1 stopped by torchrun")
    signal.signal(signal.SIGTERM, stop)
if rank == 2:
    raise ValueError("bad batch on rank 2")
time.sleep(60)
'''


@pytest.mark.slow
def test_the_first_failing_rank_is_named_and_later_ones_listed_as_consequences():
    with pytest.raises(TorchrunError) as info:
        run_torchrun(code=FAIL_IN_TURN, nproc_per_node=3, timeout=120, live=False)
    err = info.value
    assert (err.rank, err.consequences, err.result.failed_rank) == (2, [1], 2)
    assert err.result.failed_ranks == [1, 2]
    assert str(err) == ("rank 2 of 3 failed first (exit code 1): ValueError: bad batch on rank 2; "
                        "rank 1 failed after it (exit code 1)")
    assert err.traceback.splitlines()[-1] == "ValueError: bad batch on rank 2"
    shown = err._render_traceback_()
    assert shown[-1] == ("rank 1 failed after rank 2, as a consequence: "
                         "ValueError: rank 1 stopped by torchrun")


# Issue 41 item 9: rank 1 raises mid-step while its peers wait in an all_reduce; they fail
# with gloo's "Connection closed by peer" once rank 1's process has ended. Their SIGTERM
# handler does nothing, so torchrun's SIGTERM (sent once rank 1 has exited) cannot end them
# before the all_reduce fails: every peer's failure is a recorded consequence.
PEER_WAITS = r'''
import signal, torch, torch.distributed as dist
from ddp_lesson.env import init_distributed
env = init_distributed(timeout=60)
signal.signal(signal.SIGTERM, lambda signum, frame: None)
x = torch.ones(4, 3)
if env.rank == 1:
    x = x @ torch.ones(5, 2)     # the bug: a shape error on one rank, mid-step
dist.all_reduce(x)               # the others wait here for rank 1
'''


def shape_error() -> str:
    """The message of the rank's bug in this torch's words (2.15 prefixes "mm: ")."""
    import torch

    with pytest.raises(RuntimeError) as info:
        torch.ones(4, 3) @ torch.ones(5, 2)
    return str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_peer_waiting_in_a_collective_is_a_consequence_not_the_cause(nproc):
    with pytest.raises(TorchrunError) as info:
        run_torchrun(code=PEER_WAITS, nproc_per_node=nproc, timeout=120, live=False,
                     backend="gloo")
    err = info.value
    others = [r for r in range(nproc) if r != 1]
    assert (err.rank, err.consequences, err.result.failed_rank) == (1, others, 1)
    assert err.result.failed_ranks == list(range(nproc))
    cause = f"RuntimeError: {shape_error()}"
    assert err.traceback.splitlines()[-1] == cause
    assert "[rank1]" not in err.traceback  # torch's excepthook prefix is taken off
    assert str(err).startswith(f"rank 1 of {nproc} failed first (exit code 1): {cause}; ")
    assert "Connection closed by peer" in err.result.errors[0]
    assert "Connection closed by peer" not in err.traceback


def test_the_failure_order_comes_from_the_records_signals_first():
    # recorded failures by time (ties by rank); a rank that died of a signal has no record
    assert first_failures([0, 1, 2], {0: 30, 1: 10, 2: 20}) == [1, 2, 0]
    assert first_failures([0, 1], {0: 5, 1: 5}) == [0, 1]
    assert first_failures([0, 1, 3], {0: 1, 1: 2}) == [3, 0, 1]


def test_the_error_names_the_cause_and_never_orders_ranks_without_a_time():
    from types import SimpleNamespace

    from ddp_lesson.launch.output import TorchrunResult
    from ddp_lesson.launch.supervise import _failure

    def error(exits, times, summary=""):
        result = TorchrunResult(1, {}, {r: f"E{r}: on rank {r}\n" for r in range(4)}, summary,
                                [], "", "gloo", "")
        return _failure(SimpleNamespace(script=None, total=4), result, exits, times)

    err = error({0: 1, 2: 1, 3: 1}, {0: 30, 2: 10, 3: 20})
    assert (err.rank, err.consequences, err.result.failed_ranks) == (2, [0, 3], [0, 2, 3])
    assert str(err) == ("rank 2 of 4 failed first (exit code 1): E2: on rank 2; ranks 0, 3 "
                        "failed after it (exit codes 1, 1)")
    # two ranks killed by signals (torchrun's summary only): both causes, in rank order; the
    # recorded failure comes after them
    summary = ("rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)\n"
               "rank      : 3 (local_rank: 3)\n  exitcode  : -11 (pid: 8)\n")
    err = error({0: 1}, {0: 5}, summary)
    assert (err.rank, err.consequences) == (1, [0])
    assert str(err) == ("ranks 1, 3 of 4 failed first (exit codes -9, -11): E1: on rank 1; "
                        "rank 0 failed after them (exit code 1)")


def test_the_records_give_exit_code_and_time(tmp_path):
    (tmp_path / "rank0.exit").write_text("3 1700000000123456789")
    (tmp_path / "rank1.exit").write_text("1")        # an older record: no time
    (tmp_path / "rank2.exit").write_text("")         # cut short: code 1
    # an exception that passes on a peer's failure (Rank0Error), recorded a moment earlier
    (tmp_path / "rank3.exit").write_text("1 1700000000000000000 consequence")
    _, _, exits, times = collect_outputs(tmp_path)
    assert exits == {0: 3, 1: 1, 2: 1, 3: 1}
    assert times == {0: 1700000000123456789, 3: 1700000000000000000 + CONSEQUENCE_NS}
    assert first_failures([0, 3], times) == [0, 3]


def test_failing_ranks_from_records_and_torchrun_summary():
    summary = ("Failures:\n[1]:\n  time : x\n  host : h\n  rank      : 3 (local_rank: 3)\n"
               "  exitcode  : -9 (pid: 9)\n"
               "[2]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 8)\n"
               "Root Cause (first observed failure):\n[0]:\n"
               "  rank      : 2 (local_rank: 2)\n  exitcode  : 1 (pid: 7)\n")
    # recorded failures in any order come back in rank order; a rank killed by a signal of
    # its own (-9) is added, one ended by torchrun (SIGTERM, -15) is not
    assert read_failed_ranks(summary, {}, {2: 1, 1: 3}) == [(1, 3), (2, 1), (3, -9)]
    traceback = {2: "Traceback (most recent call last):\nE\n"}
    assert read_failed_ranks(summary, traceback, {}) == [(2, 1)]


# Everything Python does at a normal exit; the cell prints what it saw.
AT_EXIT = r"""
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

out = sys.argv[1]
atexit.register(print, "last words, no newline", end="")  # atexit runs last-in first-out
MARK = "the script's module"
atexit.register(lambda: print("atexit handler ran in", sys.modules["__main__"].MARK,
                              "| __file__ kept:", "__file__" in vars(sys.modules["__main__"])))
def late():  # one write per line: two threads' print()s can interleave text and newline
    time.sleep(0.5)
    sys.stdout.write("non-daemon thread finished\n")
threading.Thread(target=late).start()
ThreadPoolExecutor(1).submit(lambda: (time.sleep(0.5),
                                      sys.stdout.write("executor job finished\n")))
unclosed = open(os.path.join(out, "unclosed.txt"), "w")
unclosed.write("written, never closed")
here = os.path.dirname(os.path.abspath(__file__))
print("sys.path[0] is the script folder:", sys.path[0] == here)
print("cwd on sys.path:", os.getcwd() in sys.path)
"""


@pytest.mark.slow
def test_cell_program_ends_as_under_plain_torchrun(tmp_path):
    """The same script under plain torchrun and under the launcher, line for line.

    Threads joined and executors' queued work done before atexit handlers, handlers run,
    ``__main__`` still the script's module (without ``__file__``: CPython removes it once the
    script returns), a last partial line and an unclosed file flushed,
    ``sys.path[0]`` the script's folder. (Left out on purpose: ``__del__`` of objects alive at
    exit, which Python does not promise; see ``ddp_lesson._worker``.)
    """
    script = tmp_path / "prog" / "at_exit.py"
    script.parent.mkdir()
    script.write_text(AT_EXIT)
    runs = {"plain": tmp_path / "plain", "cell": tmp_path / "cell"}
    for folder in runs.values():
        folder.mkdir()
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "1", str(script), str(runs["plain"])],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    cell = run_torchrun(code=AT_EXIT, args=[str(runs["cell"])], nproc_per_node=1, timeout=120,
                        live=False, cwd=tmp_path)
    for seen in (plain.stdout.splitlines(), cell.rank_lines(0)):
        assert seen[:2] == ["sys.path[0] is the script folder: True", "cwd on sys.path: False"]
        assert sorted(seen[2:4]) == ["executor job finished", "non-daemon thread finished"]
        assert seen[4:] == ["atexit handler ran in the script's module | __file__ kept: False",
                            "last words, no newline"]
    for folder in runs.values():
        assert (folder / "unclosed.txt").read_text() == "written, never closed"


@pytest.mark.slow
def test_a_cell_that_prints_warns_and_prints_replays_five_times(tmp_path):
    """nbval never compares stderr (notebooks/conftest.py), whose text varies."""
    import shutil

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    repo = Path(__file__).resolve().parents[2]
    cell = new_code_cell("import warnings\nprint('before')\nwarnings.warn('careful')\n"
                         "print('after')")
    cell.execution_count = 1
    cell.outputs = [new_output("stream", name="stdout", text="before\n"),
                    new_output("stream", name="stderr",
                               text="/tmp/ipykernel_1/2.py:3: UserWarning: careful\n"),
                    new_output("stream", name="stdout", text="after\n")]
    nb = new_notebook(cells=[cell], metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    for i in range(5):
        nbformat.write(nb, tmp_path / f"replay_{i}.ipynb")
    shutil.copy(repo / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval", "--nbval-current-env", "--rootdir", str(tmp_path),
                           "--confcutdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("5 passed")
    # and without the hook the same notebook fails: the check is real
    (tmp_path / "conftest.py").unlink()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval", "--nbval-current-env", "--rootdir", str(tmp_path),
                           str(tmp_path / "replay_0.ipynb")],
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 1 and "1 failed" in proc.stdout


# ----------------------------------------------------------- what a reader sees

def test_status_reads_as_text_and_shows_progress_not_warnings(tmp_path):
    from ddp_lesson.launch import launcher_backend, status_text
    from ddp_lesson.launch.output import progress_line

    # the stored text form is a plain line, not Label(value=...)
    assert status_text(2) == "torchrun: 2 processes"
    assert status_text(1) == "torchrun: 1 process"
    # rank 0's last stdout line, never a warning's source line from stderr ...
    (tmp_path / "rank0.out").write_text("epoch 1 step 3/10\n")
    (tmp_path / "rank0.err").write_text(
        "lab.py:7: UserWarning: slow\n  worst = torch.tensor(max(float(x) for x in v))\n")
    assert progress_line(tmp_path) == "epoch 1 step 3/10"
    # ... but a progress bar being redrawn on stderr is progress
    (tmp_path / "rank0.err").write_text("\r 10%|#         | 1/10\r 20%|##        | 2/10")
    assert progress_line(tmp_path) == "20%|##        | 2/10"
    # 2 simulated nodes x 1 process are 2 processes on this host
    assert launcher_backend(1, 2, "gloo")[1] == "2 processes, gloo requested: using gloo on CPU"


def test_interrupt_reads_as_one_line_and_lines_fit_100_characters():
    from ddp_lesson.launch import TorchrunInterrupted, format_rank_outputs

    err = TorchrunInterrupted()
    assert isinstance(err, KeyboardInterrupt)
    assert err._render_traceback_() == [
        "KeyboardInterrupt: torchrun interrupted: every process it started was ended"]
    # a line longer than 100 characters with its [rank N] prefix: broken at a space, continued
    # indented without a second prefix (it reads as one print), and joined back exactly
    from ddp_lesson.launch.output import join_continuations

    message = "word " * 19 + "last"  # 99 characters
    text = format_rank_outputs({0: message + "\n", 10: "  " + message + "\n"})
    out = text.splitlines()
    assert max(len(line) for line in out) <= 100
    assert out[:2] == ["[rank 0] " + "word " * 17 + "word", "         word last"]
    assert out[2:] == ["[rank 10]   " + "word " * 16 + "word", "          word word last"]
    assert join_continuations(text) == ["[rank 0] " + message, "[rank 10]   " + message]
    # double spaces at the break survive the round trip
    two = "a" * 85 + "  b" * 10
    assert join_continuations(format_rank_outputs({3: two + "\n"})) == ["[rank 3] " + two]


def _run_in_kernel(client, code: str, timeout: float = 120, during=None):
    """Execute ``code``; return ``(mine, statuses)``: the iopub messages that answer it, up to
    its idle status, and every status message seen meanwhile as ``(state, parent msg_type)``.
    ``during`` is called once, at the first display_data (the run's status line)."""
    import time

    msg_id = client.execute(code)
    messages, statuses, deadline = [], [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["msg_type"] == "status":
            statuses.append((msg["content"]["execution_state"],
                             msg["parent_header"].get("msg_type")))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "display_data" and during is not None:
            during()
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages, statuses
    raise AssertionError(f"no idle status within {timeout} s")


def _subshell_probe(client) -> None:
    """What JupyterLab sends on the control channel when it connects to a kernel: create a
    subshell, then delete it (ipykernel answers each with busy/idle on IOPub)."""
    import time

    subshell = None
    for kind in ("create_subshell_request", "delete_subshell_request"):
        content = {} if subshell is None else {"subshell_id": subshell}
        client.control_channel.send(client.session.msg(kind, content))
        reply = client.control_channel.get_msg(timeout=30)["content"]
        assert reply["status"] == "ok", reply
        subshell = reply.get("subshell_id", subshell)
    time.sleep(0.5)


@pytest.mark.slow
def test_in_a_kernel_busy_throughout_text_status_and_one_line_interrupt(tmp_path):
    """The status line, the busy kernel and the interrupt in a real IPython kernel; and
    ``--show-stderr`` names the cell."""
    import time

    from jupyter_client import KernelManager

    # over Unix sockets: no TCP port another process could take before the kernel binds it
    km = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        _run_in_kernel(kc, "%load_ext ddp_lesson")
        # the cell also warns, shown by --show-stderr (named as the cell, after the output)
        msgs, statuses = _run_in_kernel(
            kc, "%%torchrun --nproc-per-node 1 --timeout 90 --backend gloo --quiet --show-stderr\n"
                "import time, warnings\nwarnings.warn('look')\ntime.sleep(4)\nprint('slept')\n",
            during=lambda: _subshell_probe(kc))
        # the control channel's idle for the probe is followed at once by busy for the
        # running cell, so the last status a page sees before the cell's own idle is busy
        foreign = [i for i, (state, kind) in enumerate(statuses)
                   if kind.endswith("subshell_request") and state == "idle"]
        assert len(foreign) == 2, statuses
        for i in foreign:
            assert statuses[i + 1] == ("busy", "execute_request"), statuses
        assert statuses[-1] == ("idle", "execute_request")
        assert [s for s, k in statuses if k == "execute_request"].count("idle") == 1
        # a plain-text line (no widget, no comm), updated in place while the run
        # lasts, first and last the constant text that a stored notebook holds
        assert not [m for m in msgs if m["msg_type"].startswith("comm")]
        shown = [m for m in msgs if m["msg_type"] in ("display_data", "update_display_data")]
        assert [m["msg_type"] for m in shown[:1]] == ["display_data"]
        assert {m["content"]["transient"]["display_id"] for m in shown} == {
            shown[0]["content"]["transient"]["display_id"]}
        texts = [m["content"]["data"] for m in shown]
        assert texts[0] == texts[-1] == {"text/plain": "torchrun: 1 process"}
        assert any(t["text/plain"].startswith("torchrun: 1 process, at ") for t in texts[1:-1])
        # (stdout and stderr are flushed on separate timers: their order is not compared)
        streams = {}
        for m in msgs:
            if m["msg_type"] == "stream":
                streams.setdefault(m["content"]["name"], []).append(m["content"]["text"])
        assert set(streams) == {"stdout", "stderr"}
        assert streams["stdout"] == ["[rank 0] slept\n"]
        assert "".join(streams["stderr"]).splitlines()[0] == (
            "[rank 0] <torchrun cell>:2: UserWarning: look")
        # an interrupt reads as one line, and the status line says so
        msgs, _ = _run_in_kernel(kc, "%%torchrun --nproc-per-node 1 --quiet\n"
                                     "import time\ntime.sleep(120)\n",
                                 during=lambda: (time.sleep(3), km.interrupt_kernel()))
        errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
        assert [e["ename"] for e in errors] == ["TorchrunInterrupted"]
        assert errors[0]["traceback"] == [
            "KeyboardInterrupt: torchrun interrupted: every process it started was ended"]
        last = [m for m in msgs if m["msg_type"] == "update_display_data"][-1]
        assert last["content"]["data"] == {
            "text/plain": "torchrun: interrupted; every process ended"}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
