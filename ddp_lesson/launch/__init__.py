"""Launch real multi-process runs with torchrun, from a notebook cell or from Python.

Two faces of one launcher:

* ``run_torchrun(...)`` for scripts and tests;
* the ``%%torchrun`` cell magic (``%load_ext ddp_lesson``) for notebooks, and its line form
  ``%torchrun --nproc-per-node 2 -m ddp_lesson.train --epochs 1``.

Both start the real launcher, ``python -m torch.distributed.run`` (torchrun), in a subprocess;
nothing here spawns workers by hand. A run is built (:mod:`.command`: torchrun's flags from
:func:`torchrun_flags`, the one place they are made, and the environment), supervised
(:mod:`.supervise`: start, watchdog, timeout, terminate, reap), and shown (:mod:`.output`:
rank-ordered output, tracebacks, live status); :mod:`.magic` is the notebook face, and
:mod:`.agent` the torchrun agent every run starts. What the launcher adds around torchrun:

* a free rendezvous port on 127.0.0.1: the agents' c10d rendezvous store is hosted here, on a
  socket bound to loopback (torchrun's own would listen on every interface), so two launches
  at once never collide and nothing listens beyond this machine; rank 0's store and gloo are
  kept on loopback too (see :mod:`.agent`, :func:`.command.loopback_env`,
  :func:`ddp_lesson.env.init_distributed`);
* one backend/device choice, made with :func:`ddp_lesson.env.choose_backend` for every
  process on this host, printed once and used by every rank (``DDP_LESSON_LAUNCHER_BACKEND``);
* ``OMP_NUM_THREADS`` set explicitly (cores / processes) when you have not set it, which is
  what silences torchrun's starred OMP banner (docs/pitfalls.md);
* each rank's stdout captured to a file of its own and shown grouped in rank order after the
  run, as a terminal would show it (a progress bar redrawn with ``\\r`` keeps its final state)
  and wrapped to 100 characters with the ``[rank N] `` prefix, so a deterministic program gives
  a deterministic cell output (nbval replays it); stderr is shown when a rank fails (or with
  ``--show-stderr``), the cell's file named ``<torchrun cell>``;
* live status while it runs: in a notebook one line of plain text (no widget: it reads the
  same after a kernel restart and unexecuted), shown with a display id and rewritten in place;
  it starts and ends as a constant text (:func:`status_text`), so the stored output is
  deterministic (see :class:`LiveStatus`);
* a failing rank raises :class:`TorchrunError`: the rank that failed first and its traceback,
  the ranks that failed after it (peers waiting in a collective) listed as its consequences;
* a wall-clock timeout (:class:`TorchrunTimeout`) and, on timeout or interrupt
  (:class:`TorchrunInterrupted`, one line in a notebook), every process ended: torchrun gets
  SIGTERM (it forwards it to its workers and waits up to 30 s, as plain torchrun), then SIGKILL,
  then every process group of the run is killed
  (torchrun puts each worker in its own session, so killing the launcher's process group alone
  would orphan them and whatever they started);
* if this process dies outright (a kernel restart, SIGKILL), a watchdog process ends the run
  and removes its folder (:func:`ddp_lesson.procs.watch`); torchrun's own log folder lives in the
  run's folder, so ``$TMPDIR`` is left as it was.

Source: torchrun's documentation, https://pytorch.org/docs/stable/elastic/run.html.
"""
from __future__ import annotations

from .command import (
    free_port,
    launch_env,
    launcher_backend,
    torchrun_command,
    torchrun_flags,
)
from .magic import load_ipython_extension, split_magic_line, torchrun_magic
from .output import (
    CELL_LABEL,
    LINE_WIDTH,
    TorchrunError,
    TorchrunInterrupted,
    TorchrunResult,
    TorchrunTimeout,
    format_rank_outputs,
    keep_kernel_status_busy,
    status_text,
    terminal_text,
)
from .supervise import DEFAULT_TIMEOUT_S, run_torchrun, run_torchrun_many

__all__ = [
    "CELL_LABEL", "DEFAULT_TIMEOUT_S", "LINE_WIDTH", "TorchrunError", "TorchrunInterrupted",
    "TorchrunResult", "TorchrunTimeout", "format_rank_outputs", "free_port",
    "keep_kernel_status_busy", "launch_env", "launcher_backend", "load_ipython_extension",
    "run_torchrun", "run_torchrun_many", "split_magic_line", "status_text", "terminal_text",
    "torchrun_command", "torchrun_flags", "torchrun_magic",
]
