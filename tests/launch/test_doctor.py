"""``ddp-lesson doctor``: each check finds its fault, reproduced here where a CPU machine can,
and says nothing on a clean machine."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_lesson import doctor
from ddp_lesson.doctor import (
    Finding,
    check_backend,
    check_gpu0_contexts,
    check_interfaces,
    check_leftover_torchrun,
    check_port,
    check_shm,
    is_torchrun,
)

ROOT = Path(__file__).resolve().parents[2]


def test_finding_lines_are_one_line_each():
    ok = Finding("port", True, "127.0.0.1:1234 is free")
    bad = Finding("port", False, "in use", "someone listens", "pick another")
    assert ok.line() == "ok       port: 127.0.0.1:1234 is free"
    assert bad.line() == "PROBLEM  port: in use | cause: someone listens | fix: pick another"
    assert "\n" not in bad.line()


@pytest.mark.parametrize("nproc, backend, gpus, ok, words", [
    (2, "auto", 0, True, "2 processes and no GPU: using gloo on CPU"),
    (2, "auto", 2, True, "2 processes and 2 GPUs: using nccl, one GPU per process"),
    (4, "auto", 1, False, "4 processes but 1 GPU: using gloo on CPU, although 1 GPU(s)"),
    (2, "nccl", 0, False, "nccl needs one GPU per process: 2 processes but 0 GPUs visible"),
    (2, "gloo", 8, True, "2 processes, gloo requested: using gloo on CPU"),
])
def test_backend_check_compares_processes_with_gpus(nproc, backend, gpus, ok, words):
    f = check_backend(nproc, backend, gpu_count=gpus)
    assert f.ok is ok
    assert f.symptom.startswith(words)
    if not ok:
        assert f.fix


def test_backend_check_fix_names_the_gpu_count():
    assert check_backend(2, "nccl", gpu_count=0).fix == "--backend gloo (CPU)"
    assert check_backend(4, "nccl", gpu_count=2).fix == "--nproc-per-node 2"


def test_port_in_use_is_found_and_a_free_port_is_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        f = check_port(port)
        assert not f.ok
        assert f.symptom == f"127.0.0.1:{port} is in use (EADDRINUSE at start)"
    # the listener is closed: the same port is free again
    assert check_port(port).ok
    assert check_port(None).ok


def test_port_check_reads_master_port_from_the_environment(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = doctor.run_checks(1, "gloo", environ={"MASTER_PORT": str(port)}, proc=tmp_path)
    assert [f.ok for f in found if f.check == "port"] == [False]


@pytest.mark.slow
def test_a_missing_gloo_interface_is_what_makes_gloo_fail():
    """The fault reproduced: gloo's init_process_group with GLOO_SOCKET_IFNAME naming no
    interface fails with "Unable to find address for: NAME"; the doctor names it first."""
    f = check_interfaces({"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert [x.ok for x in f] == [False]
    assert f[0].symptom == "GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0 here"
    assert "lo" in f[0].fix
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import datetime, torch.distributed as dist\n"
            "dist.init_process_group('gloo', rank=0, world_size=1,"
            " timeout=datetime.timedelta(seconds=10))\n")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="nosuch0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert "Unable to find address for: nosuch0" in run.stderr


def test_interface_lists_follow_each_library_rule():
    names = ["lo", "eth0", "docker0"]
    assert [f.ok for f in check_interfaces({"GLOO_SOCKET_IFNAME": "lo,eth0"}, names)] == [True]
    assert check_interfaces({"GLOO_SOCKET_IFNAME": "lo,eth1"}, names)[0].symptom == (
        "GLOO_SOCKET_IFNAME=lo,eth1: no interface eth1 here")
    # NCCL: prefixes match, '=' is exact, '^' excludes
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "eth"}, names)[0].ok
    assert not check_interfaces({"NCCL_SOCKET_IFNAME": "=eth"}, names)[0].ok
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "=eth0"}, names)[0].ok
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "^docker"}, names) == [
        Finding("interface", True, "no *_SOCKET_IFNAME set (the libraries choose)")]
    assert not check_interfaces({"NCCL_SOCKET_IFNAME": "ib,enp"}, names)[0].ok
    assert check_interfaces({}, names)[0].ok


def test_shm_size_is_read_from_the_file_system(tmp_path):
    st = os.statvfs("/dev/shm")
    total_mib = st.f_blocks * st.f_frsize / 2**20
    f = check_shm("/dev/shm", min_bytes=1)
    assert f.ok and f.symptom == f"/dev/shm is {total_mib:,.0f} MiB"
    assert not check_shm("/dev/shm", min_bytes=2 * st.f_blocks * st.f_frsize).ok
    missing = check_shm(tmp_path / "none")
    assert not missing.ok and "--ipc=host" in missing.fix


@pytest.mark.slow
def test_a_docker_sized_shm_is_a_problem(tmp_path):
    """The fault reproduced: a 64 MiB tmpfs, Docker's default /dev/shm."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        f = check_shm(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], timeout=20, check=True)
    assert not f.ok
    assert f.symptom == f"{mnt} is 64 MiB (< 512 MiB)"
    assert "--shm-size" in f.fix


@pytest.mark.parametrize("argv, expected", [
    (["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc-per-node", "2", "x.py"], True),
    (["/venv/bin/python", "/venv/bin/torchrun", "x.py"], True),
    (["torchrun", "--standalone", "x.py"], True),
    (["python", "-m", "torch.distributed.launch", "x.py"], True),
    (["python", "x.py", "torch.distributed.run"], False),
    (["python", "-m", "ddp_lesson.train"], False),
    ([], False),
])
def test_is_torchrun(argv, expected):
    assert is_torchrun(argv) is expected


@pytest.mark.slow
def test_a_leftover_torchrun_is_found(tmp_path):
    """The fault reproduced: a real torchrun agent left running (its worker a plain sleep)."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "--no-python", "sleep", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            f = check_leftover_torchrun()
            if not f.ok and str(agent.pid) in f.symptom:
                break
            time.sleep(0.2)
        assert not f.ok
        assert str(agent.pid) in f.symptom.split(": pid ", 1)[1].split(", ")
        assert str(agent.pid) in f.fix.split()
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=20)
    # an empty process table: nothing left over
    assert check_leftover_torchrun(tmp_path).ok


@pytest.mark.slow
def test_own_torchrun_agent_is_not_a_leftover():
    """The doctor run inside a torchrun job does not report the agent that started it."""
    code = ("import os\n"
            "from ddp_lesson.doctor import check_leftover_torchrun\n"
            "f = check_leftover_torchrun()\n"
            "print('agent reported:', str(os.getppid()) in f.symptom.replace(',', ' ').split())\n")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "--no-python", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "agent reported: False"


def test_gpu0_contexts_from_nvidia_smi_rows():
    rows = {"gpu": [["0", "GPU-a"], ["1", "GPU-b"]],
            "compute-apps": [["4242", "GPU-a", "300 MiB"], ["4343", "GPU-b", "300 MiB"]]}
    f = check_gpu0_contexts(lambda query, kind: rows[kind])
    assert not f.ok
    assert f.symptom == "1 other process(es) hold GPU 0: pid 4242 (300 MiB)"
    rows["compute-apps"] = [["4343", "GPU-b", "300 MiB"]]
    assert check_gpu0_contexts(lambda query, kind: rows[kind]).ok


#: ``nvidia-smi topo -m`` as two PCIe T4s print it (a cloud VM, Kaggle's 2xT4), tabs and all
TOPO_T4_PAIR = (
    "\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tPHB\t0-3\t0\t\tN/A\n"
    "GPU1\tPHB\t X \t0-3\t0\t\tN/A\n"
    "\n"
    "Legend:\n\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n")
#: four SXM GPUs on NVLink, with a NIC column and row
TOPO_NVLINK_4 = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tSYS\t0-31\t0\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tSYS\t0-31\t0\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tPXB\t32-63\t1\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tPXB\t32-63\t1\n"
    "NIC0\tSYS\tSYS\tPXB\tPXB\t X \n")
TOPO_ONE_GPU = "\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\t0\n"


def test_topology_matrix_is_read_from_nvidia_smi_output():
    assert doctor.parse_topology(TOPO_T4_PAIR) == {(0, 1): "PHB"}
    pairs = doctor.parse_topology(TOPO_NVLINK_4)
    assert len(pairs) == 6 and set(pairs.values()) == {"NV12"}  # the NIC column is not a GPU
    assert doctor.parse_topology(TOPO_ONE_GPU) == {}


def test_p2p_line_names_nccl_p2p_disable_for_a_pcie_pair():
    f = doctor.check_p2p(lambda: TOPO_T4_PAIR, environ={})
    assert f.ok and f.line() == ("ok       p2p: GPUs 0-1 over PCIe (PHB); if the first collective "
                                 "hangs, try NCCL_P2P_DISABLE=1")
    assert len(f.line()) <= 100
    f = doctor.check_p2p(lambda: TOPO_T4_PAIR, environ={"NCCL_P2P_DISABLE": "1"})
    assert f.symptom == "GPUs 0-1 over PCIe (PHB); NCCL_P2P_DISABLE is set: no P2P transfers"
    assert doctor.check_p2p(lambda: TOPO_NVLINK_4, environ={}).symptom == (
        "6 GPU pair(s), all over NVLink")
    assert doctor.check_p2p(lambda: TOPO_ONE_GPU, environ={}).symptom == (
        "fewer than 2 GPUs: no peer-to-peer path")
    mixed = TOPO_NVLINK_4.replace("NV12\tNV12\tNV12\tSYS", "NV12\tSYS\tNV12\tSYS", 1)
    assert doctor.check_p2p(lambda: mixed, environ={}).symptom.startswith(
        "GPUs 0-2 over PCIe (SYS); if the first")


def test_clean_machine_passes_and_a_problem_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for var in doctor.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    if doctor.shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: tests/gpu/test_gpu.py runs the doctor there")
    assert doctor.main(["--nproc-per-node", "2", "--backend", "gloo"], proc=tmp_path) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "no problem found"
    assert all(line.startswith("ok       ") for line in out[:-1])
    assert [line.split(":")[0].split()[-1] for line in out[:-1]] == [
        "backend", "port", "interface", "shm", "leftover", "gpu0", "p2p"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert doctor.main(["--backend", "gloo", "--port", str(port)], proc=tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "1 problem(s) found"
    assert [line for line in out if line.startswith("PROBLEM")] == [
        f"PROBLEM  port: 127.0.0.1:{port} is in use (EADDRINUSE at start) | cause: another "
        "process, often an earlier job's rank 0 or agent, listens there | fix: pick another "
        "--master-port / MASTER_PORT, or end that process"]


def test_bad_flag_exits_2(capsys):
    assert doctor.main(["--nproc-per-node", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ddp-lesson doctor: error: --nproc-per-node must be >= 1, got 0")


def test_ddp_doctor_magic_is_registered_and_runs(capsys, monkeypatch):
    import ddp_lesson

    magics = {}

    class Shell:
        def register_magic_function(self, fn, magic_kind, magic_name):
            magics[magic_name] = (fn, magic_kind)

    ddp_lesson.load_ipython_extension(Shell())
    fn, kind = magics["ddp_doctor"]
    assert kind == "line"
    monkeypatch.setattr(doctor, "check_leftover_torchrun",
                        lambda proc="/proc": Finding("leftover", True, "none (test)"))
    fn("--nproc-per-node 1 --backend gloo")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok       backend: 1 process, gloo requested: using gloo on CPU"
    assert "ok       leftover: none (test)" in out


@pytest.mark.slow
def test_ddp_lesson_doctor_command_exits_1_on_a_problem():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ddp_lesson.cli", "doctor", "--backend", "gloo",
                            "--port", str(port)], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert f"PROBLEM  port: 127.0.0.1:{port} is in use (EADDRINUSE at start)" in r.stdout
    assert r.stdout.splitlines()[-1].endswith("problem(s) found")
