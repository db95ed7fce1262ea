"""The fork server (ddp_lesson.launch.forkserver, the standard library's): a forked torchrun agent
is the agent a fresh ``python -m ddp_lesson.launch.agent`` would be -- the run's environment, log
level, working directory, umask, process group -- the launcher's script is not run again in it,
and the server ends with the process that launched it."""
from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ddp_lesson.launch import forkserver, run_torchrun
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


def _server_pid() -> int:
    return multiprocessing.forkserver._forkserver._forkserver_pid


def test_an_agent_is_forked_from_this_process_server_with_the_run_environment(tmp_path):
    first, _ = _probe(tmp_path, DDP_LESSON_TEST_X="1")
    # a second run with another environment: the same server, the second run's variables
    second, _ = _probe(tmp_path, DDP_LESSON_TEST_X="2")
    for seen, x in ((first, "1"), (second, "2")):
        assert "multiprocessing.forkserver" in seen["cmd"]  # forked, not a fresh Python
        assert seen["ppid"] == _server_pid() != os.getpid()
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
    server = _server_pid()
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
    os.kill(server, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert not alive(agent)
    # the run failed: its agent was killed (PR_SET_PDEATHSIG), and with the server gone its
    # status is unknown: 255 (multiprocessing/popen_forkserver.py, Popen.poll)
    assert getattr(outcome.get("error"), "exitcode", None) == 255
    seen, _ = _probe(tmp_path)
    assert _server_pid() != server and seen["ppid"] == _server_pid()


def test_the_launchers_script_is_not_run_again_and_the_server_ends_with_it(tmp_path):
    driver = tmp_path / "driver.py"  # launches at its top level, no __main__ guard
    driver.write_text(
        "import multiprocessing.forkserver as fs, os\n"
        "from ddp_lesson.launch import run_torchrun\n"
        "import multiprocessing.spawn as sp\n"  # importing the launcher patches nothing yet
        "print('stdlib', sp.get_preparation_data.__module__ == 'multiprocessing.spawn')\n"
        "print('driver ran', flush=True)\n"
        "r = run_torchrun(code='print(1)', nproc_per_node=1, timeout=90, live=False)\n"
        "print(r.rank_lines(0), fs._forkserver._forkserver_pid, flush=True)\n"
        "os._exit(0)\n")  # no clean-up of ours: as a SIGKILL leaves it
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                         timeout=90, check=True).stdout
    assert out.count("driver ran") == 1 and "['1']" in out and "stdlib True" in out
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
    assert forkserver.spawn_agent(cmd, env, None, 1, ready=lambda: False) is None


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
    assert seen["ppid"] == _server_pid()
    assert seen["cwd"] == str(here)
    assert seen["umask"] == "0027"
    seen, _ = _probe(tmp_path, cwd=".")  # relative: to the launcher's folder, as Popen's
    assert seen["ppid"] == _server_pid() and seen["cwd"] == str(here)


def test_the_agents_cpu_is_counted_once_they_end(tmp_path):
    before = forkserver.agents_cpu_s()
    _probe(tmp_path)
    assert forkserver.agents_cpu_s() > before
