"""Start a run, watch it, end it: timeouts, interrupts, the watchdog, every process reaped.

:func:`run_torchrun` (one run) and :func:`run_torchrun_many` (several at once) build a run
(:mod:`.command`), start its torchrun agents, supervise them (:func:`_supervise`) and read
what they left (:mod:`.output`).
"""
from __future__ import annotations

import inspect
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from ..procs import die_with_parent, folder_pids, kill_pids, reap, release_watchdog, start_watchdog
from .command import Launch, build_launch, validate_launch
from .forkserver import spawn_agent
from .output import (
    CELL_LABEL,
    LiveStatus,
    TorchrunError,
    TorchrunInterrupted,
    TorchrunResult,
    TorchrunTimeout,
    clean_traceback,
    collect_outputs,
    first_failures,
    progress_line,
    ranks_word,
    read_failed_ranks,
    status_text,
)

DEFAULT_TIMEOUT_S = 300.0

_POLL_S = 0.25
#: Seconds the agents get after SIGTERM before SIGKILL: torchrun's agent gives its workers 30 s
#: (``LocalElasticAgent._shutdown(timeout=30)``, torch/distributed/elastic/agent/server/
#: local_elastic_agent.py) for a SIGTERM handler (a preemption checkpoint), plus a few seconds
#: for the agent; ranks without a handler die at once.
_TERM_GRACE_S = 35.0


def _terminate(procs: list[subprocess.Popen], outdir: Path) -> None:
    """End torchrun agents and every process group of the run (see the module docstring)."""
    for p in procs:
        if p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        if not reap(p, max(0.1, deadline - time.monotonic())):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            reap(p, 10.0)
    # workers live in sessions of their own, and so may processes they started
    kill_pids(folder_pids(str(outdir)))


def _start(launch: Launch, errfiles, ready=None, procs: list | None = None) -> list:
    """Start one torchrun agent per command, each in a process group of its own, dying with us:
    forked from the fork server (:mod:`.forkserver`, torch imported once), else ``Popen`` in a
    session of its own. ``ready()`` False (cancelled, timed out) stops starting: fewer agents
    come back. Each is appended to ``procs`` as it starts (an interrupt leaves the caller all).
    """
    procs = [] if procs is None else procs
    linux = sys.platform.startswith("linux")
    for cmd, err in zip(launch.commands, errfiles):
        proc = spawn_agent(cmd, launch.env, launch.cwd, err.fileno(), ready)
        if proc is None and ready is not None and not ready():
            break
        if proc is None:
            proc = subprocess.Popen(
                cmd, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL, stdout=err,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=partial(die_with_parent, os.getpid()) if linux else None)
        procs.append(proc)
        with open(launch.outdir / "agents.pid", "a") as f:  # for the watchdog
            f.write(f"{procs[-1].pid}\n")
    return procs


def _supervise(launch: Launch, timeout: float | None, status: LiveStatus, errfiles,
               cancel: threading.Event | None = None
               ) -> tuple[list[subprocess.Popen], bool, float]:
    """Start the agents and wait for them: ``(procs, timed_out, wall_s)``. On timeout,
    interrupt, ``cancel`` (:func:`run_torchrun_many`) or any exception every process is ended
    (the exception re-raised)."""
    start = time.monotonic()
    procs = []

    def ready() -> bool:
        return not (cancel is not None and cancel.is_set()) and (
            timeout is None or time.monotonic() - start <= timeout)

    try:
        _start(launch, errfiles, ready, procs)
        if len(procs) < len(launch.commands):  # gave up while the fork server started
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            _terminate(procs, launch.outdir)
            return procs, True, time.monotonic() - start
        while any(p.poll() is None for p in procs):
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed > timeout:
                _terminate(procs, launch.outdir)
                return procs, True, time.monotonic() - start
            if status.live:
                rank0 = progress_line(launch.outdir)
                status.update(f"{status_text(launch.total)}, at {elapsed:.0f} s"
                              + (f" | rank 0: {rank0}" if rank0 else ""))
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _terminate(procs, launch.outdir)
        status.end("torchrun: interrupted; every process ended")
        raise TorchrunInterrupted() from None
    except BaseException:
        _terminate(procs, launch.outdir)
        status.end()
        raise
    return procs, False, time.monotonic() - start


def _collect_result(launch: Launch, procs, errfiles, wall: float
                    ) -> tuple[TorchrunResult, dict[int, int], dict[int, int]]:
    """Read what the run left in its folder: every rank's output, torchrun's own log, and
    the exit codes and failure times of the ranks whose own program failed."""
    launcher_stderr = ""
    for err in errfiles:
        err.seek(0)
        launcher_stderr += err.read().decode(errors="replace")
    outputs, errors, exits, times = collect_outputs(launch.outdir, launch.script)
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    return TorchrunResult(returncode, outputs, errors, launcher_stderr, launch.commands[0],
                          launch.equivalent, launch.backend, launch.reason, wall), exits, times


def _failure(launch: Launch, result: TorchrunResult, exits: dict[int, int],
             times: dict[int, int] | None = None) -> TorchrunError:
    """The error for a failed run: the root cause with its traceback, later failures as its
    consequences (:class:`TorchrunError`)."""
    failed = read_failed_ranks(result.launcher_stderr, result.errors, exits)
    result.failed_ranks = [r for r, _ in failed]
    if not failed:
        tb = clean_traceback(result.launcher_stderr, launch.script, CELL_LABEL)
        last = tb.strip().splitlines()[-1] if tb.strip() else ""
        return TorchrunError(f"torchrun failed (exit code {result.returncode})"
                             + (f": {last}" if last else ""), None, result.returncode, tb, result)
    codes = {r: (c if c is not None else result.returncode) for r, c in failed}
    times = times or {}
    order = first_failures(list(codes), times)
    # ranks without a record (killed by a signal) have no time: several are causes together
    unrecorded = [r for r in order if r not in times]
    causes = unrecorded if len(unrecorded) > 1 else order[:1]
    rank, later = causes[0], sorted(r for r in order if r not in causes)
    result.failed_rank = rank
    # the traceback: the first failing rank's, else the next failing rank that said why
    said = [r for r in order if result.errors.get(r, "").strip()] or [rank]
    tb = clean_traceback(result.errors.get(said[0], ""), launch.script, CELL_LABEL)
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    where = (f"{ranks_word(causes)} of {launch.total} failed" + (" first" if later else "")
             + f" ({_codes_word(causes, codes)})" + (f": {last}" if last else ""))
    if later:
        where += (f"; {ranks_word(later)} failed after "
                  f"{'it' if len(causes) == 1 else 'them'} ({_codes_word(later, codes)})")
    return TorchrunError(where, rank, codes[rank], tb, result, consequences=later)


def _codes_word(ranks: list[int], codes: dict[int, int]) -> str:
    return (f"exit code{'s' if len(ranks) > 1 else ''} "
            + ", ".join(str(codes[r]) for r in ranks))


def run_torchrun(target: str | None = None, args=(), *, code: str | None = None,
                 module: bool = False, nproc_per_node: int = 2, nnodes: int = 1,
                 max_restarts: int = 0, timeout: float | None = DEFAULT_TIMEOUT_S,
                 backend: str | None = None, env: dict | None = None, cwd=None,
                 live: bool | None = None, check: bool = True,
                 torchrun_args=(), _cancel: threading.Event | None = None) -> TorchrunResult:
    """Run a program on ``nnodes * nproc_per_node`` processes with torchrun, collect each output.

    Exactly one of ``code`` (source run as a script, as ``%%torchrun``), ``target`` with
    ``module=True`` (``torchrun -m NAME``) or ``target`` a script path, with ``args``. With
    ``nnodes > 1``, that many torchrun agents here, joined by c10d rendezvous on 127.0.0.1.

    Args:
        nproc_per_node, max_restarts: torchrun's ``--nproc-per-node``, ``--max-restarts``.
        timeout: wall-clock seconds for the whole run; None waits forever (not advised).
        backend: ``"auto"``, ``"gloo"``, ``"nccl"``; None reads ``DDP_LESSON_BACKEND``: chosen
            once, used by every rank.
        env, cwd: the workers' environment and folder (default: this process's).
        live: the live status line in a notebook kernel (None or True; False: never).
        check: raise :class:`TorchrunError` when a rank fails.
        torchrun_args: further torchrun flags, passed through unchanged.

    Returns:
        A :class:`TorchrunResult`; ``result.stdout`` is every rank's output in rank order.

    Raises:
        ValueError: bad arguments (named with their values).
        TorchrunError: a rank failed (``check=True``); carries its traceback.
        TorchrunTimeout: the run outlived ``timeout``; all processes were ended.
        TorchrunInterrupted: a ``KeyboardInterrupt``, raised after ending every process.
    """
    if (code is None) == (target is None):
        raise ValueError("give exactly one of code= or target=")
    if isinstance(args, str):  # "--epochs 1" means what a shell would make of it
        args = shlex.split(args)
    validate_launch(nproc_per_node, nnodes, max_restarts, timeout)
    outdir = Path(tempfile.mkdtemp(prefix="ddp_lesson_run_"))
    launch = None
    try:
        launch = build_launch(target, args, code, module, nproc_per_node, nnodes, max_restarts,
                               backend, env, cwd, [str(a) for a in torchrun_args], outdir)
        status = LiveStatus(live, launch.total)
        errfiles = [open(outdir / f"launcher{n}.err", "w+b") for n in range(len(launch.commands))]
        # ends the run and removes its folder if this process dies (a kernel restart, SIGKILL)
        watchdog = start_watchdog(launch.outdir, launch.env)
        try:
            procs, timed_out, wall = _supervise(launch, timeout, status, errfiles, _cancel)
            result, exits, times = _collect_result(launch, procs, errfiles, wall)
        finally:
            release_watchdog(watchdog)
            for err in errfiles:
                err.close()
        status.end()  # the constant text: what a stored notebook holds, whatever the outcome
        if timed_out:
            raise TorchrunTimeout(launch.equivalent, timeout, result)
        if result.returncode != 0:
            error = _failure(launch, result, exits, times)
            if check:
                raise error
        return result
    finally:
        if launch is not None:  # stop the rendezvous store now, not when a traceback is freed
            launch.store = None
        shutil.rmtree(outdir, ignore_errors=True)


def run_torchrun_many(jobs: dict, *, label: str = "torchrun", live: bool | None = None
                      ) -> dict:
    """Start several :func:`run_torchrun` jobs at once and wait for all of them.

    Each job has a thread, rendezvous store, ports and folder of its own: jobs that mostly wait
    take about as long as the slowest. ``jobs``: ``{label: kwargs of run_torchrun}`` (their
    ``live`` forced off); one live line, ``label`` its first word (``"hang clinic: 3 of 7 runs
    finished, 4 s"``), ends as :func:`status_text` of all their processes.

    Returns ``{label: TorchrunResult}`` in the order of ``jobs``.

    Raises:
        ValueError: no job, or a job's bad arguments.
        TorchrunError / TorchrunTimeout: the first job's (in ``jobs`` order), once all ended.
        TorchrunInterrupted: a ``KeyboardInterrupt``, every process of every job ended first.
    """
    if not jobs:
        raise ValueError("run_torchrun_many needs at least one job, got none")
    results, errors, cancel = {}, {}, threading.Event()

    def work(name, kwargs):
        try:
            results[name] = run_torchrun(**{**kwargs, "live": False, "_cancel": cancel})
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors[name] = exc

    defaults = inspect.signature(run_torchrun).parameters  # one source for the defaults
    total = sum(kw.get("nproc_per_node", defaults["nproc_per_node"].default)
                * kw.get("nnodes", defaults["nnodes"].default) for kw in jobs.values())
    status = LiveStatus(live, total)
    threads = [threading.Thread(target=work, args=item, daemon=True) for item in jobs.items()]
    start = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            done = sum(not t.is_alive() for t in threads)
            status.update(f"{label}: {done} of {len(threads)} runs finished, "
                          f"at {time.monotonic() - start:.0f} s")
            for t in threads:
                t.join(_POLL_S / len(threads))
    except KeyboardInterrupt:
        cancel.set()
        for t in threads:
            t.join()
        status.end("torchrun: interrupted; every process ended")
        raise TorchrunInterrupted() from None
    status.end()
    for name in jobs:
        if name in errors:
            raise errors[name]
    return {name: results[name] for name in jobs}

