"""A fork server for torchrun's agents: torch imported once per launching process, not per run.

Every run starts one torchrun agent per node (``python -m ddp_lesson.launch.agent``). A fresh
agent spends most of its CPU importing torch (about 1.5 CPU-s of the 1.7 an agent uses in the
test suite), before it starts a single worker. A process that launches runs (a notebook kernel,
a test worker) therefore starts one small server the first time it launches: a Python that
imports torch and torchrun once, then forks one agent per request. A forked agent is the same
program (``ddp_lesson.launch.agent.main``, torch's ``torch.distributed.run.main``) with the run's
own environment, working directory (the launcher's current one when the run names none), umask,
CPU affinity and output file, in a process group of its own, killed by Linux when the server
dies (``PR_SET_PDEATHSIG``). The server ends when its launching process does: the socket
between them closes, or (if a child the launcher forked still holds the socket) the server sees
within 5 s that its parent is gone.

What a fresh process reads from its environment before ``main`` runs, the fork sets again:
``os.environ`` is replaced, ``sys.path`` is rebuilt from the run's ``PYTHONPATH`` and working
directory, ``PYTHONUNBUFFERED`` makes stdout unbuffered, and the level of each logger torch's
elastic code made with ``get_logger`` (``LOGLEVEL``, read at import:
``torch/distributed/elastic/utils/logging.py``) is set again from the run's ``LOGLEVEL``. What
is read only at ``import torch`` or at the interpreter's start (the variables in
:data:`IMPORT_TIME`, those we know of) cannot be set again: a run whose environment differs from
the server's in one of them gets a fresh agent instead. The agent exits as an interpreter does:
non-daemon threads joined, ``atexit`` run, Python's and C's output flushed. What the server
printed while importing torch (a warning, say) goes nowhere: a fresh agent writes it to the
run's torchrun log.

``DDP_LESSON_FORKSERVER=0`` in the run's environment turns it off (a fresh agent per run, as
torchrun starts them), and so does any failure of the server: :func:`spawn_agent` returns None
and the caller starts the agent itself. Linux only (``fork``, ``SOCK_SEQPACKET``, ``prctl``).

Protocol (a ``SOCK_SEQPACKET`` socket pair: one pickled message per packet):
client ``("spawn", id, argv, env, cwd, umask, cpu_affinity)`` with the output file's
descriptor attached;
server ``("spawned", id, pid)`` or ``("failed", id, reason)``, and ``("exit", pid, code, cpu_s)``
when an agent ends (``code`` as ``Popen.returncode``: negative for a signal; ``cpu_s`` its user
and system CPU seconds with those of the ranks it reaped, from ``wait4``).
"""
from __future__ import annotations

import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from ..procs import LIBC, alive, die_with_parent, kill_pids

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
_MAX_PACKET = 1 << 20
_SPAWN_TIMEOUT_S = 120.0  # the first request waits for the server's import of torch


# --------------------------------------------------------------------------------- client

def _server_command() -> list[str]:
    """The server's command; it is given its end of the socket and the client's pid."""
    return [sys.executable, "-m", "ddp_lesson.launch.forkserver"]


class ForkedAgent:
    """A forked agent, as the launcher uses a ``subprocess.Popen``: ``pid`` (also its process
    group's id), ``returncode`` (None while it runs), :meth:`poll` and :meth:`wait_exit`."""

    def __init__(self, server: _Server, pid: int):
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the agent has ended (negative: killed by that signal), else None."""
        self.wait_exit(0.0)
        return self.returncode

    def wait_exit(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the agent to end; True once it has (``returncode`` set)."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, seconds)
        return self.returncode is not None


class _Server:
    """The client's end: one server process, one reader thread, requests from any thread."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(  # in "/": it holds no folder of the launcher's
                [*_server_command(), str(theirs.fileno()), str(os.getpid())],
                env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.import_env = {k: env.get(k) for k in IMPORT_TIME}
        self.sock = ours
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.replies: dict[int, tuple] = {}
        self.exits: dict[int, int] = {}
        self.abandoned: set[int] = set()  # requests nobody waits for any more
        self.served = 0
        self.retired = False  # it answered too slowly: no new requests
        self.alive = True
        self.next_id = 0
        threading.Thread(target=self._read, name="ddp-lesson-forkserver", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(_MAX_PACKET)
                if not data:
                    break
                msg = pickle.loads(data)
                with self.cond:
                    if msg[0] == "exit":
                        self.exits[msg[1]] = msg[2]
                        _totals["agents_cpu_s"] += msg[3]
                        self.cond.notify_all()
                        continue
                    if msg[0] == "spawned":  # a reused pid: forget the earlier agent's end
                        self.exits.pop(msg[2], None)
                    if msg[1] is None:  # a request it could not read: no one to tell
                        continue
                    if msg[1] in self.abandoned:
                        self.abandoned.discard(msg[1])
                        if msg[0] == "spawned":
                            kill_pids([msg[2]])
                    else:
                        self.replies[msg[1]] = msg
                        self.cond.notify_all()
        except (OSError, pickle.UnpicklingError, EOFError):
            pass
        finally:
            with self.cond:  # the socket stays open: another thread may be sending on it
                self.alive = False
                self.cond.notify_all()
            try:  # reap the server
                self.proc.wait(5)
            except (subprocess.TimeoutExpired, OSError):
                pass

    def spawn(self, argv: list[str], env: dict, cwd: str, out_fd: int, ready=None
              ) -> ForkedAgent | None:
        """Ask for one agent; None when the server cannot give it (the caller starts one).

        ``ready()`` (optional) is asked while waiting: False gives up (the run was cancelled
        or timed out; the caller sees why). An interrupt gives up too, and is re-raised. An
        agent forked for a request given up is killed when the reply comes.
        """
        with self.cond:
            if not self.alive or self.retired or (ready is not None and not ready()):
                return None
            self.next_id += 1
            req = self.next_id
        msg = pickle.dumps(("spawn", req, argv, env, cwd, _umask(), _affinity()))
        deadline = time.monotonic() + _SPAWN_TIMEOUT_S
        try:
            with self.send_lock:
                socket.send_fds(self.sock, [msg], [out_fd])
            with self.cond:
                while not (req in self.replies or not self.alive):
                    left = deadline - time.monotonic()
                    if left <= 0 or (ready is not None and not ready()):
                        break
                    self.cond.wait(min(left, 0.25))
        except OSError:  # the server is gone
            self._abandon(req)
            return None
        except BaseException:  # an interrupt: the agent, forked for nobody, is killed
            reply = self._abandon(req)
            if reply is not None and reply[0] == "spawned":
                kill_pids([reply[2]])
            raise
        reply = self._abandon(req)
        if reply is not None and reply[0] == "spawned":
            self.served += 1
            return ForkedAgent(self, reply[2])
        if reply is None and self.alive and time.monotonic() >= deadline:
            # no answer in time (a machine this loaded?): no more requests to this server; it
            # ends once its agents still running have (a new server takes the next runs)
            self.retired = True
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return None

    def _abandon(self, req: int) -> tuple | None:
        """The reply to ``req`` if it came; else the reader will kill what it brings."""
        with self.cond:
            reply = self.replies.pop(req, None)
            if reply is None:
                self.abandoned.add(req)
            return reply

    def exit_code(self, pid: int, seconds: float) -> int | None:
        """``pid``'s exit code, waiting up to ``seconds``; None if it still runs. If the server
        died, its agents died with it (SIGKILL): -9 once the pid is gone."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits or not self.alive, seconds)
            if pid in self.exits:
                return self.exits[pid]
            if self.alive:  # the server reaps it and says so
                return None
        if not alive(pid):
            return -signal.SIGKILL
        return None


_server: _Server | None = None
_server_lock = threading.Lock()
_totals = {"agents_cpu_s": 0.0}  # of every server of this process


def _forget_server() -> None:  # a forked child of a launching process starts its own
    global _server, _server_lock
    _server, _server_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_server)


def _umask() -> int | None:
    """This process's umask, read without changing it (``/proc/self/status``, Linux >= 4.7)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _affinity() -> set[int] | None:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def spawn_agent(cmd: list[str], env: dict, cwd, out_fd: int, ready=None
                ) -> ForkedAgent | None:
    """Start the torchrun agent ``cmd`` forked from this process's server, or say it cannot.

    ``cmd`` must be ``[sys.executable, "-m", "ddp_lesson.launch.agent", *argv]``; its output
    (stdout and stderr) goes to ``out_fd``, its input is ``/dev/null``; ``cwd`` None is this
    process's current directory. Starts the server on the first call (it imports torch: about
    1.5 CPU-s, once per launching process), which that call waits for. ``ready`` (optional, a
    function) is asked while waiting: False gives up (a cancelled or timed-out run).

    Returns:
        A :class:`ForkedAgent`, or None: not Linux, another command, ``DDP_LESSON_FORKSERVER=0``
        in ``env``, a variable of :data:`IMPORT_TIME` that differs from the server's, a ``cwd``
        that is not a folder (the caller's own start reports it), ``ready`` said False, or a
        server that failed (one that died before forking any agent is not started again in
        this process). The caller then starts the agent itself (or ends the run).
    """
    global _server
    if (not sys.platform.startswith("linux") or cmd[:3] != _AGENT_ARGV0
            or env.get(SWITCH_ENV, os.environ.get(SWITCH_ENV)) == "0"):
        return None
    try:  # the server's folder is "/": a relative cwd means the launcher's folder
        cwd = os.path.abspath(os.getcwd() if cwd is None else os.fspath(cwd))
    except OSError:  # the launcher's folder was removed: Popen reports what it will
        return None
    if not (os.path.isdir(cwd) and os.access(cwd, os.X_OK)):
        return None
    if any(env.get(k) != os.environ.get(k) for k in IMPORT_TIME):
        return None  # the server has this process's environment
    with _server_lock:
        if _server is not None and not _server.alive and not _server.served:
            return None  # it died before forking anything: it would again
        if _server is None or not _server.alive or _server.retired:
            try:  # this process's environment, and the run's import path (this package)
                _server = _Server(dict(os.environ, PYTHONPATH=env.get("PYTHONPATH", "")))
            except OSError:
                return None
        server = _server
    if server.import_env != {k: env.get(k) for k in IMPORT_TIME}:
        return None
    return server.spawn(cmd[3:], env, cwd, out_fd, ready)


def agents_cpu_s() -> float:
    """CPU seconds (user + system) of the agents this process's server forked and that have
    ended, their ranks included: what ``getrusage(RUSAGE_CHILDREN)`` does not count, as they
    are not this process's children (every server of this process, one after another)."""
    return _totals["agents_cpu_s"]


# --------------------------------------------------------------------------------- server

_made_loggers: list[str] = []  # the loggers torch's elastic get_logger made (LOGLEVEL)
_BASE_PATH: list[str] = []  # the server's sys.path without its folder and its PYTHONPATH


def _path_key(path: str) -> str:
    """A folder of ``sys.path`` compared by what it names (the server's folder is "/": Python
    makes a relative entry ``//rel``)."""
    return "/" + os.path.realpath(path).lstrip("/")


def _preload() -> None:
    """Import what every agent imports, recording the loggers ``get_logger`` sets a level on."""
    import torch.distributed.elastic.utils.logging as elastic_logging

    setup = elastic_logging._setup_logger

    def recorded(name=None):
        logger = setup(name)
        _made_loggers.append(logger.name)
        return logger

    elastic_logging._setup_logger = recorded
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.run  # noqa: F401

    import ddp_lesson.launch.agent  # noqa: F401
    elastic_logging._setup_logger = setup


def _become(env: dict, cwd: str, umask: int | None, affinity) -> None:
    """In the forked child: the process state a fresh Python of the run would start with."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if umask is not None:
        os.umask(umask)
    if affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, affinity)
    path = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [*([] if env.get("PYTHONSAFEPATH") else [cwd]), *path, *_BASE_PATH]
    if env.get("PYTHONUNBUFFERED"):  # as -u: stdout unbuffered
        try:
            sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False),
                                          encoding=sys.stdout.encoding,
                                          errors=sys.stdout.errors, write_through=True)
        except (AttributeError, OSError, ValueError):
            pass
    import logging
    import random

    random.seed()
    from torch.distributed.elastic.utils.logging import get_log_level

    level = os.environ.get("LOGLEVEL", get_log_level())
    for name in _made_loggers:
        logging.getLogger(name).setLevel(level)


def _run_agent(argv: list[str]) -> tuple[int, bool]:
    """Run the agent as ``python -m`` would: ``(exit status, killed by SIGINT)``."""
    from ddp_lesson.launch import agent

    sys.argv = [agent.__file__, *argv]
    try:
        agent.main(argv)
    except SystemExit as exc:  # as the interpreter ends a program that raised it
        if exc.code is None:
            return 0, False
        if isinstance(exc.code, int):
            return exc.code & 0xFF, False
        print(exc.code, file=sys.stderr)
        return 1, False
    except KeyboardInterrupt:  # the interpreter prints it, then dies of SIGINT
        sys.excepthook(*sys.exc_info())
        return 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1, False
    return 0, False


def _agent(sock: socket.socket, wake: tuple[int, int], request: tuple, out_fd: int,
           server_pid: int) -> None:
    """In the forked child: become the agent a fresh ``python -m ddp_lesson.launch.agent``
    would be, run it, exit with its code. Never returns (the caller exits if it does)."""
    _, _, argv, env, cwd, umask, affinity = request
    code, sigint = 1, False
    try:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        die_with_parent(server_pid)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        for fd in (null, out_fd):
            os.close(fd)
        _become(env, cwd, umask, affinity)
        code, sigint = _run_agent(argv)
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
        import atexit

        atexit._run_exitfuncs()
        import logging

        logging.shutdown()
    except BaseException:  # the fork's own set-up failed: say so where the agent's output goes
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
    finally:
        _exit(code, sigint)


def _flush() -> None:
    """Flush Python's and C's buffered output."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    if LIBC is not None:
        LIBC.fflush(None)


def _exit(code: int, sigint: bool) -> None:
    """Flush Python's and C's output, then end this process: by SIGINT, or with ``code``."""
    try:
        _flush()
        if sigint:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code)


def _send(sock: socket.socket, msg: tuple) -> None:
    sock.send(pickle.dumps(msg))


def _fork(sock: socket.socket, wake: tuple[int, int], request: tuple, out_fd: int) -> int:
    """Fork one agent for ``request``; its pid (also its process group's id)."""
    server_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _agent(sock, wake, request, out_fd, server_pid)
        finally:
            os._exit(1)
    try:  # as the child does: its group exists before anyone signals it
        os.setpgid(pid, pid)
    except OSError:
        pass
    return pid


def serve(fd: int, client_pid: int) -> None:
    """The server's loop: fork an agent per request, report each agent's end; leave when the
    client has died (its agents die with the server), or once it has closed its end and every
    agent has ended."""
    sock = socket.socket(fileno=fd)
    python_path = {_path_key(os.path.join("/", p))
                   for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    first = 0 if getattr(sys.flags, "safe_path", False) else 1  # sys.path[0]: the folder
    _BASE_PATH[:] = [p for p in sys.path[first:] if _path_key(p) not in python_path]
    _preload()
    _flush()  # what importing printed stays here, not in the first agent's run log
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    closed = False  # the client shut its end (it retired this server): finish, then leave
    try:
        while not (closed and not children):
            ready = select.select([wake_r] if closed else [sock, wake_r], [], [], 5.0)[0]
            if wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            for pid in list(children):
                try:
                    done, status, usage = os.wait4(pid, os.WNOHANG)
                    cpu = usage.ru_utime + usage.ru_stime  # its ranks' too: it reaped them
                except ChildProcessError:
                    done, status, cpu = pid, 255 << 8, 0.0
                if done:
                    children.discard(pid)
                    _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status), cpu))
            if os.getppid() != client_pid:  # the client died
                return
            if sock not in ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 4)
            if not data:
                closed = True
                continue
            req = None
            try:
                request = pickle.loads(data)
                req = request[1]
                if len(fds) != 1:
                    raise ValueError(f"expected 1 file descriptor, got {len(fds)}")
                pid = _fork(sock, (wake_r, wake_w), request, fds[0])
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001 -- this request fails, not the others
                _send(sock, ("failed", req, repr(exc)))
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            children.add(pid)
            _send(sock, ("spawned", req, pid))
    except (BrokenPipeError, ConnectionResetError):
        return


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
