"""The launcher's contract (design.md, "The torchrun cell contract"), on real torchrun runs."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddp_lesson.launch import (
    TorchrunError,
    TorchrunTimeout,
    format_rank_outputs,
    run_torchrun,
    run_torchrun_many,
    split_magic_line,
    torchrun_command,
    torchrun_magic,
)
from ddp_lesson.procs import alive

pytestmark = pytest.mark.timeout(120)

_alive = alive  # a zombie is not alive


def _wait_dead(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.slow
def test_outputs_come_back_in_rank_order_whatever_the_finishing_order():
    # rank 0 prints last; the result is still grouped rank 0, 1, 2
    code = textwrap.dedent("""
        import os, time
        rank = int(os.environ["RANK"])
        time.sleep(0.3 * (2 - rank))
        print(f"hello from {rank}")
        print(f"second line {rank}")
    """)
    result = run_torchrun(code=code, nproc_per_node=3, timeout=90, live=False)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        "[rank 0] hello from 0", "[rank 0] second line 0",
        "[rank 1] hello from 1", "[rank 1] second line 1",
        "[rank 2] hello from 2", "[rank 2] second line 2",
    ]
    assert result.rank_lines(2) == ["hello from 2", "second line 2"]


ARGS_LINE = "['--epochs', '1', '--out', 'a b']"  # what args="--epochs 1 --out 'a b'" gives


@pytest.fixture(scope="module")
def gloo_pair():
    """One launch, two checks: 2 ranks with backend="gloo" and OMP_NUM_THREADS=2 set, whose
    program arguments are given as one string. Each rank prints its backend line, then argv."""
    code = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        from ddp_lesson.env import init_distributed, cleanup
        env = init_distributed(timeout=30)
        t = torch.tensor([env.rank + 1])
        dist.all_reduce(t)
        print(env.backend, os.environ.get("DDP_LESSON_BACKEND"), os.environ["OMP_NUM_THREADS"],
              int(t))
        print(sys.argv[1:])
        cleanup()
    """)
    return run_torchrun(code=code, args="--epochs 1 --out 'a b'", nproc_per_node=2, timeout=90,
                        live=False, backend="gloo", env={**os.environ, "OMP_NUM_THREADS": "2"})


@pytest.mark.slow
def test_workers_get_backend_threads_and_a_real_process_group(gloo_pair):
    result = gloo_pair
    # an explicit backend reaches every rank; the user's OMP_NUM_THREADS is kept; 1 + 2 = 3
    # (then each rank's argv: test_error_message_carries_the_cause_and_args_may_be_a_string)
    assert result.rank_lines(0) == ["gloo gloo 2 3", ARGS_LINE]
    assert result.rank_lines(1) == ["gloo gloo 2 3", ARGS_LINE]
    assert result.backend == "gloo"


@pytest.mark.slow
def test_omp_banner_silenced_and_threads_set_when_unset():
    # and every rank uses the backend the launcher chose and printed, with its reason; the
    # request comes from the run's own environment (env=), not from this process's
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["DDP_LESSON_BACKEND"] = "gloo"
    code = ("import os; from ddp_lesson.env import read_env; e = read_env()\n"
            "print(os.environ['OMP_NUM_THREADS']); print(e.backend, '|', e.reason)\n")
    result = run_torchrun(code=code, nproc_per_node=2, timeout=90, live=False, env=env)
    expected = str(max(1, (os.cpu_count() or 1) // 2))
    chosen = "gloo | 2 processes, gloo requested: using gloo on CPU"
    assert (result.backend, result.backend_reason) == tuple(chosen.split(" | "))
    assert result.rank_lines(0) == [expected, chosen] and result.rank_lines(1) == [expected, chosen]
    assert "OMP_NUM_THREADS" not in result.launcher_stderr  # no starred banner (cases C5)


@pytest.mark.slow
def test_failing_rank_raises_with_its_traceback():
    code = textwrap.dedent("""
        import os
        rank = int(os.environ["RANK"])
        print("before", rank)
        def load_batch():
            raise ValueError(f"bad batch on rank {rank}")
        if rank == 2:
            load_batch()
    """)
    with pytest.raises(TorchrunError) as info:
        run_torchrun(code=code, nproc_per_node=3, timeout=90, live=False)
    err = info.value
    assert err.rank == 2
    assert err.exitcode == 1
    assert "rank 2 of 3 failed" in str(err)
    assert err.traceback.splitlines()[-1] == "ValueError: bad batch on rank 2"
    assert 'File "<torchrun cell>"' in err.traceback
    assert "_worker.py" not in err.traceback and "runpy" not in err.traceback
    assert err.result.rank_lines(2) == ["before 2"]


@pytest.fixture(scope="module")
def jobs_at_once():
    """Three 2-rank jobs started at once (run_torchrun_many): "slow" sleeps 3 s, "fast" none,
    "fails" exits 3 on both ranks with check=False. Each rank prints its job's MASTER_PORT.

    The barrier after init: torch 2.13's init_process_group ends without one
    (TORCH_DIST_INIT_BARRIER defaults to 0), so without a collective rank 1 could finish its
    side of gloo's connectFullMesh, exit, and close the socket while a starved rank 0 was still
    reading it: "Connection closed by peer [127.0.0.1]:6852" in one loaded fresh-clone run
    (gloo prints sin_port unconverted: 6852 is port 50202)."""
    code = textwrap.dedent("""
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()  # every rank's connections are up before any rank can leave
        time.sleep(float(sys.argv[1]))
        print(os.environ["MASTER_PORT"])
        dist.destroy_process_group()
        sys.exit(int(sys.argv[2]))
    """)
    script = {"code": code, "nproc_per_node": 2, "timeout": 90}
    return run_torchrun_many({"slow": dict(script, args=["3", "0"]),
                              "fast": dict(script, args=["0", "0"]),
                              "fails": dict(script, args=["0", "3"], check=False)},
                             live=False)


@pytest.mark.slow
def test_check_false_returns_the_failure_instead(jobs_at_once):
    # the "fails" job: every rank exits 3, and run_torchrun(check=False) returned its result
    # (with check=True it would have raised, and run_torchrun_many with it)
    result = jobs_at_once["fails"]
    assert result.returncode != 0
    assert result.failed_rank in (0, 1)


@pytest.mark.slow
def test_timeout_ends_every_process(tmp_path):
    code = textwrap.dedent(f"""
        import os, time
        pid_file = os.path.join({str(tmp_path)!r}, "pid" + os.environ["RANK"])
        open(pid_file, "w").write(str(os.getpid()))
        time.sleep(600)
    """)
    start = time.monotonic()
    # 15 s, not less: on 2 loaded cores torchrun and both workers took over 8 s to start once
    # (no pid file yet when the timeout ended the run)
    with pytest.raises(TorchrunTimeout) as info:
        run_torchrun(code=code, nproc_per_node=2, timeout=15, live=False)
    # the timeout ended it, not the workers' 600 s sleep (no speed is asserted: the agents get
    # torchrun's own grace to end their workers, longer on a loaded machine)
    assert time.monotonic() - start < 200
    assert isinstance(info.value, subprocess.TimeoutExpired)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert _wait_dead(pids) == []


@pytest.mark.slow
def test_a_ranks_sigterm_handler_gets_torchruns_grace(tmp_path):
    """A rank that saves for 8 s on SIGTERM (a preemption checkpoint) finishes when the run is
    ended (an interrupt here; a timeout takes the same path), as under plain torchrun, whose
    agent waits 30 s before SIGKILL (pytorch/pytorch#119856)."""
    worker = textwrap.dedent(f"""
        import os, signal, sys, time
        folder = {str(tmp_path)!r}
        def save(signum, frame):
            time.sleep(8)
            open(os.path.join(folder, "saved" + os.environ["RANK"]), "w").write("ok")
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
        open(os.path.join(folder, "ready" + os.environ["RANK"]), "w").write("ok")
        time.sleep(600)
    """)
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from ddp_lesson.launch import run_torchrun\n"
        "try:\n"
        f"    run_torchrun(code={worker!r}, nproc_per_node=2, timeout=300, live=False)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "workers did not start"
        assert proc.poll() is None, "driver died early"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("saved")) == [
        "saved0", "saved1"]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the parent tree (children, their children, ...)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _interrupt_script(tmp_path: Path, signum: int, many: bool = False
                      ) -> tuple[list[int], int, str]:
    """Start run_torchrun in a separate Python, wait until both workers run and each started
    a process of its own (``sleep``), send ``signum``. Returns every descendant seen before.
    ``many``: two one-process jobs at once through run_torchrun_many instead."""
    driver = tmp_path / "driver.py"
    worker = (f"import os, subprocess, time\n"
              f"child = subprocess.Popen(['sleep', '600'])\n"
              f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ.get('JOB', "
              f"os.environ['RANK'])), 'w')"
              f".write(f'{{os.getpid()}} {{child.pid}}')\n"
              f"time.sleep(600)\n")
    driver.write_text(
        "import signal, sys\n"
        # A notebook kernel handles SIGINT (the interrupt button). Install Python's handler
        # explicitly: a shell that starts this suite in the background (as CI may) leaves
        # SIGINT ignored, and children inherit that.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import os\n"
        "from ddp_lesson.launch import run_torchrun, run_torchrun_many\n"
        "try:\n"
        + (f"    run_torchrun_many({{j: dict(code={worker!r}, nproc_per_node=1, timeout=300, "
           "env=dict(os.environ, JOB=j)) for j in '01'}, live=False)\n" if many else
           f"    run_torchrun(code={worker!r}, nproc_per_node=2, timeout=300, live=False)\n") +
        "except KeyboardInterrupt as e:\n"
        "    print('interrupted', *e._render_traceback_(), flush=True)\n"
        "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text()
                  for r in (0, 1)):
        assert time.monotonic() < deadline, "workers did not start"
        assert proc.poll() is None, "driver died early"
        time.sleep(0.1)
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pid{r}").read_text().split()]
    assert all(_alive(p) for p in pids)
    below = _descendants(proc.pid)
    # torchrun, 2 workers, 2 sleeps, the launcher's watchdog (and any helper torch starts)
    assert set(pids) <= set(below) and len(below) >= 6
    os.kill(proc.pid, signum)
    out, _ = proc.communicate(timeout=60)
    return below, proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("many", [False, True], ids=["one_job", "two_jobs_at_once"])
def test_interrupt_leaves_no_process(tmp_path, many):
    below, code, out = _interrupt_script(tmp_path, signal.SIGINT, many)
    assert code == 130
    # one line in a notebook, not a traceback through the launcher
    assert out == ("interrupted KeyboardInterrupt: torchrun interrupted: every process it "
                   "started was ended\n")
    assert _wait_dead(below) == []


@pytest.mark.slow
def test_killing_the_launcher_outright_leaves_no_orphans(tmp_path):
    # a notebook kernel killed with SIGKILL cannot clean up: its watchdog and the death
    # signals must do it, for the processes the ranks started too
    below, code, _ = _interrupt_script(tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert _wait_dead(below, seconds=10) == []


@pytest.mark.slow
def test_launches_at_once_get_different_ports_and_come_back_in_job_order(jobs_at_once):
    # "slow" finishes last but comes back first; "fails" exits 3 on both ranks (check=False)
    results = jobs_at_once
    assert list(results) == ["slow", "fast", "fails"]
    assert [r.returncode for r in results.values()] == [0, 0, 1]
    assert results["fails"].failed_ranks == [0, 1]
    ports = [r.rank_lines(0)[0] for r in results.values()]
    assert all(r.rank_lines(1) == r.rank_lines(0) for r in results.values())  # one port per job
    assert len(set(ports)) == 3


def test_launches_at_once_raise_the_first_failed_job_in_order():
    with pytest.raises(ValueError, match="at least one job"):
        run_torchrun_many({})
    # bad arguments fail before any process starts; the first job in order is the one raised
    jobs = {"first": {"code": "print(1)", "nproc_per_node": 0},
            "second": {"code": "print(1)", "nproc_per_node": 1, "nnodes": 0}}
    with pytest.raises(ValueError, match=r"^nproc_per_node must be an integer >= 1, got 0$"):
        run_torchrun_many(jobs, live=False)


@pytest.mark.slow
def test_module_and_script_targets_get_their_arguments(tmp_path):
    script = tmp_path / "show_args.py"
    script.write_text("import os, sys; print(os.environ['RANK'], sys.argv[1:])\n")
    result = run_torchrun(str(script), ["--epochs", "3"], nproc_per_node=2, timeout=90, live=False)
    assert result.stdout.splitlines() == ["[rank 0] 0 ['--epochs', '3']",
                                          "[rank 1] 1 ['--epochs', '3']"]
    pkg = tmp_path / "lab_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hello.py").write_text("import os, sys\nif __name__ == '__main__':\n"
                                  "    print('module', os.environ['RANK'], sys.argv[1:])\n")
    result = run_torchrun("lab_pkg.hello", ["x"], module=True, nproc_per_node=2, timeout=90,
                          live=False, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.rank_lines(0) == ["module 0 ['x']"] and result.rank_lines(1) == ["module 1 ['x']"]


def test_bad_arguments_name_the_numbers(tmp_path):
    with pytest.raises(ValueError, match="nproc_per_node must be an integer >= 1, got 0"):
        run_torchrun(code="pass", nproc_per_node=0)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got -1"):
        run_torchrun(code="pass", timeout=-1)
    with pytest.raises(ValueError, match="exactly one of"):
        run_torchrun("x.py", code="pass")
    with pytest.raises(FileNotFoundError, match="no_such.py"):
        run_torchrun(str(tmp_path / "no_such.py"))


def test_equivalent_command_and_formatting():
    assert torchrun_command("ddp_lesson.train", ["--epochs", 1], module=True) == \
        "torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train --epochs 1"
    assert torchrun_command("a.py", nproc_per_node=4, max_restarts=2) == \
        "torchrun --standalone --nproc-per-node 4 --max-restarts 2 a.py"
    assert format_rank_outputs({1: "b\n", 0: "a\nc\n"}) == "[rank 0] a\n[rank 0] c\n[rank 1] b\n"
    assert format_rank_outputs({1: "b\n", 0: "a\n"}, ranks={1}) == "[rank 1] b\n"


def test_torchrun_flags_are_built_in_one_place():
    import argparse

    from ddp_lesson.cli import torchrun_argv
    from ddp_lesson.launch import torchrun_flags

    assert torchrun_flags(2) == ["--standalone", "--nproc-per-node", "2"]
    assert torchrun_flags(1, 2, max_restarts=1, rdzv_endpoint="h:1", rdzv_id="j", node_rank=1) == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j",
        "--node-rank", "1", "--nproc-per-node", "1", "--max-restarts", "1"]
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv-endpoint HOST:PORT"):
        torchrun_flags(1, 2)
    # the CLI's flags are the launcher's
    opts = argparse.Namespace(nproc_per_node=4, nnodes=2, max_restarts=0, rdzv_endpoint="h:1",
                              rdzv_id="j", node_rank=None)
    assert torchrun_argv(opts) == torchrun_flags(4, 2, rdzv_endpoint="h:1", rdzv_id="j")
    assert torchrun_command("a.py", nproc_per_node=1, nnodes=2) == (
        "torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB_ID "
        "--nproc-per-node 1 a.py")
    assert torchrun_flags(2, rdzv_endpoint="h:1", rdzv_id="j", local_addr="127.0.0.1") == [
        "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j",
        "--local-addr", "127.0.0.1", "--nproc-per-node", "2"]


def test_cluster_builds_its_agents_with_the_launchers_flags():
    """The persistent ranks start torchrun as run_torchrun does: flags from torchrun_flags,
    the launcher's agent, a rendezvous store hosted on 127.0.0.1 (no --standalone, no port
    chosen and released)."""
    import inspect

    from ddp_lesson import cluster

    src = inspect.getsource(cluster.Cluster._start)
    assert "torchrun_flags(" in src and '"ddp_lesson.launch.agent"' in src
    assert "rendezvous_store()" in src
    assert "--standalone" not in src and "--rdzv-backend" not in src and "free_port" not in src


def test_agent_holds_the_workers_port_until_the_next_round():
    """MASTER_PORT for a run that can restart: bound (SO_REUSEADDR, not listening) by the
    agent, so the kernel gives it to no bind(port 0) and no connect(); worker rank 0 can still
    bind it with SO_REUSEADDR and listen (ddp_lesson.env._loopback_store); the next round's
    choice releases it."""
    import socket

    from ddp_lesson.launch import agent

    port = agent.held_port()
    try:
        taken = set()
        for _ in range(2000):  # the kernel's choices for port 0 skip a bound port
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", 0))
                taken.add(s.getsockname()[1])
        assert port not in taken
        with socket.socket() as plain, pytest.raises(OSError) as info:
            plain.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE
        with socket.socket() as rank0:
            rank0.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            rank0.bind(("127.0.0.1", port))
            rank0.listen(8)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        nxt = agent.held_port()
        assert len(agent._held) == 1 and agent._held[0].getsockname()[1] == nxt
        with socket.socket() as plain:
            plain.bind(("127.0.0.1", port))  # the previous round's port is free again
    finally:
        for s in agent._held:
            s.close()
        agent._held.clear()


def test_agent_installs_its_sockets_only_for_local_runs(monkeypatch):
    """The two replacements go where torch 2.13 looks them up (read from its source), and only
    when every process of the run is local; the shared store then listens on 127.0.0.1."""
    from pathlib import Path

    import torch
    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous

    from ddp_lesson.env import LOCAL_RUN_ENV
    from ddp_lesson.launch import agent

    rdzv = Path(torch.__file__).parent / "distributed/elastic/rendezvous"
    api_src = (rdzv / "api.py").read_text()
    assert "from torch.distributed.elastic.utils.distributed import get_free_port" in api_src
    assert "port = server_port or get_free_port()" in api_src
    dyn_src = (rdzv / "dynamic_rendezvous.py").read_text()
    assert "def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:" \
        in dyn_src
    assert "self._shared_tcp_store_server = self._create_tcp_store_server(" in dyn_src
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # restored after the test
    monkeypatch.setattr(handler, "_create_tcp_store_server", handler._create_tcp_store_server)
    assert agent.install({}) is False and api.get_free_port is not agent.held_port
    assert agent.install({LOCAL_RUN_ENV: "1"}) is True
    assert api.get_free_port is agent.held_port
    assert handler._create_tcp_store_server is agent.loopback_store_server
    store = agent.loopback_store_server(None, "somehost", 0)
    listening = []
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            listening += [line.split()[1] for line in f.readlines()[1:]
                          if line.split()[3] == "0A"
                          and line.split()[1].endswith(f":{store.port:04X}")]
    assert listening == [f"0100007F:{store.port:04X}"]  # 127.0.0.1 only
    del store


def test_magic_line_splitting():
    assert split_magic_line("--nproc-per-node 2") == (["--nproc-per-node", "2"], None, False, [])
    assert split_magic_line("--nproc-per-node 2 -m ddp_lesson.train --epochs 1 --out runs/x") == (
        ["--nproc-per-node", "2"], "ddp_lesson.train", True, ["--epochs", "1", "--out", "runs/x"])
    assert split_magic_line("--nnodes 2 train.py -b 4") == (
        ["--nnodes", "2"], "train.py", False, ["-b", "4"])
    with pytest.raises(ValueError, match="-m needs a module name"):
        split_magic_line("--nproc-per-node 2 -m")


@pytest.mark.slow
def test_magic_prints_backend_once_then_ranks_in_order(capsys):
    torchrun_magic("--nproc-per-node 2 --timeout 90 --backend gloo",
                   "import os\nprint('hi', os.environ['RANK'])\n")
    assert capsys.readouterr().out.splitlines() == [
        "[torchrun] 2 processes, gloo requested: using gloo on CPU",
        "[rank 0] hi 0",
        "[rank 1] hi 1",
    ]
    with pytest.raises(ValueError, match="needs code in the cell"):
        torchrun_magic("--nproc-per-node 2", "   ")
    with pytest.raises(ValueError, match="could not parse"):
        torchrun_magic("--nproc-per-node two", "print(1)")


@pytest.mark.slow
def test_two_simulated_nodes_form_one_job():
    # two torchrun agents on this host joined by c10d rendezvous, as two machines would be
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        print(os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"],
              os.environ["WORLD_SIZE"], int(t.item()))
        dist.destroy_process_group()
    """)
    result = run_torchrun(code=code, nproc_per_node=1, nnodes=2, timeout=90, live=False)
    # global ranks 0 and 1, each local rank 0 on its own node (GROUP_RANK), sum 1 + 2
    assert result.stdout.splitlines() == ["[rank 0] 0 0 0 2 3", "[rank 1] 1 0 1 2 3"]
    assert "--nnodes 2 --rdzv-backend c10d" in result.torchrun_command


@pytest.mark.slow
@pytest.mark.parametrize("nproc, preset, expect_banner, expect_seen", [
    (2, None, True, "1"),      # unset: torchrun sets 1 per worker and prints its starred banner
    (2, "2", False, "2"),      # set: no banner, the value is kept
    (1, None, False, "unset"),  # one process: torchrun overrides nothing
])
def test_raw_torchrun_omp_banner(tmp_path, nproc, preset, expect_banner, expect_seen):
    """docs/pitfalls.md C5, on plain torchrun: why the launcher sets OMP_NUM_THREADS itself."""
    script = tmp_path / "omp.py"
    # one write(2) per worker: both share torchrun's stdout pipe, and writes this small are atomic
    script.write_text("import os; os.write(1, "
                      "(os.environ.get('OMP_NUM_THREADS', 'unset') + '\\n').encode())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if preset is not None:
        env["OMP_NUM_THREADS"] = preset
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(script)],
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expect_seen] * nproc
    assert ("Setting OMP_NUM_THREADS environment variable" in proc.stderr) == expect_banner
    assert proc.stderr.count("Setting OMP_NUM_THREADS") == (1 if expect_banner else 0)


def test_error_shows_a_rank_that_said_why():
    """Every rank exits on the same bad input but only rank 0 prints the reason; torchrun
    may name silent rank 1 as the first failure. The error must still show the reason."""
    from ddp_lesson.launch.output import _failed_rank

    launcher = ("Root Cause (first observed failure):\n[0]:\n  time : x\n  host : h\n"
                "  rank      : 1 (local_rank: 1)\n  exitcode  : 2 (pid: 7)\n")
    assert _failed_rank(launcher, {0: "error: epochs must be >= 1, got 0\n", 1: ""}) == (0, None)
    traceback = "Traceback (most recent call last):\nX\n"
    assert _failed_rank(launcher, {0: "warn\n", 1: traceback}) == (1, 2)
    assert _failed_rank(launcher, {0: "", 1: ""}) == (1, 2)
    assert _failed_rank("", {0: "", 1: "Traceback (most recent call last):\nE\n"}) == (1, None)


@pytest.mark.slow
def test_error_message_carries_the_cause_and_args_may_be_a_string(gloo_pair):
    code = "import os, sys\nif os.environ['RANK'] == '0': sys.exit('epochs must be >= 1, got 0')\n"
    with pytest.raises(TorchrunError) as info:
        run_torchrun(code=code, nproc_per_node=2, timeout=90, live=False)
    assert str(info.value) == "rank 0 of 2 failed (exit code 1): epochs must be >= 1, got 0"
    # args as one string are split as a shell would (gloo_pair's launch: its second line)
    assert gloo_pair.rank_lines(0)[1:] == [ARGS_LINE]
    with pytest.raises(ValueError, match="nproc_per_node must be an integer >= 1, got True"):
        run_torchrun(code="pass", nproc_per_node=True)
    with pytest.raises(ValueError, match=r"--ranks 0,5: ranks must be in \[0, 1\]"):
        torchrun_magic("--nproc-per-node 2 --ranks 0,5", "print(1)")
