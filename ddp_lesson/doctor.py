"""``ddp-lesson doctor``: a preflight for the faults that look like code bugs but are the machine's.

    ddp-lesson doctor --nproc-per-node 2            # or: python -m ddp_lesson.doctor ...
    %ddp_doctor --nproc-per-node 2                   # in a notebook, after %load_ext ddp_lesson

Run it before a job. It starts no process group and imports torch only to count GPUs. Each
check prints one line; a problem's line says its symptom, its cause and the fix, and the command
exits 1 when any problem was found, 0 otherwise. The checks, and the public report each follows:

=================  ===============================================================================
``backend``        processes requested vs GPUs visible, and which backend the series' rule picks
                   (NCCL only when every local rank can have a GPU of its own; the same rule as
                   :func:`ddp_lesson.env.choose_backend`). Fewer GPUs than processes with NCCL
                   puts two ranks on one GPU (pytorch/pytorch#49481, "every rank on GPU 0").
``port``           the rendezvous port (``--port`` or ``MASTER_PORT``) already bound: the job
                   fails with ``EADDRINUSE`` (pytorch/pytorch#126510).
``interface``      ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` / ``TP_SOCKET_IFNAME`` naming
                   an interface this machine does not have. gloo fails in ``init_process_group``
                   with "Unable to find address for: NAME" (reproduced in
                   ``tests/launch/test_doctor.py``); a wrong interface on a real cluster hangs or
                   fails at connection (pytorch/pytorch#58431).
``shm``            ``/dev/shm`` smaller than :data:`MIN_SHM_BYTES`: NCCL's shared-memory
                   transport and DataLoader workers put their buffers there, and Docker's
                   default is 64 MiB (NVIDIA/nccl#342: "Error while creating shared memory
                   segment"; fix ``--ipc=host`` or ``--shm-size``).
``leftover``       a torchrun agent of an earlier job still running on this machine (it keeps
                   its workers, their ports and their GPU memory).
``gpu0``           CUDA contexts that other processes hold on GPU 0 (``nvidia-smi``): ranks that
                   touched CUDA before ``torch.cuda.set_device(local_rank)``, or a previous job's
                   ranks, all sit on GPU 0. Only where ``nvidia-smi`` exists.
``p2p``            how the GPUs connect (``nvidia-smi topo -m``), with 2 GPUs or more: NVLink
                   (``NV#``) or PCIe (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``). Over PCIe,
                   in a VM above all, NCCL's peer-to-peer transfers can fail or crawl and the
                   first collective looks hung (NCCL's troubleshooting guide, "GPU Direct" and
                   "PCI Access Control Services"; NVIDIA/nccl#199): the line says to try
                   ``NCCL_P2P_DISABLE=1``. Not a problem by itself: many PCIe pairs work.
=================  ===============================================================================
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .env import BACKENDS, choose_backend

#: Below this (bytes) ``/dev/shm`` is too small: NCCL's transport takes a few MiB per peer and
#: channel, DataLoader workers queue whole batches there (Docker's default: 64 MiB).
MIN_SHM_BYTES = 512 * 2**20
#: The variables that choose the network interface, and who reads them.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass(frozen=True)
class Finding:
    """One check's result: its name (``"port"``), ``ok`` (False: a problem), the ``symptom``
    the learner would see (or what was checked), and for a problem its ``cause`` and ``fix``."""

    check: str
    ok: bool
    symptom: str
    cause: str = ""
    fix: str = ""

    def line(self) -> str:
        """The one printed line: ``ok    port: 29500 is free`` or
        ``PROBLEM port: symptom | cause: ... | fix: ...``."""
        if self.ok:
            return f"ok       {self.check}: {self.symptom}"
        return f"PROBLEM  {self.check}: {self.symptom} | cause: {self.cause} | fix: {self.fix}"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_backend(nproc_per_node: int, backend: str = "auto",
                  gpu_count: int | None = None) -> Finding:
    """Processes requested vs GPUs visible, and the backend the series' rule picks: a problem
    when NCCL has fewer GPUs than processes, or ``auto`` falls back to gloo beside GPUs."""
    gpus = _gpu_count() if gpu_count is None else gpu_count
    try:
        chosen, reason = choose_backend(nproc_per_node, backend, cuda_device_count=gpus)
    except ValueError as exc:
        return Finding("backend", False, str(exc),
                       "NCCL needs one GPU per process; two ranks on one GPU fail or hang",
                       f"--nproc-per-node {gpus}" if gpus else "--backend gloo (CPU)")
    if chosen == "gloo" and 0 < gpus < nproc_per_node and backend == "auto":
        return Finding("backend", False, f"{reason}, although {gpus} GPU(s) are visible",
                       f"{nproc_per_node} processes need {nproc_per_node} GPUs for NCCL",
                       f"--nproc-per-node {gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return Finding("backend", True, reason)


def check_port(port: int | None, host: str = "127.0.0.1") -> Finding:
    """Whether ``port`` can be bound on ``host``. ``None``: nothing to check (the launcher and
    ``torchrun --standalone`` pick a free port themselves)."""
    if port is None:
        return Finding("port", True, "no fixed port (MASTER_PORT unset): a free one is picked")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return Finding("port", False, f"{host}:{port} is in use (EADDRINUSE at start)",
                           "another process, often an earlier job's rank 0 or agent, listens there",
                           "pick another --master-port / MASTER_PORT, or end that process")
    return Finding("port", True, f"{host}:{port} is free")


def _matches(entry: str, names: list[str], exact: bool) -> bool:
    return any(n == entry if exact else n.startswith(entry) for n in names)


def check_interfaces(environ: Mapping[str, str] | None = None,
                     interfaces: list[str] | None = None) -> list[Finding]:
    """Every interface named by :data:`IFNAME_VARS` exists on this machine.

    ``GLOO_SOCKET_IFNAME`` and ``TP_SOCKET_IFNAME`` name interfaces exactly (a comma-separated
    list for gloo); ``NCCL_SOCKET_IFNAME`` entries are prefixes, ``=name`` exact, and a leading
    ``^`` excludes (NCCL's environment-variable documentation), so only an including NCCL list
    that matches nothing is a problem.
    """
    environ = os.environ if environ is None else environ
    names = interfaces if interfaces is not None else [n for _, n in socket.if_nameindex()]
    found = []
    for var in IFNAME_VARS:
        value = environ.get(var, "").strip()
        if not value:
            continue
        if var == "NCCL_SOCKET_IFNAME":
            if value.startswith("^"):
                continue
            exact = value.startswith("=")
            entries = [e for e in value.lstrip("=").split(",") if e]
            missing = [] if any(_matches(e, names, exact) for e in entries) else entries
        else:
            missing = [e for e in value.split(",") if e and e not in names]
        if missing:
            found.append(Finding(
                "interface", False, f"{var}={value}: no interface {', '.join(missing)} here",
                f"this machine has {', '.join(names)}; gloo fails in init_process_group "
                "('Unable to find address for'), NCCL cannot connect",
                f"unset {var}, or name one of: {', '.join(names)}"))
        else:
            found.append(Finding("interface", True, f"{var}={value} exists"))
    if not found:
        found.append(Finding("interface", True, "no *_SOCKET_IFNAME set (the libraries choose)"))
    return found


def check_shm(path: str | os.PathLike = "/dev/shm", min_bytes: int = MIN_SHM_BYTES) -> Finding:
    """Whether the shared-memory file system at ``path`` holds at least ``min_bytes``."""
    p = Path(path)
    if not p.is_dir():
        return Finding("shm", False, f"{p} does not exist",
                       "NCCL's shared-memory transport and DataLoader workers need it",
                       "run the container with --ipc=host or --shm-size=1g")
    st = os.statvfs(p)
    total = st.f_blocks * st.f_frsize
    size = f"{p} is {total / 2**20:,.0f} MiB"
    if total < min_bytes:
        return Finding("shm", False, f"{size} (< {min_bytes / 2**20:,.0f} MiB)",
                       "NCCL ('Error while creating shared memory segment') and DataLoader "
                       "workers ('bus error') run out of it; Docker's default is 64 MiB",
                       "docker run --ipc=host, or --shm-size=1g (more for many workers)")
    return Finding("shm", True, size)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return seen


def is_torchrun(argv: list[str]) -> bool:
    """Whether a command line is a torchrun agent: ``torchrun ...`` or
    ``python -m torch.distributed.run ...`` (``torch.distributed.launch`` too)."""
    if not argv:
        return False
    if Path(argv[0]).name == "torchrun" or (len(argv) > 1 and Path(argv[1]).name == "torchrun"):
        return True
    return any(a == "-m" and b in ("torch.distributed.run", "torch.distributed.launch")
               for a, b in zip(argv, argv[1:]))


def check_leftover_torchrun(proc: str | os.PathLike = "/proc") -> Finding:
    """torchrun agents running on this machine other than this process's own ancestors."""
    mine = _ancestors(os.getpid())
    pids = sorted(int(d.name) for d in Path(proc).iterdir() if d.name.isdigit())
    others = [p for p in pids if p not in mine and is_torchrun(_cmdline(p))]
    if others:
        listed = ", ".join(map(str, others))
        return Finding("leftover", False,
                       f"{len(others)} torchrun agent(s) still running: pid {listed}",
                       "an earlier job did not end; its workers keep ports and GPU memory",
                       f"kill {' '.join(map(str, others))} (their workers end with them)")
    return Finding("leftover", True, "no other torchrun running")


def _nvidia_smi(query: str, kind: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def check_gpu0_contexts(run: Callable[[str, str], list[list[str]]] | None = None) -> Finding:
    """Processes other than this one holding a CUDA context on GPU 0 (via ``nvidia-smi``)."""
    if run is None:
        if shutil.which("nvidia-smi") is None:
            return Finding("gpu0", True, "no nvidia-smi: no GPU to check")
        run = _nvidia_smi
    gpus = run("index,uuid", "gpu")
    uuid0 = next((u for i, u in gpus if i == "0"), None)
    apps = run("pid,gpu_uuid,used_memory", "compute-apps")
    mine = _ancestors(os.getpid())
    held = [a for a in apps if a[1] == uuid0 and int(a[0]) not in mine]
    if held:
        return Finding("gpu0", False, f"{len(held)} other process(es) hold GPU 0: "
                       + ", ".join(f"pid {a[0]} ({a[2]})" for a in held),
                       "ranks that used CUDA before torch.cuda.set_device(local_rank), or a "
                       "previous job, sit on GPU 0",
                       "end them; call torch.cuda.set_device(local_rank) first in every rank")
    return Finding("gpu0", True, "no other process on GPU 0")


#: ``nvidia-smi topo -m``'s codes for a path between two GPUs over PCIe (NVLink is ``NV<n>``)
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``'s GPU matrix: ``{(i, j): code}`` for every pair ``i < j`` (NIC
    rows, the legend and terminal escapes skipped)."""
    gpus: list[int] = []
    pairs: dict[tuple[int, int], str] = {}
    for raw in text.splitlines():
        fields = _ANSI.sub("", raw).split()
        if not gpus and fields and fields[0] == "GPU0":
            gpus = [int(f[3:]) for f in fields if re.fullmatch(r"GPU\d+", f)]
            continue
        if gpus and fields and re.fullmatch(r"GPU\d+", fields[0]):
            row = int(fields[0][3:])
            for col, code in zip(gpus, fields[1:1 + len(gpus)]):
                if row < col:
                    pairs[(row, col)] = code
    return pairs


def _topo_text() -> str:
    return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                          timeout=20, check=True).stdout


def check_p2p(read: Callable[[], str] | None = None,
              environ: Mapping[str, str] | None = None) -> Finding:
    """How the GPUs connect, and what to try when NCCL's first collective hangs over PCIe.

    ``read`` returns ``nvidia-smi topo -m``'s output (default: runs it when it exists).
    Always ``ok``: a PCIe path is a risk, not a fault; its line names ``NCCL_P2P_DISABLE=1``.
    """
    environ = os.environ if environ is None else environ
    if read is None:
        if shutil.which("nvidia-smi") is None:
            return Finding("p2p", True, "no nvidia-smi: no GPU pair to check")
        read = _topo_text
    try:
        pairs = parse_topology(read())
    except (OSError, subprocess.SubprocessError) as exc:
        return Finding("p2p", True, f"nvidia-smi topo -m failed ({type(exc).__name__})")
    if not pairs:
        return Finding("p2p", True, "fewer than 2 GPUs: no peer-to-peer path")
    pcie = sorted((a, b, c) for (a, b), c in pairs.items() if c in PCIE_PATHS)
    if not pcie:
        return Finding("p2p", True, f"{len(pairs)} GPU pair(s), all over NVLink")
    a, b, code = pcie[0]
    where = f"GPUs {a}-{b} over PCIe ({code})" + (f", +{len(pcie) - 1} pair(s)"
                                                  if len(pcie) > 1 else "")
    if environ.get("NCCL_P2P_DISABLE", "") not in ("", "0"):
        return Finding("p2p", True, f"{where}; NCCL_P2P_DISABLE is set: no P2P transfers")
    return Finding("p2p", True, f"{where}; if the first collective hangs, try NCCL_P2P_DISABLE=1")


def run_checks(nproc_per_node: int = 2, backend: str = "auto", port: int | None = None,
               host: str = "127.0.0.1", environ: Mapping[str, str] | None = None,
               shm_path: str = "/dev/shm", proc: str | os.PathLike = "/proc") -> list[Finding]:
    """Every check, in the order printed. ``port`` defaults to ``MASTER_PORT`` when set;
    ``proc`` is where processes are listed (tests point it at a folder of their own)."""
    environ = os.environ if environ is None else environ
    if port is None and environ.get("MASTER_PORT", "").isdigit():
        port = int(environ["MASTER_PORT"])
    return [check_backend(nproc_per_node, backend), check_port(port, host),
            *check_interfaces(environ), check_shm(shm_path), check_leftover_torchrun(proc),
            check_gpu0_contexts(), check_p2p(environ=environ)]


def parser(prog: str = "ddp-lesson doctor") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Check this machine before a job.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="processes the job will start here (default 2)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="the backend the job will use (default auto: nccl with a GPU per "
                        "process, else gloo)")
    p.add_argument("--port", "--master-port", type=int, default=None,
                   help="the rendezvous port the job will use (default: MASTER_PORT if set)")
    p.add_argument("--host", default="127.0.0.1", help="address to test the port on")
    return p


def main(argv: list[str] | None = None, proc: str | os.PathLike = "/proc") -> int:
    """Print one line per check; return 1 when any problem was found, else 0 (2: bad flags)."""
    p = parser()
    opts = p.parse_args(argv)
    if opts.nproc_per_node < 1:
        print(f"{p.prog}: error: --nproc-per-node must be >= 1, got {opts.nproc_per_node}",
              file=sys.stderr)
        return 2
    findings = run_checks(opts.nproc_per_node, opts.backend, opts.port, opts.host, proc=proc)
    for f in findings:
        print(f.line())
    problems = sum(not f.ok for f in findings)
    print(f"{problems} problem(s) found" if problems else "no problem found")
    return 1 if problems else 0


def doctor_magic(line: str = "") -> None:
    """``%ddp_doctor [--nproc-per-node N] [--port P]``: the same checks in a notebook."""
    import shlex

    main(shlex.split(line))


if __name__ == "__main__":
    sys.exit(main())
