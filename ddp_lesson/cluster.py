"""Persistent ranks for notebooks: ipyparallel engines launched by torchrun, and ``%%ranks`` cells.

A ``%%torchrun`` cell is a fresh job that runs and forgets; for exploring (a model on every rank
in one cell, backward in the next, ``p.grad`` on each rank, all-reduce, look again) the ranks
keep their state between cells. This module starts an ipyparallel controller on 127.0.0.1
(schedulers in threads, files in a private temporary folder) and ``nnodes`` torchrun agents
(``python -m ddp_lesson.launch.agent``, flags and loopback stores as ``run_torchrun``'s), each
starting ``nproc_per_node`` ipyparallel engines (``-m ddp_lesson.cluster engine``), so every
engine has a real rank's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...). Each joins
the process group once (:func:`ddp_lesson.env.init_distributed`, the series' backend rule);
its namespace starts with ``torch``, ``dist``, ``env`` (its :class:`~ddp_lesson.env.DistEnv`),
``rank``, ``local_rank`` and ``world_size``.

Notebook face (``%load_ext ddp_lesson``)::

    %dist_start --nproc-per-node 2          # one line: ranks, backend, why
    %%ranks                                 # the cell on every rank, output in rank order
    %%ranks --rank 0 / --ranks 0,2          # on some ranks
    %dist_status
    %dist_stop

Python face: ``with Cluster(nproc_per_node=2) as c: c.run("print(rank)")``
-> ``{0: "0\\n", 1: "1\\n"}``.

Output: during every cell, fds 1 and 2 are captured with ``sys.stdout``/``sys.stderr``
(:func:`ddp_lesson.launch.fdcapture.capture_cells`), so ``os.write(1, ...)``, ``os.system`` and
subprocesses come in program order with the prints, drained before the cell returns
(docs/pitfalls.md C11).

Failures and hangs:

* a rank that raises makes the cell raise :class:`RanksError` (failed ranks in rank order, with
  tracebacks); the ranks keep their state;
* if the others are still running :data:`PEER_FAILURE_GRACE_S` after it, they are taken to be
  blocked in a collective waiting for it (its engine lives on, so gloo sees no closed
  connection): :class:`RanksError` at once, naming them, and a restart as after a timeout;
* a cell that outlives its timeout raises :class:`RanksTimeout` naming the ranks still running;
  a rank blocked in a collective cannot be interrupted from Python, so the cluster is
  **restarted cleanly** (every process ended, a fresh one of the same shape, state lost);
* a kernel interrupt sends SIGINT to the running ranks; if they come back within
  :data:`INTERRUPT_GRACE_S` the cluster is kept, else restarted.

No process outlives its owner (:mod:`ddp_lesson.procs`): controller and torchrun get
``PR_SET_PDEATHSIG``, every engine against its agent, and a watchdog (own session, reading a pipe
only the owner writes) kills what is left and removes the folder when the owner dies (SIGKILL
included). ``stop()`` destroys the process group (barrier, ``destroy_process_group``) before the
engines exit with status 0, then stops the controller and removes the folder.

Benchmark: ``python -m ddp_lesson.bench.cluster`` writes ``benchmarks/cluster.csv``.
Sources: ipyparallel (https://ipyparallel.readthedocs.io), torchrun
(https://pytorch.org/docs/stable/elastic/run.html).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .env import BACKEND_ENV, BACKENDS, choose_backend
from .launch.command import loopback_env, rendezvous_store, torchrun_flags, validate_launch
from .launch.output import ranks_word
from .procs import alive, die_with_parent, kill_pids, reap, release_watchdog, start_watchdog

#: Seconds a ``%%ranks`` cell may run before its verdict (override per cell with ``--timeout``).
DEFAULT_RUN_TIMEOUT_S = 120.0
#: Seconds ``start()`` may take: controller up, engines registered, process group joined.
DEFAULT_START_TIMEOUT_S = 120.0
#: The process group's own collective timeout on every engine. Longer than a cell's timeout on
#: purpose: a hang is ended by the cell's verdict (and a restart), not by a gloo error.
PROCESS_GROUP_TIMEOUT_S = 600.0
#: After an interrupt, seconds the ranks get to come back before the cluster is restarted.
INTERRUPT_GRACE_S = 5.0
#: After a rank raised, seconds the other ranks of the cell get to finish (or fail too) before
#: they are taken to be blocked in a collective waiting for it and the cluster is restarted.
PEER_FAILURE_GRACE_S = 2.0
_POLL_S = 0.05
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TMP_PREFIX = "ddp_lesson_cluster_"


class RanksError(RuntimeError):
    """One or more ranks raised: ``failed`` (rank -> traceback), ``outputs`` (rank -> stdout),
    ``waiting`` (ranks still running, blocked waiting for a failed one), ``restarted``."""

    def __init__(self, message: str, failed: dict[int, str], outputs: dict[int, str],
                 waiting: list[int] | None = None, restarted: bool = False):
        super().__init__(message)
        self.failed = failed
        self.outputs = outputs
        self.waiting = list(waiting or [])
        self.restarted = restarted

    def _render_traceback_(self):  # IPython shows the ranks' tracebacks, not this module's frames
        lines = [f"RanksError: {self}"]
        for rank in sorted(self.failed):
            lines += ["", f"--- rank {rank} ---", *self.failed[rank].rstrip().splitlines()]
        return lines


class RanksTimeout(TimeoutError):
    """A cell outlived its timeout: ``waiting`` (ranks still running), ``outputs`` (printed so
    far), ``restarted`` (state lost)."""

    def __init__(self, message: str, waiting: list[int], outputs: dict[int, str], restarted: bool):
        super().__init__(message)
        self.waiting = waiting
        self.outputs = outputs
        self.restarted = restarted

    def _render_traceback_(self):  # IPython shows the verdict, not this module's frames
        return [f"RanksTimeout: {self}"]


@dataclass
class RanksResult:
    """What a cell left on each rank: stdout (plus the last expression's value), stderr, errors."""

    outputs: dict[int, str]
    errors: dict[int, str]
    failed: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def raise_failed(self, world_size: int) -> None:
        """Raise :class:`RanksError` naming the ranks that raised, if any (state kept)."""
        if self.failed:
            raise RanksError(_failure_summary(self.failed, world_size), self.failed, self.outputs)


# --------------------------------------------------------------------------- process helpers

def _end(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL after ``grace_s``; reap it."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.returncode is not None:
            break
        kill_pids([proc.pid], sig)  # not reaped yet: the pid is still this child's
        if reap(proc, wait):
            break
    with suppress(ProcessLookupError, PermissionError):  # children it forked into its group
        os.killpg(proc.pid, signal.SIGKILL)  # (the controller forks one) and left behind


def _engine_main(argv: list[str]) -> None:
    """``python -m ddp_lesson.cluster engine ARGS``: an ipyparallel engine that dies with
    torchrun (``PR_SET_PDEATHSIG``: torchrun puts each worker in a session of its own)."""
    die_with_parent()  # leaves at once if torchrun died before this line
    # the controller is still coming up: wait for its engine file to be complete JSON
    import torch.distributed  # noqa: F401  (the first cell's import, done while we wait)

    url_file = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--file=")))
    while "registration" not in (_read_json(url_file) or {}):
        time.sleep(0.05)
    from ipyparallel.engine.app import main

    sys.argv = ["ipengine", *argv]
    main()


# --------------------------------------------------------------------------- the cluster

# Run once on every engine after registration (all at once: joining the group synchronises).
_INIT = """\
import os, json
import torch
import torch.distributed as dist
from ddp_lesson.env import init_distributed as _init_distributed
from ddp_lesson.launch.fdcapture import capture_cells as _capture_cells
_capture_cells(get_ipython())  # from the next cell on: fds 1 and 2 in order with prints (C11)
env = _init_distributed(timeout={pg_timeout!r}, backend={backend!r}, announce=False)
rank, local_rank, world_size = env.rank, env.local_rank, env.world_size
print(json.dumps({{"rank": rank, "pid": os.getpid(), "backend": env.backend, "reason": env.reason,
                  "world_size": world_size}}))
"""
# Clean exit of an engine: leave the process group (barrier + destroy), then exit with status 0
# without interpreter teardown (the engine's own shutdown path exits with status 1; gloo can
# abort when its threads are torn down at exit, see ddp_lesson._worker).
_CLEANUP = "from ddp_lesson.env import cleanup as _cleanup\n_cleanup()\n"
_EXIT = "import os, sys\nsys.stdout.flush(); sys.stderr.flush()\nos._exit(0)\n"


class Cluster:
    """``world_size = nnodes * nproc_per_node`` persistent ranks: ipyparallel engines under
    torchrun. A context manager, or :meth:`start` and :meth:`stop`; not thread-safe.

    Args:
        nproc_per_node: engines per simulated node (torchrun's ``--nproc-per-node``), >= 1.
        nnodes: torchrun agents on this host, joined by c10d rendezvous on 127.0.0.1, >= 1.
        backend: ``"auto"``, ``"gloo"``, ``"nccl"``; None reads ``DDP_LESSON_BACKEND``, else auto.
        timeout: seconds :meth:`start` may take (controller, engines, process group), > 0.
        cwd, env: the engines' working directory and base environment (default: this process's).

    Raises:
        ValueError: bad sizes or backend, named with their values.
    """

    def __init__(self, nproc_per_node: int = 2, nnodes: int = 1, backend: str | None = None,
                 timeout: float = DEFAULT_START_TIMEOUT_S, cwd=None, env: dict | None = None):
        if timeout is None:  # the launcher allows no timeout; a cluster's start needs one
            raise ValueError("timeout must be > 0 seconds, got None")
        validate_launch(nproc_per_node, nnodes, 0, timeout)  # the launcher's own checks
        if backend is not None and backend.lower() not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.nproc_per_node, self.nnodes = nproc_per_node, nnodes
        self.world_size = nproc_per_node * nnodes
        self.requested_backend = backend
        self.timeout = float(timeout)
        self.cwd = os.getcwd() if cwd is None else str(cwd)
        self.base_env = env
        self.backend: str | None = None
        self.reason: str | None = None
        self.restarts = 0
        #: torchrun's exit status per agent at the last stop (0: every engine left cleanly).
        self.exit_codes: list[int | None] = []
        #: seconds from the start of the last start() to each phase's end (benchmarks read it).
        self.timings: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.folder: Path | None = None
        self.client = None
        self.controller: subprocess.Popen | None = None
        self.agents: list[subprocess.Popen] = []
        self.watchdog: subprocess.Popen | None = None
        self.store = None  # the agents' rendezvous store, alive while they run
        self.engine_pids: dict[int, int] = {}   # rank -> pid
        self.engine_ids: dict[int, int] = {}    # rank -> ipyparallel engine id

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self.client is not None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """Every process this cluster started: watchdog, controller, torchrun agents, engines."""
        procs = [self.watchdog, self.controller, *self.agents]
        return [p.pid for p in procs if p is not None] + list(self.engine_pids.values())

    def _write_pids(self) -> None:
        pids = [p for p in self.pids() if self.watchdog is None or p != self.watchdog.pid]
        tmp = self.folder / "cluster.pid.tmp"
        tmp.write_text(" ".join(map(str, pids)))
        os.replace(tmp, self.folder / "cluster.pid")  # what the watchdog kills

    def _child_env(self) -> dict:
        env = dict(os.environ if self.base_env is None else self.base_env)
        if self.requested_backend is not None:
            env[BACKEND_ENV] = self.requested_backend
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc_per_node)))
        env["IPYTHONDIR"] = str(self.folder / "ipython")
        # Everything the children write to a temp folder (torchrun's log dir included) lands
        # in the private folder, which is removed on stop or by the watchdog.
        env["TMPDIR"] = str(self.folder / "tmp")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(loopback_env(env))  # every rank is on this machine: stores and gloo on lo
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        return env

    def _popen(self, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(cmd, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=partial(die_with_parent, os.getpid()))

    def _log_tail(self, n: int = 30) -> str:
        lines = []
        for log in sorted(self.folder.glob("*.log")) if self.folder else []:
            text = log.read_text(errors="replace").strip().splitlines()
            lines += [f"{log.name}: {line}" for line in text[-n:]]
        return "\n".join(lines[-n:])

    def start(self) -> Cluster:
        """Start controller and engines, join the process group on every engine (synchronises);
        returns self, ``backend`` and ``reason`` (one line) set.

        Raises:
            ValueError: the backend cannot be used (e.g. nccl with fewer GPUs than processes).
            RuntimeError: not up within ``timeout`` s (with the logs' tail; all ended first).
        """
        if self.running:
            return self
        self.backend, self.reason = choose_backend(self.nproc_per_node, self.requested_backend)
        self.folder = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX))
        (self.folder / "tmp").mkdir()
        try:
            self._start(time.monotonic() + self.timeout)
        except BaseException:
            self._kill_all()
            raise
        atexit.register(self.stop)
        return self

    def _start(self, deadline: float) -> None:
        import ipyparallel as ipp

        t0 = time.monotonic()
        self.timings = {}
        env = self._child_env()
        self.watchdog = start_watchdog(self.folder, env)
        profile = self.folder / "profile"
        self.controller = self._popen(
            [sys.executable, "-m", "ipyparallel.controller", "--ip=127.0.0.1", "--usethreads",
             f"--profile-dir={profile}", "--log-level=WARN",
             # registration completes at the next heartbeat: every 0.5 s, not 3 s; 60 missed
             # beats (30 s, as the default 10 x 3 s) before an engine counts as dead
             "--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=60"],
            env, self.folder / "controller.log")
        self._write_pids()
        security = profile / "security"
        engine_file, client_file = (
            security / "ipcontroller-engine.json",
            security / "ipcontroller-client.json",
        )
        engine = ["-m", "ddp_lesson.cluster", "engine", f"--file={engine_file}",
                  f"--profile-dir={profile}", "--IPEngine.enable_nanny=False", "--log-level=WARN"]
        # torchrun's agents as run_torchrun starts them (ddp_lesson.launch.command)
        self.store, endpoint = rendezvous_store()
        common = dict(rdzv_endpoint=endpoint, rdzv_id=uuid.uuid4().hex[:8],
                      rdzv_conf="is_host=false", local_addr="127.0.0.1")
        commands = [[sys.executable, "-m", "ddp_lesson.launch.agent",
                     *torchrun_flags(self.nproc_per_node, self.nnodes,
                                     node_rank=node if self.nnodes > 1 else None, **common),
                     *engine] for node in range(self.nnodes)]
        for node, cmd in enumerate(commands):
            self.agents.append(self._popen(cmd, env, self.folder / f"torchrun{node}.log"))
        self._write_pids()
        self._wait_for(lambda: _read_json(client_file) is not None, deadline,
                       "the controller's connection files", [self.controller, *self.agents])
        self.timings["controller_ready_s"] = time.monotonic() - t0
        self.client = ipp.Client(url_file=str(client_file), profile_dir=str(profile), timeout=30)
        self._wait_for(lambda: len(self.client.ids) >= self.world_size, deadline,
                       f"{self.world_size} engines to register", [self.controller, *self.agents])
        self.timings["engines_registered_s"] = time.monotonic() - t0
        # Map engines to ranks, then join the process group on all of them at once.
        backend = self.requested_backend
        code = _INIT.format(pg_timeout=PROCESS_GROUP_TIMEOUT_S, backend=backend)
        ids = sorted(self.client.ids)[: self.world_size]
        ars = {eid: self.client[eid].execute(code, silent=False, block=False) for eid in ids}
        for eid, ar in ars.items():
            self._wait_for(
                ar.ready, deadline, "the process group to form", [self.controller, *self.agents]
            )
            ar.get()  # raises the engine's error, if any
            ar.wait_for_output(max(1.0, deadline - time.monotonic()))
            info = json.loads(ar.stdout.strip().splitlines()[-1])
            self.engine_ids[info["rank"]] = eid
            self.engine_pids[info["rank"]] = info["pid"]
            if info["rank"] == 0:
                self.backend, self.reason = info["backend"], info["reason"]
        self.timings["process_group_s"] = time.monotonic() - t0
        if sorted(self.engine_ids) != list(range(self.world_size)):
            raise RuntimeError(f"engines reported ranks {sorted(self.engine_ids)}, expected "
                               f"0..{self.world_size - 1}")
        self._write_pids()

    def _wait_for(self, predicate, deadline: float, what: str, procs) -> None:
        while not predicate():
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"cluster start failed while waiting for {what}: a process "
                                       f"exited with status {p.returncode}\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster start timed out after {self.timeout:g} s waiting for "
                                   f"{what}\n{self._log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Destroy the process group on every rank (``cleanup()``), let the engines and torchrun
        exit 0, stop the controller, remove the folder; kill what is still alive (a rank stuck in
        a collective). Idempotent; never raises."""
        if self.folder is None:
            return
        atexit.unregister(self.stop)
        try:
            if (self.client is not None and self.engine_ids
                    and all(p.poll() is None for p in self.agents)):
                with suppress(Exception):
                    if self._execute(_CLEANUP, sorted(self.engine_ids), 15.0) is not None:
                        for eid in self.engine_ids.values():
                            self.client[eid].execute(_EXIT, block=False)
                        for p in self.agents:
                            reap(p, 15.0)
        finally:
            self._kill_all()

    def _kill_all(self) -> None:
        """End every process this cluster started (SIGTERM, then SIGKILL) and remove the folder."""
        if self.client is not None:
            with suppress(Exception):
                self.client.close(linger=0)
            self.client = None
        for p in self.agents:
            _end(p)
        if self.agents:
            self.exit_codes = [p.returncode for p in self.agents]
        kill_pids(pid for pid in self.engine_pids.values() if alive(pid))
        _end(self.controller)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        release_watchdog(self.watchdog, 2.0)
        self._reset()

    def restart(self) -> Cluster:
        """End every process (state lost) and start a fresh cluster of the same shape."""
        self._kill_all()
        self.restarts += 1
        return self.start()

    def status(self) -> dict:
        """``{"running", "world_size", "nnodes", "nproc_per_node", "backend", "alive"}``,
        ``alive``: rank -> engine process alive."""
        return {"running": self.running, "world_size": self.world_size, "nnodes": self.nnodes,
                "nproc_per_node": self.nproc_per_node, "backend": self.backend,
                "alive": {r: alive(pid) for r, pid in sorted(self.engine_pids.items())}}

    # ---------------------------------------------------------------- running cells

    def _ranks(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int):
            ranks = [ranks]
        ranks = sorted({int(r) for r in ranks})
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or ranks} outside [0, {self.world_size - 1}]")
        return ranks

    def _submit(self, code: str, ranks: list[int]) -> dict:
        """Start ``code`` on ``ranks`` without waiting: {rank: AsyncResult}."""
        return {r: self.client[self.engine_ids[r]].execute(code, silent=False, block=False)
                for r in ranks}

    def _execute(self, code: str, ranks: list[int], timeout: float):
        """Run ``code`` on ``ranks``; {rank: AsyncResult} once all are done, None on timeout."""
        ars = self._submit(code, ranks)
        deadline = time.monotonic() + timeout
        while not all(ar.ready() for ar in ars.values()):
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        return ars

    def run_detailed(self, code: str, ranks=None, timeout: float | None = None) -> RanksResult:
        """Like :meth:`run`, but returns a :class:`RanksResult`; does not raise on rank errors."""
        if not self.running:
            raise RuntimeError("the cluster is not running: call start() (or %dist_start) first")
        ranks = self._ranks(ranks)
        timeout = DEFAULT_RUN_TIMEOUT_S if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        start = time.monotonic()
        ars = self._submit(code, ranks)
        deadline, first_failure = start + timeout, None
        try:
            while True:
                pending = [ar for ar in ars.values() if not ar.ready()]
                if not pending:
                    break
                if first_failure is None and any(_raised(ar) for ar in ars.values()):
                    first_failure = time.monotonic()
                if first_failure is not None and (
                        time.monotonic() - first_failure > PEER_FAILURE_GRACE_S
                        or time.monotonic() > deadline):  # a timeout names the failure too
                    self._failed_while_peers_wait(ars)
                if time.monotonic() > deadline:
                    self._hung(ars, timeout)
                for r in ranks:
                    if not alive(self.engine_pids[r]):
                        self._died(ars, r)
                pending[0].wait(_POLL_S)  # returns as soon as that rank is done
        except KeyboardInterrupt:
            self._interrupted(ars)
            raise
        result = RanksResult({}, {}, wall_s=time.monotonic() - start)
        for r, ar in ars.items():
            ar.wait_for_output(5.0)
            result.outputs[r] = _text_output(ar)
            result.errors[r] = ar.stderr or ""
            if _raised(ar):
                result.failed[r] = _error_text(ar)
        return result

    def run(self, code: str, ranks=None, timeout: float | None = None) -> dict[int, str]:
        """Run ``code`` (IPython cell source) on ``ranks`` (an int, ints, or None: all), each in
        its namespace from the previous cells; collectives synchronise the ranks that call them
        (a cell with a collective on some ranks only hangs until the timeout).

        Returns:
            ``{rank: output}`` in rank order: what the rank printed, then the last expression's
            value as IPython would show it.

        Raises:
            ValueError: a rank outside ``[0, world_size)``, or a timeout <= 0.
            RanksError: a rank raised (state kept); or, with the others still running
                :data:`PEER_FAILURE_GRACE_S` later, naming them after a restart (one line on
                stderr says so first).
            RanksTimeout: ranks still running after ``timeout`` s (default
                :data:`DEFAULT_RUN_TIMEOUT_S`); restarted.
            KeyboardInterrupt: after interrupting the running ranks (see the module docstring).
        """
        result = self.run_detailed(code, ranks, timeout)
        result.raise_failed(self.world_size)
        return result.outputs

    def _hung(self, ars: dict, timeout: float) -> None:
        waiting = [r for r, ar in ars.items() if not ar.ready()]
        done = [r for r in ars if r not in waiting]
        outputs = self._outputs_then_restart(ars)
        raise RanksTimeout(
            f"{ranks_word(waiting)} still running after {timeout:g} s"
            + (f" ({ranks_word(done)} finished)" if done else "")
            + ": probably waiting in a collective that other ranks never reached. "
            "A rank blocked in "
            f"a collective cannot be interrupted, so the cluster was restarted: {self.world_size} "
            "fresh ranks, state lost",
            waiting,
            outputs,
            restarted=True,
        )

    def _failed_while_peers_wait(self, ars: dict) -> None:
        """A rank raised and the others are still running: name it now, restart the cluster."""
        failed = {r: _error_text(ar) for r, ar in ars.items() if _raised(ar)}
        waiting = [r for r, ar in ars.items() if not ar.ready()]
        # the restart takes seconds: say at once what happened (the error follows it)
        print(f"[ranks] {ranks_word(failed)} raised; {ranks_word(waiting)} still waiting: "
              "restarting the cluster", file=sys.stderr, flush=True)
        outputs = self._outputs_then_restart(ars)
        raise RanksError(
            _failure_summary(failed, self.world_size, kept=False)
            + f"; {ranks_word(waiting)} still running after it: "
            f"probably blocked in a collective waiting for {ranks_word(failed)}. A rank "
            f"blocked in a collective cannot be interrupted, so the cluster was restarted: "
            f"{self.world_size} fresh ranks, state lost",
            failed,
            outputs,
            waiting=waiting,
            restarted=True,
        )

    def _outputs_then_restart(self, ars: dict) -> dict[int, str]:
        """What each rank of the cell printed so far; then the cluster is restarted."""
        outputs = {r: _text_output(ar) for r, ar in ars.items()}
        self.restart()
        return outputs

    def _died(self, ars: dict, rank: int) -> None:
        outputs = self._outputs_then_restart(ars)
        raise RanksError(f"rank {rank}'s process died during the cell; the cluster was restarted "
                         f"({self.world_size} fresh ranks, state lost)",
                         {rank: "process died"}, outputs)

    def _interrupted(self, ars: dict) -> None:
        running = [r for r, ar in ars.items() if not ar.ready()]
        for r in running:
            with suppress(OSError):
                os.kill(self.engine_pids[r], signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while not all(ar.ready() for ar in ars.values()):
            if time.monotonic() > deadline:
                self.restart()
                print(
                    f"[ranks] {ranks_word([r for r, a in ars.items() if not a.ready()])} did "
                    f"not stop within {INTERRUPT_GRACE_S:g} s of the interrupt: cluster restarted "
                    "(state lost)",
                    file=sys.stderr,
                )
                return
            time.sleep(_POLL_S)
        print(f"[ranks] interrupted {ranks_word(running)}; the cluster keeps its state",
              file=sys.stderr)


def _read_json(path: Path):
    """``path``'s JSON, or None while it is missing or incomplete (not written atomically)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _text_output(ar) -> str:
    """stdout, then the last expression's text form, as a notebook cell would show them."""
    text = ar.stdout or ""
    res = ar.metadata.get("execute_result")
    if res:
        value = res.get("data", {}).get("text/plain", "")
        if value:
            text += value + ("" if value.endswith("\n") else "\n")
    return text


def _raised(ar) -> bool:
    """The rank's cell is done and raised."""
    return ar.ready() and ar.metadata.get("error") is not None


def _error_text(ar) -> str:
    """The traceback of a rank's cell that raised, as plain text."""
    err = ar.metadata["error"]
    return _ANSI.sub("", err.traceback or f"{err.ename}: {err.evalue}")


def _failure_summary(failed: dict[int, str], world_size: int, kept: bool = True) -> str:
    last = {}
    for r, tb in failed.items():
        lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
        last[r] = lines[-1].strip() if lines else "error"
    ranks = sorted(failed)
    detail = "; ".join(f"rank {r}: {last[r]}" for r in ranks)
    return (f"{ranks_word(ranks)} of {world_size} failed ({detail})"
            + ("; the ranks keep their state" if kept else ""))


# --------------------------------------------------------------------------- magics

_CURRENT: Cluster | None = None


def current() -> Cluster | None:
    """The cluster started by ``%dist_start`` (None when none runs)."""
    return _CURRENT if _CURRENT is not None and _CURRENT.running else None


def _start_line(c: Cluster) -> str:
    shape = f"{c.nnodes} node{'s' if c.nnodes > 1 else ''} x {c.nproc_per_node}"
    return f"[dist_start] {c.world_size} ranks ({shape}), {c.backend}: {c.reason}"


def _parser(prog: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)


def dist_start_magic(line: str) -> None:
    """``%dist_start --nproc-per-node N [--nnodes M] [--backend auto|gloo|nccl] [--timeout S]``:
    (re)start the persistent ranks; prints one line: ranks, backend and why."""
    global _CURRENT
    p = _parser("%dist_start")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--backend", choices=BACKENDS, default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    opts = _parse(p, line)
    if _CURRENT is not None:
        _CURRENT.stop()
        _CURRENT = None
    cluster = Cluster(opts.nproc_per_node, opts.nnodes, opts.backend, opts.timeout)
    cluster.start()
    _CURRENT = cluster
    print(_start_line(cluster))


def _parse(p: argparse.ArgumentParser, line: str):
    try:
        opts, rest = p.parse_known_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"could not parse {p.prog} options {line!r}: {e}") from None
    if rest:
        raise ValueError(f"{p.prog}: unknown options {' '.join(rest)}")
    return opts


def ranks_magic(line: str, cell: str) -> None:
    """``%%ranks [--rank R | --ranks 0,2] [--timeout S] [--show-stderr]``: the cell on the ranks.

    Each rank's output in rank order, lines tagged ``[rank N]`` (fd 1 in program order with the
    prints; ``--show-stderr``: fd 2 after it). Failures and timeouts as :meth:`Cluster.run`.
    """
    from .launch import format_rank_outputs

    p = _parser("%%ranks")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--rank", type=int, default=None)
    group.add_argument("--ranks", default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S)
    p.add_argument("--show-stderr", action="store_true")
    opts = _parse(p, line)
    cluster = current()
    if cluster is None:
        raise RuntimeError("no ranks are running: start them with %dist_start --nproc-per-node 2")
    ranks = None
    if opts.rank is not None:
        ranks = [opts.rank]
    elif opts.ranks is not None:
        try:
            ranks = [int(r) for r in opts.ranks.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--ranks {opts.ranks!r}: give integers, e.g. --ranks 0,2") from None
    try:
        result = cluster.run_detailed(cell, ranks, opts.timeout)
    except (RanksTimeout, RanksError) as e:  # the cluster was restarted: what ran is shown
        print(format_rank_outputs(e.outputs), end="")
        raise
    print(format_rank_outputs(result.outputs), end="")
    if opts.show_stderr:
        err = format_rank_outputs({r: t for r, t in result.errors.items() if t.strip()})
        if err:
            print(err, end="", file=sys.stderr)
    result.raise_failed(cluster.world_size)


def dist_stop_magic(line: str = "") -> None:
    """``%dist_stop``: destroy the process group, stop engines and controller, remove temp files."""
    global _CURRENT
    if _CURRENT is None or not _CURRENT.running:
        print("[dist_stop] no ranks running")
        _CURRENT = None
        return
    n = _CURRENT.world_size
    _CURRENT.stop()
    _CURRENT = None
    print(f"[dist_stop] {n} ranks stopped: process group destroyed, engines and controller ended")


def dist_status_magic(line: str = "") -> None:
    """``%dist_status``: whether ranks are running, how many, the backend, which are alive."""
    c = current()
    if c is None:
        print("[dist_status] no ranks running")
        return
    st = c.status()
    alive = [r for r, ok in st["alive"].items() if ok]
    print(f"[dist_status] {st['world_size']} ranks ({st['nnodes']} x {st['nproc_per_node']}), "
          f"{st['backend']}; alive: {', '.join(map(str, alive)) or 'none'}")


def load_ipython_extension(ipython) -> None:
    """Register ``%dist_start``, ``%%ranks``, ``%dist_stop``, ``%dist_status``."""
    ipython.register_magic_function(dist_start_magic, magic_kind="line", magic_name="dist_start")
    ipython.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
    ipython.register_magic_function(dist_stop_magic, magic_kind="line", magic_name="dist_stop")
    ipython.register_magic_function(dist_status_magic, magic_kind="line", magic_name="dist_status")


def main(argv: list[str] | None = None) -> None:
    """``python -m ddp_lesson.cluster engine ...``: an engine under torchrun (the Cluster's own
    entry point; the benchmark is ``python -m ddp_lesson.bench.cluster``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        _engine_main(argv[1:])
        return
    raise SystemExit("usage: python -m ddp_lesson.cluster engine ... (started by Cluster.start;"
                     " the benchmark is python -m ddp_lesson.bench.cluster)")


if __name__ == "__main__":
    main()
