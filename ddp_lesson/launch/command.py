"""torchrun's command lines and environment for a run: built here, in one place.

:func:`torchrun_flags` makes torchrun's flags (the launcher, ``ddp-lesson train`` and the
persistent ranks of :mod:`ddp_lesson.cluster` use it), :func:`launch_env` the environment
torchrun and its workers get, :func:`build_launch` a whole run: one agent command per
simulated node, the rendezvous store they meet at, the backend chosen once for every rank.
"""
from __future__ import annotations

import os
import shlex
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..env import (
    ANNOUNCED_ENV,
    BACKEND_ENV,
    LAUNCHER_BACKEND_ENV,
    LAUNCHER_REASON_ENV,
    LOCAL_RUN_ENV,
    choose_backend,
    loopback_store_server,
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_flags(nproc_per_node: int = 2, nnodes: int = 1, *, max_restarts: int = 0,
                   rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                   node_rank: int | None = None, rdzv_conf: str | None = None,
                   local_addr: str | None = None, log_dir=None, extra=()) -> list[str]:
    """torchrun's own flags, without the program: the one place they are built.

    One node without ``rdzv_endpoint``: ``--standalone`` (torchrun binds a free port itself).
    Otherwise c10d rendezvous at ``rdzv_endpoint`` (``HOST:PORT`` of the first node) under the
    job id ``rdzv_id``, with ``--rdzv-conf`` and ``--node-rank`` when given. Then
    ``--local-addr`` when given (the address this node is known by; node 0's becomes the
    workers' ``MASTER_ADDR``), ``--nproc-per-node``, ``--max-restarts`` when not 0,
    ``--log-dir`` when given (torchrun otherwise makes a ``torchelastic_*`` folder in
    ``$TMPDIR`` and leaves it there), and ``extra`` unchanged.

    >>> torchrun_flags(2)
    ['--standalone', '--nproc-per-node', '2']

    Raises:
        ValueError: a count out of range, or several nodes without ``rdzv_endpoint``.
    """
    validate_launch(nproc_per_node, nnodes, max_restarts, None)
    if nnodes == 1 and not rdzv_endpoint:
        flags = ["--standalone"]
    else:
        if not rdzv_endpoint:
            raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT "
                             "(the address of the first node)")
        flags = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id)]
        if rdzv_conf:
            flags += ["--rdzv-conf", rdzv_conf]
        if node_rank is not None:
            flags += ["--node-rank", str(node_rank)]
    if local_addr:
        flags += ["--local-addr", local_addr]
    flags += ["--nproc-per-node", str(nproc_per_node)]
    if max_restarts:
        flags += ["--max-restarts", str(max_restarts)]
    if log_dir is not None:
        flags += ["--log-dir", str(log_dir)]
    return flags + [str(x) for x in extra]


def torchrun_command(target: str, args=(), *, module: bool = False, nproc_per_node: int = 2,
                     nnodes: int = 1, max_restarts: int = 0, extra=()) -> str:
    """The terminal command equivalent to a run (what to type without this package).

    >>> torchrun_command("ddp_lesson.train", ["--epochs", "1"], module=True)
    'torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train --epochs 1'
    """
    several = nnodes > 1
    flags = torchrun_flags(nproc_per_node, nnodes, max_restarts=max_restarts,
                           rdzv_endpoint="HOST:PORT" if several else None,
                           rdzv_id="JOB_ID" if several else None, extra=extra)
    program = (["-m", target] if module else [target]) + [str(a) for a in args]
    return shlex.join(["torchrun", *flags, *program])


def validate_launch(nproc_per_node: int, nnodes: int, max_restarts: int,
                    timeout: float | None) -> None:
    """Raise ValueError naming the bad value unless the launch's counts and timeout make sense."""
    if (isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int)
            or nproc_per_node < 1):
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def launch_env(base, backend: str | None, nprocs_here: int, announced: bool = True,
               chosen: tuple[str, str] | None = None, max_restarts: int | None = None) -> dict:
    """The environment torchrun and its workers get: backend, threads, store sharing, import path.

    Args:
        base: environment to start from (None: this process's).
        backend: passed on to every rank as ``DDP_LESSON_BACKEND`` (None: left as it is).
        nprocs_here: processes per node, for ``OMP_NUM_THREADS``.
        announced: the launcher printed the backend choice already.
        chosen: ``(backend, reason)`` the launcher chose and printed, for every rank.
        max_restarts: a run that can restart (> 0, or None: not known) gets
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless ``base`` sets it.
    """
    env = dict(os.environ if base is None else base)
    if backend is not None:
        env[BACKEND_ENV] = backend
    if chosen is not None:
        env[LAUNCHER_BACKEND_ENV], env[LAUNCHER_REASON_ENV] = chosen
    if announced:
        env[ANNOUNCED_ENV] = "1"
    if "OMP_NUM_THREADS" not in env:
        # Set explicitly: torchrun otherwise prints its starred banner and picks 1 anyway.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs_here))
    if max_restarts is None or max_restarts > 0:
        # torchrun >= 2.4 keeps one workers' TCP store across restarts; on torch 2.13 + gloo
        # restarted workers then often fail ("Gloo connectFullMesh failed ... Connection
        # refused": the dead attempt's keys carry no restart count; pitfall C7,
        # pytorch/pytorch#135712). A fresh store per round fixes it (tests/launch/
        # test_elastic.py). A run that cannot restart keeps the shared store: started by the
        # agent on a port it holds, every rank a client, so a rank that never joins makes the
        # others wait for its key, whatever the load (the clinic's missing_rank).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Let the workers import this package even when it is not installed (a plain checkout).
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def launcher_backend(nproc_per_node: int, nnodes: int = 1, backend: str | None = None,
                     env: dict | None = None) -> tuple[str, str]:
    """The launcher's backend choice for a run on this host: ``(backend, reason)``.

    Every process of the run is on this host, simulated nodes too (``nnodes`` agents share
    its GPUs), so :func:`ddp_lesson.env.choose_backend` is applied to all
    ``nproc_per_node * nnodes`` of them; ``backend`` None reads ``DDP_LESSON_BACKEND`` from
    ``env`` (the run's environment, default this process's), as every rank would.
    """
    requested = backend if backend is not None else (env or os.environ).get(BACKEND_ENV)
    return choose_backend(nproc_per_node * nnodes, requested or "auto")


@dataclass
class Launch:
    """A run ready to start: torchrun's commands, their environment and where output goes."""

    commands: list[list[str]]
    env: dict
    cwd: object
    outdir: Path
    script: Path | None
    equivalent: str
    backend: str
    reason: str
    total: int
    store: object = None  # the agents' rendezvous store, alive for the run


def rendezvous_store():
    """A TCPStore server on 127.0.0.1 for torchrun's agents: ``(store, "127.0.0.1:PORT")``
    (:func:`ddp_lesson.env.loopback_store_server`)."""
    store = loopback_store_server(0, wait_for_workers=False, multi_tenant=True)
    return store, f"127.0.0.1:{store.port}"


def loopback_env(env: dict) -> dict:
    """Variables that keep a run whose ranks are all on this machine off the network: rank 0's
    store on 127.0.0.1 (``DDP_LESSON_ALL_RANKS_LOCAL``, :func:`ddp_lesson.env.init_distributed`)
    and gloo on ``GLOO_SOCKET_IFNAME=lo`` (else the host name's address), unless set already.
    """
    extra = {LOCAL_RUN_ENV: "1"}
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in {n for _, n in socket.if_nameindex()}:
        extra["GLOO_SOCKET_IFNAME"] = "lo"
    return extra


def _program(target, args, code, module, outdir: Path) -> tuple[list[str], Path | None]:
    """The worker bootstrap's command line (``-m ddp_lesson._worker ...``) and the cell file."""
    script = None
    if code is not None:
        script = outdir / "torchrun_cell.py"
        script.write_text(code)
        kind, what = "--script", str(script)
    elif module:
        kind, what = "--module", target
    else:
        if not Path(target).is_file():
            raise FileNotFoundError(f"script {target!r} not found (cwd {os.getcwd()})")
        kind, what = "--script", str(Path(target).resolve())
    return ["-m", "ddp_lesson._worker", str(outdir), kind, what, *map(str, args)], script


def build_launch(target, args, code, module, nproc_per_node, nnodes, max_restarts, backend,
                  env, cwd, torchrun_args, outdir: Path) -> Launch:
    """Build torchrun's command(s) and environment; choose the backend once, for every rank."""
    program, script = _program(target, args, code, module, outdir)
    base = launch_env(env, backend, nproc_per_node, max_restarts=max_restarts)
    chosen = launcher_backend(nproc_per_node, nnodes, backend, base)
    child_env = launch_env(base, None, nproc_per_node, chosen=chosen, max_restarts=max_restarts)
    child_env.update(loopback_env(child_env))
    # torchrun itself, with the workers' store (or port) on loopback and held (.agent)
    torchrun = [sys.executable, "-m", "ddp_lesson.launch.agent"]
    # The agents' rendezvous store is hosted here, on 127.0.0.1 only (torchrun's own would
    # listen on every interface); each agent is a client of it (is_host=false), known by
    # 127.0.0.1, which node 0's agent hands its workers as MASTER_ADDR. torchrun's log
    # folder goes inside the run's own, removed with it.
    store, endpoint = rendezvous_store()
    common = dict(rdzv_endpoint=endpoint, rdzv_id=uuid.uuid4().hex[:8], rdzv_conf="is_host=false",
                  local_addr="127.0.0.1", max_restarts=max_restarts,
                  log_dir=outdir / "torchelastic", extra=torchrun_args)
    commands = [[*torchrun, *torchrun_flags(nproc_per_node, nnodes, node_rank=node if nnodes > 1
                                            else None, **common), *program]
                for node in range(nnodes)]
    equivalent = torchrun_command(target if code is None else "cell.py", args,
                                  module=module and code is None, nproc_per_node=nproc_per_node,
                                  nnodes=nnodes, max_restarts=max_restarts, extra=torchrun_args)
    return Launch(commands, child_env, cwd, outdir, script, equivalent, *chosen,
                   nproc_per_node * nnodes, store)

