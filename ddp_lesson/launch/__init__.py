"""Launch real multi-process runs with torchrun, from a notebook cell or from Python.

``run_torchrun(...)`` for scripts and tests; the ``%%torchrun`` cell magic (``%load_ext
ddp_lesson``) and its line form ``%torchrun --nproc-per-node 2 -m ddp_lesson.train`` for
notebooks. Both start the real torchrun (``python -m torch.distributed.run``) in a subprocess.
A run is built (:mod:`.command`, the one place torchrun's flags are made), supervised
(:mod:`.supervise`) and shown (:mod:`.output`); :mod:`.magic` is the notebook face, :mod:`.agent`
the torchrun agent every run starts. Around torchrun the launcher adds:

* the agents' rendezvous store hosted here on a free 127.0.0.1 port (torchrun's own listens on
  every interface); rank 0's store and gloo stay on loopback too (:mod:`.agent`,
  :func:`.command.loopback_env`, :func:`ddp_lesson.env.init_distributed`);
* one backend choice (:func:`ddp_lesson.env.choose_backend`), printed once, used by every rank;
* ``OMP_NUM_THREADS`` (cores / processes) when unset, which silences torchrun's OMP banner;
* each rank's stdout in a file of its own, shown in rank order as a terminal would (``\\r``
  redraws keep their final state), wrapped to 100 characters with ``[rank N] `` prefixes, so
  a deterministic program gives a deterministic cell output; stderr when a rank fails (or
  ``--show-stderr``), the cell's file named ``<torchrun cell>``;
* a plain-text live status line that starts and ends as a constant (:class:`LiveStatus`);
* :class:`TorchrunError` naming the rank that failed first, later failures as consequences;
* a timeout (:class:`TorchrunTimeout`) and interrupts (:class:`TorchrunInterrupted`) ending
  every process: SIGTERM to torchrun (its workers get 30 s, as under plain torchrun), SIGKILL,
  then every process group of the run (each worker has a session of its own);
* a watchdog that ends the run and removes its folder if this process dies outright
  (:func:`ddp_lesson.procs.watch`); torchrun's log folder lives in the run's folder.

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
