"""Notebook 00's account of torchrun: the variables its agent sets, the two stores, OMP_NUM_THREADS.

Checked against torch's source (torch 2.13) and by real runs: notebook 00's three-rank cell
through the package's launcher (its stored output, which nbval's replay reruns and compares) and
one of plain torchrun with nothing preset.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from notebook_cells import StoredRun

from ddp_lesson.labs.torchrun_env import SHOWN, VARYING, env_lines
from ddp_lesson.launch import launch_env

TORCH_DIST = Path(torch.__file__).parent / "distributed"
ROOT = Path(__file__).resolve().parents[2]


def _src(rel: str) -> str:
    return (TORCH_DIST / rel).read_text()


def test_agent_sets_every_variable_the_notebook_lists():
    agent = _src("elastic/agent/server/local_elastic_agent.py")
    for name in SHOWN + VARYING:
        if name == "OMP_NUM_THREADS":
            continue
        assert f'"{name}":' in agent or f'worker_env["{name}"]' in agent, name
    run = _src("run.py")
    assert 'if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:' in run
    assert "omp_num_threads = 1" in run


def test_two_stores_in_torch_source():
    """Agents meet at the rendezvous endpoint; workers' init_process_group uses MASTER_ADDR/PORT:
    hosted by the node-rank-0 agent when the store is shared (default), else by worker rank 0."""
    dyn = _src("elastic/rendezvous/dynamic_rendezvous.py")
    assert 'os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"' in dyn
    assert "self._shared_tcp_store_server = self._create_tcp_store_server(" in dyn
    rdzv = _src("rendezvous.py")
    assert "start_daemon = rank == 0" in rdzv
    assert "is_master=False" in rdzv          # agent store: every worker is a client
    api = _src("elastic/agent/server/api.py")
    assert "master_port = spec.master_port or rdzv_info.bootstrap_store_info.master_port" in api
    # the package's launcher opts out of sharing for a run that can restart (or may: not
    # said), so worker rank 0 hosts the store; a run that cannot restart keeps it shared
    assert launch_env({}, None, 2)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert launch_env({}, None, 2, max_restarts=1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch_env({}, None, 2, max_restarts=0)
    assert launch_env({}, None, 3)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
    assert launch_env({"OMP_NUM_THREADS": "5"}, None, 3)["OMP_NUM_THREADS"] == "5"


def test_env_lines_pure():
    lines = env_lines({"RANK": "4", "LOCAL_RANK": "0", "MASTER_PORT": "1"})
    assert lines[0].startswith("RANK=4 LOCAL_RANK=0 WORLD_SIZE=None")
    assert (
        lines[2]
        == "TORCHELASTIC_RUN_ID set: False MASTER_PORT set: True OMP_NUM_THREADS set: False"
    )


def test_notebook00_lab_on_three_ranks():
    """Notebook 00's deep dive's three-rank cell as stored (one job, one launch: nbval's replay
    reruns it and fails unless it prints exactly this)."""
    run = StoredRun("deep/00_torchrun_internals.ipynb",
                    "from ddp_lesson.labs.torchrun_env import main",
                    "%%torchrun --nproc-per-node 3\n"
                    "from ddp_lesson.labs.torchrun_env import main\n\n"
                    "main()   # prints this rank's variables, read_env()'s DistEnv, then runs "
                    "raw_setup()")
    assert run.other == ["[torchrun] 3 processes and no GPU: using gloo on CPU"]
    assert sorted(run.ranks) == [0, 1, 2]
    for rank in range(3):
        assert run.rank_lines(rank) == [
            (f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 "
             f"ROLE_RANK={rank}"),
            "TORCHELASTIC_RESTART_COUNT=0 MASTER_ADDR=127.0.0.1 TORCHELASTIC_USE_AGENT_STORE=True",
            "TORCHELASTIC_RUN_ID set: True MASTER_PORT set: True OMP_NUM_THREADS set: True",
            f"DistEnv: rank={rank} local_rank={rank} world_size=3 device=cpu",
            "raw setup on gloo: all_reduce(sum of ranks) = 3",
        ]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_plain_torchrun_defaults(tmp_path):
    """Plain torchrun, nothing preset: OMP_NUM_THREADS=1 with 2 processes, shared agent store."""
    script = tmp_path / "show.py"
    # one os.write per rank: both ranks share torchrun's stdout, and an unbuffered print()
    # writes its pieces separately, so the two ranks' lines could interleave
    script.write_text("import os\nos.write(1, (' '.join([os.environ['OMP_NUM_THREADS'], "
                      "os.environ['TORCHELASTIC_USE_AGENT_STORE'], os.environ['LOCAL_RANK']])"
                      " + '\\n').encode())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split("\n")[:-1]) == ["1 True 0", "1 True 1"]
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in out.stderr


SHOW_STORE = r"""
import errno, json, os, socket
from ddp_lesson.env import cleanup, init_distributed

def agent_sockets(port):
    # the agent's (the parent's) TCP sockets listening on 127.0.0.1:port (a socket that is
    # only bound is not in /proc/net/tcp)
    agent = os.getppid()
    inodes = set()
    for fd in os.listdir(f"/proc/{agent}/fd"):
        try:
            link = os.readlink(f"/proc/{agent}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[1] == f"0100007F:{port:04X}" and parts[9] in inodes and parts[3] == "0A":
                found.append("listening")
    return sorted(found)

def plain_bind(port):
    # what another process binding the port now gets (no SO_REUSEADDR)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return "free"
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        s.close()

port = int(os.environ["MASTER_PORT"])
before = agent_sockets(port), plain_bind(port)
env = init_distributed(timeout=30)
if env.rank == 0:
    print(json.dumps({"agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"],
                      "master_addr": os.environ["MASTER_ADDR"], "agent_before_init": before}))
cleanup()
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_shared_store_follows_restarts(max_restarts):
    """A run that cannot restart uses torchrun's shared store: node 0's agent listens on
    127.0.0.1:MASTER_PORT before any worker starts, and every rank is a client. A run that can
    restart does not share it (worker rank 0 hosts a fresh store per attempt), and the agent
    holds MASTER_PORT bound, not listening, so no other process can be given it before rank 0
    binds it (ddp_lesson.launch.agent)."""
    from ddp_lesson.launch import run_torchrun

    result = run_torchrun(code=SHOW_STORE, nproc_per_node=2, max_restarts=max_restarts,
                          timeout=120, live=False, backend="gloo",
                          env={k: v for k, v in os.environ.items()
                               if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})
    seen = json.loads(result.rank_lines(0)[-1])
    assert seen["master_addr"] == "127.0.0.1"
    if max_restarts == 0:
        assert seen == {"agent_store": "True", "master_addr": "127.0.0.1",
                        "agent_before_init": [["listening"], "EADDRINUSE"]}
    else:
        assert seen == {"agent_store": "False", "master_addr": "127.0.0.1",
                        "agent_before_init": [[], "EADDRINUSE"]}
