"""Who am I in the job? Rank, local rank and world size from torchrun, and the backend choice.

torchrun (``python -m torch.distributed.run``) starts one Python process per rank and tells
each one its place through environment variables:

=================  ==========================================================
``RANK``           global rank, 0 .. WORLD_SIZE-1
``LOCAL_RANK``     rank on this machine, 0 .. LOCAL_WORLD_SIZE-1 (picks the GPU)
``WORLD_SIZE``     number of processes in the whole job
``LOCAL_WORLD_SIZE`` processes on this machine
``MASTER_ADDR``/``MASTER_PORT``  where the rendezvous store listens
=================  ==========================================================

This module reads them into a :class:`DistEnv`, chooses backend and device with one rule (NCCL
on ``cuda:{local_rank}`` when every local rank can have a GPU of its own, else gloo on CPU), and
wraps ``init_process_group`` / ``destroy_process_group`` with an explicit timeout and a safe
teardown. Source: https://pytorch.org/docs/stable/elastic/run.html ("Environment variables").
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass

#: Environment variable that overrides the backend choice ("gloo", "nccl" or "auto").
BACKEND_ENV = "DDP_LESSON_BACKEND"
BACKENDS = ("auto", "gloo", "nccl")
#: Set by the launcher (:mod:`ddp_lesson.launch`) once it printed the backend choice, so that
#: :func:`init_distributed` does not print it again.
ANNOUNCED_ENV = "DDP_LESSON_LAUNCHER_ANNOUNCED"
#: The backend the launcher chose and printed, and why: every rank uses it unless its own
#: code asks for another.
LAUNCHER_BACKEND_ENV = "DDP_LESSON_LAUNCHER_BACKEND"
LAUNCHER_REASON_ENV = "DDP_LESSON_LAUNCHER_REASON"
#: Set by the launcher when every rank of the run is on this machine: rank 0's store then
#: listens on 127.0.0.1 only (see :func:`init_distributed`).
LOCAL_RUN_ENV = "DDP_LESSON_ALL_RANKS_LOCAL"


@dataclass(frozen=True)
class DistEnv:
    """One process's place in the job, as torchrun describes it (the table above):
    ``backend`` ``"nccl"`` or ``"gloo"``, ``device`` ``"cuda:{local_rank}"`` or ``"cpu"``,
    ``reason`` one line saying why."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: str
    reason: str

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is (to be) used, i.e. started by torchrun."""
        return self.world_size > 1 or "TORCHELASTIC_RUN_ID" in os.environ


def _int_env(name: str, default: int, environ) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def choose_backend(local_world_size: int, requested: str | None = None,
                   cuda_device_count: int | None = None) -> tuple[str, str]:
    """Choose the collective backend for ``local_world_size`` (>= 1) processes on this node.

    NCCL (one GPU per process) when every local rank can have a visible GPU of its own
    (``cuda_device_count``, None asks torch), else gloo on CPU. ``requested`` (``"auto"``,
    ``"gloo"``, ``"nccl"``; None reads ``DDP_LESSON_BACKEND``) wins over the rule.

    Returns:
        ``(backend, reason)``, where reason is one line for the log, e.g.
        ``"4 processes but 1 GPU: using gloo on CPU"``.

    Raises:
        ValueError: unknown backend, ``local_world_size < 1``, or ``nccl`` requested with
            fewer GPUs than processes.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    if requested is None:
        requested = os.environ.get(BACKEND_ENV, "auto") or "auto"
    requested = requested.lower()
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if cuda_device_count is None:
        import torch

        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    procs = f"{local_world_size} process{'es' if local_world_size != 1 else ''}"
    gpus = f"{cuda_device_count} GPU{'s' if cuda_device_count != 1 else ''}"
    if requested == "gloo":
        return "gloo", f"{procs}, gloo requested: using gloo on CPU"
    if requested == "nccl":
        if cuda_device_count < local_world_size:
            raise ValueError(f"nccl needs one GPU per process: {procs} but {gpus} visible")
        return "nccl", f"{procs}, nccl requested: using nccl, one GPU per process"
    if cuda_device_count == 0:
        return "gloo", f"{procs} and no GPU: using gloo on CPU"
    if cuda_device_count < local_world_size:
        return "gloo", f"{procs} but {gpus}: using gloo on CPU"
    return "nccl", f"{procs} and {gpus}: using nccl, one GPU per process"


def read_env(backend: str | None = None, environ=None) -> DistEnv:
    """Read this process's :class:`DistEnv` from torchrun's variables (none: rank 0 of 1).

    ``backend`` None: the launcher's printed choice (``DDP_LESSON_LAUNCHER_BACKEND``), else
    ``DDP_LESSON_BACKEND``, else auto. ``environ``: read instead of ``os.environ`` (tests).

    Raises:
        ValueError: a variable is not an integer, or the ranks are inconsistent
            ("rank 3 is outside [0, 1]").
    """
    environ = os.environ if environ is None else environ
    world_size = _int_env("WORLD_SIZE", 1, environ)
    rank = _int_env("RANK", 0, environ)
    local_rank = _int_env("LOCAL_RANK", 0, environ)
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size, environ)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size - 1}]")
    if not 1 <= local_world_size <= world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE {local_world_size} is outside [1, {world_size}]")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank {local_rank} is outside [0, {local_world_size - 1}]")
    launched = environ.get(LAUNCHER_BACKEND_ENV)
    if backend is None and launched in ("gloo", "nccl"):
        # the launcher's choice, made once for every process it started and printed
        chosen, reason = launched, environ.get(LAUNCHER_REASON_ENV, "chosen by the launcher")
        if chosen == "nccl":
            choose_backend(local_world_size, "nccl")  # still one GPU per local rank, or raise
    else:
        if backend is None:
            backend = environ.get(BACKEND_ENV, "auto") or "auto"
        chosen, reason = choose_backend(local_world_size, backend)
    device = f"cuda:{local_rank}" if chosen == "nccl" else "cpu"
    return DistEnv(rank, local_rank, world_size, local_world_size, chosen, device, reason)


def resolve_local_rank(argv: list[str] | None = None, environ=None) -> int:
    """The local rank, from ``LOCAL_RANK`` (preferred) or the legacy flag.

    ``torch.distributed.launch`` passed ``--local_rank=N`` (``--local-rank=N`` since PyTorch
    2.0); torchrun sets only ``LOCAL_RANK``, so a script reading the flag (the seed's) silently
    gets its default. Both spellings are accepted (docs/pitfalls.md C1: ``--local-rank=1`` -> 1,
    ``--local_rank=1`` -> 1, ``LOCAL_RANK=3`` -> 3, nothing -> 0).
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if environ.get("LOCAL_RANK") not in (None, ""):
        return _int_env("LOCAL_RANK", 0, environ)
    return 0 if args.local_rank is None else args.local_rank


def print0(*args, env: DistEnv | None = None, **kwargs) -> None:
    """``print`` on rank 0 only (every rank printing the same line is noise). Never syncs."""
    rank = env.rank if env is not None else _int_env("RANK", 0, os.environ)
    if rank == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def group_active() -> bool:
    """True when a default process group is initialised (the package's one test of it).
    Local: no communication."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def reduce_device():
    """Where a tensor must live for the default group's ``all_reduce``: the current CUDA
    device under NCCL (it reduces CUDA tensors only), else the CPU. Local: no communication.
    """
    import torch

    if group_active():
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values):
    """A new tensor (same shape, dtype, device): ``values`` summed over all ranks; every rank
    gets the total (synchronises ranks).

    Every rank calls it alike, with the same shape and dtype on :func:`reduce_device`'s device.
    Without a process group, or at world size 1: a copy. Integer sums are exact in any order,
    so a sum of counts is the same at every world size.
    """
    import torch.distributed as dist

    total = values.clone()
    if group_active() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def init_distributed(timeout: float = 60.0, backend: str | None = None,
                     announce: bool | None = None) -> DistEnv:
    """Join the job's process group (a synchronisation point: returns once every rank joined).

    Reads :func:`read_env`, sets the CUDA device for NCCL, and calls ``init_process_group``
    with ``timeout`` (seconds any collective may wait for its peers) so a missing peer or a
    mismatched collective raises instead of hanging for torch's default (30 min; 10 for NCCL;
    torch 2.13). Outside torchrun with world size 1 no group is created. When every rank is on
    this machine, rank 0's unauthenticated TCPStore listens on 127.0.0.1 only, not on every
    interface (:func:`_loopback_store`).

    Args:
        backend: see :func:`choose_backend`.
        announce: rank 0 prints the backend choice and why. None: unless the launcher
            already printed it (``DDP_LESSON_LAUNCHER_ANNOUNCED``).

    Returns:
        This process's :class:`DistEnv`.

    Raises:
        ValueError: inconsistent torchrun variables or an impossible backend.
        RuntimeError / DistBackendError: a peer did not join within ``timeout``.
    """
    import torch
    import torch.distributed as dist

    env = read_env(backend)
    if env.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if env.distributed and not group_active():
        kwargs = {}
        if env.backend == "nccl":
            kwargs["device_id"] = torch.device(env.device)
        delta = datetime.timedelta(seconds=timeout)
        store = _loopback_store(env, delta)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend=env.backend, rank=env.rank, world_size=env.world_size,
                                timeout=delta, **kwargs)
    if announce is None:
        announce = not os.environ.get(ANNOUNCED_ENV)
    if announce:
        print0(f"world_size={env.world_size}: {env.reason}", env=env)
    return env


def _loopback_store(env: DistEnv, timeout: datetime.timedelta):
    """The job's TCPStore on 127.0.0.1 when every rank is local; None otherwise.

    ``env://`` makes rank 0's TCPStore bind every interface on ``MASTER_PORT``; handed a
    socket listening on 127.0.0.1 (``TCPStore(..., master_listen_fd=fd)``) it is reachable
    from this machine only. Not used when torchrun shares its store with the workers
    (``TORCHELASTIC_USE_AGENT_STORE``) or ``MASTER_PORT`` is missing.
    """
    import torch.distributed as dist

    environ = os.environ
    local = env.local_world_size == env.world_size or environ.get(LOCAL_RUN_ENV) == "1"
    if (not local or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            or not environ.get("MASTER_PORT")):
        return None
    port = int(environ["MASTER_PORT"])
    if env.rank != 0:
        return dist.TCPStore("127.0.0.1", port, env.world_size, is_master=False, timeout=timeout)
    return loopback_store_server(port, world_size=env.world_size, timeout=timeout)


def loopback_store_server(port: int = 0, **tcpstore_kwargs):
    """A ``TCPStore`` server listening on 127.0.0.1 only (``port`` 0: the kernel picks one,
    ``store.port`` says which); the keyword arguments go to ``TCPStore``.

    torch's server binds every interface unless handed a listening socket
    (``master_listen_fd``). ``SO_REUSEADDR``: the launcher's agent keeps a worker's
    ``MASTER_PORT`` bound, never listening, until this bind (:mod:`ddp_lesson.launch.agent`);
    Linux lets a second ``SO_REUSEADDR`` socket bind it and listen.
    """
    import socket

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    # the store owns the socket from here (detach: Python must not close its descriptor)
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True,
                         master_listen_fd=sock.detach(), **tcpstore_kwargs)


def cleanup() -> None:
    """Leave the process group: a barrier, then ``destroy_process_group`` (synchronises ranks).

    On gloo a rank that tears down while a peer still finishes a collective can make it abort
    ("Connection closed by peer"): the barrier prevents it. Nothing without a group. Drop your
    DDP wrappers first (``del model``), so they are freed while the group lives.
    """
    import gc

    import torch.distributed as dist

    if group_active():
        # Free unreachable DDP reducers and work handles while the group still exists: torn
        # down later, at interpreter exit, they have made gloo abort ("terminate called
        # without an active exception") after all output was printed.
        gc.collect()
        try:
            barrier()
        finally:
            dist.destroy_process_group()


def barrier() -> None:
    """Wait until every rank of the default process group reaches this call (synchronises ranks).

    On NCCL it names this rank's GPU (``device_ids``): else NCCL guesses it from the rank,
    warns, and can hang on a wrong guess. Nothing without a process group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        import torch

        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
