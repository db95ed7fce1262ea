"""torchrun's agents forked from the standard library's fork server: torch imported once per
launching process, not once per run.

A fresh torchrun agent (``python -m ddp_lesson.launch.agent``) spends about 1.5 CPU-s importing
torch. So the first launch of a process starts ``multiprocessing``'s fork server with torch's
launcher preloaded (``set_forkserver_preload``), and each agent is a ``Process`` forked from it,
given the run's environment, folder, umask, CPU affinity and output descriptor
(``multiprocessing.reduction.DupFd``), in a process group of its own, dying with the server
(``PR_SET_PDEATHSIG``), which ends with the launching process (``multiprocessing/forkserver.py``:
its ``alive`` pipe closes).

The child sets again what a fresh process reads before ``main``: ``os.environ``, ``sys.path``
(``PYTHONPATH``, folder), unbuffered stdout (``PYTHONUNBUFFERED``), the ``torch.distributed``
loggers' level (``LOGLEVEL``, read at import: ``torch/distributed/elastic/utils/logging.py``).
A run whose :data:`IMPORT_TIME` variables differ from the server's gets a fresh agent. The
agent exits as an interpreter does (threads joined, ``atexit``, output flushed, SIGINT death
after an interrupt). ``DDP_LESSON_FORKSERVER=0`` or a failed fork: :func:`spawn_agent` returns
None and the caller starts a fresh agent. Linux only.
"""
from __future__ import annotations

import atexit
import io
import logging
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import reduction, spawn

from ..procs import LIBC, die_with_parent

#: The switch: ``"0"`` in a run's environment starts its agents fresh (``subprocess.Popen``).
SWITCH_ENV = "DDP_LESSON_FORKSERVER"

#: Variables read once, at ``import torch`` (C++ logging, the debug level of
#: ``torch.distributed``, ``torch._logging``'s settings, device back-end autoload:
#: ``torch/__init__.py``) or at the interpreter's start. A run whose value differs from the
#: server's gets a fresh agent.
IMPORT_TIME = ("TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_DISTRIBUTED_DEBUG",
               "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT", "TORCH_TRACE",
               "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONWARNINGS", "PYTHONDEVMODE",
               "PYTHONFAULTHANDLER", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONHASHSEED")

_AGENT_ARGV0 = [sys.executable, "-m", "ddp_lesson.launch.agent"]
_PRELOAD = ["torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent",
            "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
            "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "ddp_lesson.launch.agent",
            "ddp_lesson.launch.forkserver"]
_lock = threading.Lock()
_state: dict = {}  # "ctx", "import_env", "cpu": set once the first agent is forked


_AGENT_NAME = "ddp-lesson-agent"
_preparation_data = spawn.get_preparation_data


def _without_main(name):
    """``multiprocessing.spawn.get_preparation_data``, without the launcher's ``__main__`` for an
    agent: the standard fork server runs the launcher's main module again in each child
    (``spawn.prepare``: ``_fixup_main_from_path``), so a script that launches at its top level
    would launch again from every agent."""
    data = _preparation_data(name)
    if name == _AGENT_NAME:
        data = {k: v for k, v in data.items() if not k.startswith("init_main_from")}
    return data


class ForkedAgent:
    """A forked agent, as the launcher uses a ``subprocess.Popen``: ``pid`` (also its process
    group's id), ``returncode`` (None while it runs), :meth:`poll` and :meth:`wait_exit`."""

    def __init__(self, process):
        self.process, self.pid, self.returncode = process, process.pid, None

    def poll(self) -> int | None:
        """The exit code once the agent has ended (negative: killed by that signal), else None."""
        self.wait_exit(0.0)
        return self.returncode

    def wait_exit(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the agent to end; True once it has (``returncode`` set)."""
        if self.returncode is None:
            self.process.join(seconds)
            self.returncode = self.process.exitcode
        return self.returncode is not None


class _Fd:
    """A descriptor sent to the forked child with its request (``reduction.DupFd``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._detach, (reduction.DupFd(self.fd),)

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


def spawn_agent(cmd: list[str], env: dict, cwd, out_fd: int, ready=None
                ) -> ForkedAgent | None:
    """Start the torchrun agent ``cmd`` (``[sys.executable, "-m", "ddp_lesson.launch.agent",
    *argv]``) forked from the fork server (started, importing torch, on the first call),
    stdout and stderr to ``out_fd``, stdin ``/dev/null``; ``cwd`` None: this one's.

    Returns:
        A :class:`ForkedAgent`, or None: not Linux, another command, ``DDP_LESSON_FORKSERVER=0``,
        an :data:`IMPORT_TIME` variable unlike the server's, ``cwd`` not a folder, ``ready()``
        False (a cancelled or timed-out run), or a failed fork.
    """
    if (not sys.platform.startswith("linux") or cmd[:3] != _AGENT_ARGV0
            or env.get(SWITCH_ENV, os.environ.get(SWITCH_ENV)) == "0"
            or (ready is not None and not ready())):
        return None
    try:
        cwd = os.path.abspath(os.getcwd() if cwd is None else os.fspath(cwd))
    except OSError:  # the launcher's folder was removed: Popen reports what it will
        return None
    if not (os.path.isdir(cwd) and os.access(cwd, os.X_OK)):
        return None
    with _lock:
        if not _state:
            # patched here, not at import: a kernel that only loads the extension keeps the
            # standard library as it is (the server only ever starts agents)
            spawn.get_preparation_data = _without_main
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            _state.update(ctx=ctx, import_env={k: os.environ.get(k) for k in IMPORT_TIME},
                          cpu=ctx.Value("d", 0.0))
    if _state["import_env"] != {k: env.get(k) for k in IMPORT_TIME}:
        return None
    mask = os.umask(0o22)
    os.umask(mask)
    process = _state["ctx"].Process(
        target=_agent, name=_AGENT_NAME, daemon=True,
        args=(cmd[3:], env, cwd, _Fd(out_fd), mask, os.sched_getaffinity(0), _state["cpu"]))
    try:
        process.start()
    except (OSError, EOFError, ValueError):
        return None
    return ForkedAgent(process)


def agents_cpu_s() -> float:
    """CPU seconds (user + system) of the agents forked for this process that have ended, their
    ranks included: what ``getrusage(RUSAGE_CHILDREN)`` does not count (they are the server's
    children, not this process's)."""
    return _state["cpu"].value if _state else 0.0


def _agent(argv, env, cwd, out_fd, umask, affinity, cpu) -> None:
    """In the forked child: become what a fresh ``python -m ddp_lesson.launch.agent`` would be,
    run it, exit with its code (as the interpreter does)."""
    os.setpgid(0, 0)
    die_with_parent(os.getppid())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (1, 2):
        os.dup2(out_fd, fd)
    os.close(null)
    os.close(out_fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.umask(umask)
    os.sched_setaffinity(0, affinity)
    path = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]  # stdlib, site
    sys.path[:] = [*([] if env.get("PYTHONSAFEPATH") else [cwd]), *path, *base]
    if env.get("PYTHONUNBUFFERED"):  # as -u: stdout unbuffered
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False),
                                      encoding="utf-8", write_through=True)
    level = env.get("LOGLEVEL", "WARNING")
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and getattr(logger, "level", 0):
            logger.setLevel(level)
    from ddp_lesson.launch import agent

    sys.argv = [agent.__file__, *argv]
    sigint = False
    try:
        agent.main(argv)
    except KeyboardInterrupt:  # the interpreter prints it, then dies of SIGINT
        sys.excepthook(*sys.exc_info())
        sigint = True
    finally:
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if LIBC is not None:
            LIBC.fflush(None)
        import resource

        used = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        with cpu.get_lock():
            cpu.value += sum(u.ru_utime + u.ru_stime for u in used)
    if sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
