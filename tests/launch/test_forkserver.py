"""The fork server (ddp_lesson.launch.forkserver): a forked torchrun agent is the agent a fresh
``python -m ddp_lesson.launch.agent`` would be -- the run's environment, log level, working
directory, process group -- and the server ends with the process that launched it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddp_lesson.launch import TorchrunInterrupted, TorchrunTimeout, forkserver, run_torchrun
from ddp_lesson.procs import alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

# Each rank reports on its parent, the torchrun agent: its command line, its parent, its group.
_AGENT_PROBE = textwrap.dedent("""\
    import json, os
    agent = os.getppid()
    cmd = open(f"/proc/{agent}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    ppid = int(open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()[1])
    umask = next(line.split()[1] for line in open("/proc/self/status")
                 if line.startswith("Umask:"))
    print(json.dumps({"cmd": cmd, "ppid": ppid, "pgid": os.getpgid(agent), "agent": agent,
                      "cwd": os.getcwd(), "x": os.environ.get("DDP_LESSON_TEST_X"),
                      "umask": umask}))
""")


def _probe(tmp_path, cwd="tmp_path", **env_extra) -> tuple[dict, dict]:
    result = run_torchrun(code=_AGENT_PROBE, nproc_per_node=1, timeout=90, live=False,
                          cwd=tmp_path if cwd == "tmp_path" else cwd,
                          env=dict(os.environ, **env_extra))
    return json.loads(result.outputs[0]), result


def test_an_agent_is_forked_from_this_process_server_with_the_run_environment(tmp_path):
    first, _ = _probe(tmp_path, DDP_LESSON_TEST_X="1")
    # a second run with another environment: the same server, the second run's variables
    second, _ = _probe(tmp_path, DDP_LESSON_TEST_X="2")
    server = forkserver._server
    assert server is not None and server.alive
    for seen, x in ((first, "1"), (second, "2")):
        assert "ddp_lesson.launch.forkserver" in seen["cmd"]  # forked, not a fresh Python
        assert seen["ppid"] == server.proc.pid != os.getpid()
        assert seen["pgid"] == seen["agent"]  # a group of its own: killpg(pid) reaches it all
        assert seen["x"] == x
        assert seen["cwd"] == str(tmp_path)


def test_the_switch_starts_a_fresh_agent(tmp_path):
    seen, _ = _probe(tmp_path, DDP_LESSON_FORKSERVER="0", DDP_LESSON_TEST_X="3")
    assert "-m ddp_lesson.launch.agent" in seen["cmd"]
    assert seen["ppid"] == os.getpid()
    assert seen["pgid"] == seen["agent"]
    assert seen["x"] == "3"


def test_loglevel_is_the_runs_as_in_a_fresh_agent(tmp_path):
    _probe(tmp_path)  # the server exists, made with this process's LOGLEVEL (none: WARNING)
    _, quiet = _probe(tmp_path)
    _, loud = _probe(tmp_path, LOGLEVEL="INFO")
    _, fresh = _probe(tmp_path, LOGLEVEL="INFO", DDP_LESSON_FORKSERVER="0")
    line = "Starting elastic_operator with launch configs"  # torchrun's INFO log (launcher/api.py)
    assert line not in quiet.launcher_stderr
    assert line in loud.launcher_stderr
    assert line in fresh.launcher_stderr


def test_a_variable_torch_reads_at_import_gets_a_fresh_agent(tmp_path):
    _probe(tmp_path)
    other = "ERROR" if os.environ.get("TORCH_CPP_LOG_LEVEL") != "ERROR" else "INFO"
    seen, _ = _probe(tmp_path, TORCH_CPP_LOG_LEVEL=other)
    assert "-m ddp_lesson.launch.agent" in seen["cmd"] and seen["ppid"] == os.getpid()


def test_a_killed_server_takes_its_agents_and_the_next_run_starts_another(tmp_path):
    worker = tmp_path / "sleeper.py"
    worker.write_text("import os, time\n"
                      "open(os.path.join(os.path.dirname(__file__), 'agent'), 'w')"
                      ".write(str(os.getppid()))\n"
                      "time.sleep(600)\n")
    _probe(tmp_path)
    server = forkserver._server
    outcome = {}

    def run():
        try:
            run_torchrun(str(worker), nproc_per_node=1, timeout=90, live=False)
        except Exception as exc:  # noqa: BLE001 -- the test reads it
            outcome["error"] = exc

    import threading
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "agent").exists() or not (tmp_path / "agent").read_text():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    agent = int((tmp_path / "agent").read_text())
    os.kill(server.proc.pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert not alive(agent)
    # the run failed: its agent was killed (SIGKILL, as PR_SET_PDEATHSIG sends)
    assert getattr(outcome.get("error"), "exitcode", None) == -signal.SIGKILL
    seen, _ = _probe(tmp_path)
    assert forkserver._server is not server and seen["ppid"] == forkserver._server.proc.pid


def test_the_server_ends_with_the_process_that_launched_it(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, sys\n"
        "from ddp_lesson.launch import forkserver, run_torchrun\n"
        "run_torchrun(code='print(1)', nproc_per_node=1, timeout=90, live=False)\n"
        "print(forkserver._server.proc.pid, flush=True)\n"
        "os._exit(0)\n")  # no clean-up of ours: as a SIGKILL leaves it
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                         timeout=90, check=True).stdout
    server = int(out.split()[-1])
    deadline = time.monotonic() + 15
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server)


def test_spawn_agent_refuses_what_it_does_not_fork():
    env = dict(os.environ)
    assert forkserver.spawn_agent(["torchrun", "x.py"], env, None, 1) is None
    cmd = [sys.executable, "-m", "ddp_lesson.launch.agent", "x.py"]
    assert forkserver.spawn_agent(cmd, dict(env, DDP_LESSON_FORKSERVER="0"), None, 1) is None


def test_a_server_that_cannot_start_leaves_fresh_agents_and_is_not_retried(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_server_command",
                        lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    seen, _ = _probe(tmp_path)
    assert "-m ddp_lesson.launch.agent" in seen["cmd"] and seen["ppid"] == os.getpid()
    dead = forkserver._server
    assert not dead.alive and dead.served == 0 and dead.proc.wait(10) == 3
    seen, _ = _probe(tmp_path)
    assert "-m ddp_lesson.launch.agent" in seen["cmd"]
    assert forkserver._server is dead  # not started again


def test_a_run_without_cwd_runs_where_the_launcher_is_now_with_its_umask(tmp_path, monkeypatch):
    _probe(tmp_path)  # the server exists, started where this process was then
    here = tmp_path / "later"
    here.mkdir()
    monkeypatch.chdir(here)
    old = os.umask(0o027)
    try:
        seen, _ = _probe(tmp_path, cwd=None)
    finally:
        os.umask(old)
    assert seen["ppid"] == forkserver._server.proc.pid
    assert seen["cwd"] == str(here)
    assert seen["umask"] == "0027"
    seen, _ = _probe(tmp_path, cwd=".")  # relative: to the launcher's folder, as Popen's
    assert seen["ppid"] == forkserver._server.proc.pid and seen["cwd"] == str(here)


def test_a_bad_request_fails_alone_and_the_server_serves_on(tmp_path):
    import pickle
    import socket

    _probe(tmp_path)
    server = forkserver._server
    # a request without the output's file descriptor: that request fails, nothing else
    socket.send_fds(server.sock, [pickle.dumps(("spawn", 10**6, [], {}, "/", None, None))], [])
    with server.cond:
        assert server.cond.wait_for(lambda: 10**6 in server.replies, 30)
        reply = server.replies.pop(10**6)
    assert reply[0] == "failed" and "expected 1 file descriptor, got 0" in reply[2]
    seen, _ = _probe(tmp_path)
    assert server.alive and forkserver._server is server and seen["ppid"] == server.proc.pid


# A stand-in server: it answers the first request with the end of an earlier agent that had the
# same pid, then with that pid for the new agent, and stays (as a real server would, the agent
# still running).
_REUSED_PID_SERVER = """\
import pickle, socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
req = pickle.loads(data)[1]
sock.send(pickle.dumps(("exit", 4194000, 7, 0.0)))
sock.send(pickle.dumps(("spawned", req, 4194000)))
time.sleep(60)
"""


def test_a_reused_pid_is_not_taken_for_the_earlier_agents_end(monkeypatch):
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_server_command",
                        lambda: [sys.executable, "-c", _REUSED_PID_SERVER])
    cmd = [sys.executable, "-m", "ddp_lesson.launch.agent", "x.py"]
    with open(os.devnull, "w") as out:
        agent = forkserver.spawn_agent(cmd, dict(os.environ), None, out.fileno())
    try:
        assert agent is not None and agent.pid == 4194000
        assert agent.poll() is None  # still running: exit code 7 was the earlier agent's
    finally:
        forkserver._server.proc.kill()
        forkserver._server.proc.wait(10)


# A stand-in server that takes its time: it answers the first request after DELAY seconds with
# a process group of its own making (a sleeping shell), as a slow server would fork an agent.
_SLOW_SERVER = """\
import os, pickle, socket, subprocess, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
req = pickle.loads(data)[1]
time.sleep({delay})
late = subprocess.Popen(["sleep", "600"], start_new_session=True)
open({record!r}, "w").write(str(late.pid))
sock.send(pickle.dumps(("spawned", req, late.pid)))
while True:
    time.sleep(0.2)
    late.poll()  # reaps it once killed
"""


def _slow_server(monkeypatch, tmp_path, delay: float) -> Path:
    record = tmp_path / "late.pid"
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_server_command", lambda: [
        sys.executable, "-c", _SLOW_SERVER.format(delay=delay, record=str(record))])
    return record


def _late_agent_killed(record: Path) -> bool:
    """Wait (bounded) for the stand-in's late answer, then for its process to be killed."""
    deadline = time.monotonic() + 30
    while not (record.exists() and record.read_text()):
        assert time.monotonic() < deadline, "the stand-in never answered"
        time.sleep(0.1)
    late = int(record.read_text())
    while alive(late) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(late)


def _stop_stand_in():
    forkserver._server.proc.kill()
    forkserver._server.proc.wait(10)


def test_a_run_that_times_out_while_the_server_starts_ends_and_its_late_agent_is_killed(
        tmp_path, monkeypatch):
    record = _slow_server(monkeypatch, tmp_path, delay=8)
    try:
        with pytest.raises(TorchrunTimeout):
            run_torchrun(code="print(1)", nproc_per_node=1, timeout=1, live=False)
        assert not record.exists()  # it did not wait for the server's answer
        assert not forkserver._server.retired  # a slow start is not the server's fault
        assert _late_agent_killed(record)  # the agent forked for nobody, when it came
    finally:
        _stop_stand_in()


def test_a_cancelled_run_gives_up_its_request(tmp_path, monkeypatch):
    import threading

    _slow_server(monkeypatch, tmp_path, delay=30)
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    start = time.monotonic()
    try:
        with pytest.raises(TorchrunInterrupted):
            run_torchrun(code="print(1)", nproc_per_node=1, timeout=60, live=False,
                         _cancel=cancel)
        assert time.monotonic() - start < 20
    finally:
        _stop_stand_in()


def test_a_server_too_slow_to_answer_is_retired_and_the_run_gets_a_fresh_agent(
        tmp_path, monkeypatch):
    record = _slow_server(monkeypatch, tmp_path, delay=5)
    monkeypatch.setattr(forkserver, "_SPAWN_TIMEOUT_S", 1.0)
    try:
        result = run_torchrun(code="print('fresh')", nproc_per_node=1, timeout=90, live=False)
        assert result.stdout == "[rank 0] fresh\n"
        assert forkserver._server.retired  # no more requests for it
        assert _late_agent_killed(record)
    finally:
        _stop_stand_in()
