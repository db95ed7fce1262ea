"""The trainer's fault injector, for the failure lessons (notebook 07 and its deep dives).

``--simulate-failure-at-step K`` makes ``--failure-rank`` kill itself with SIGKILL right after
global step K; with ``--simulate-failure-during-save`` rank 0 dies instead inside the first
checkpoint write at a step >= K, between the temporary file and the rename; with
``--simulate-node-loss`` the rank kills its torchrun agent first, as when its machine is lost.
Each fault happens once per ``--out``: a marker file written before the kill lets the restarted
job run on. Nothing here communicates.
"""
from __future__ import annotations

import os
import signal

__all__ = ["failure_marker", "failure_rank_problem", "after_step", "during_save"]


def failure_marker(cfg) -> str:
    """``{out}/simulated_failure_step{K}.done``, written just before the simulated kill."""
    return os.path.join(cfg.out, f"simulated_failure_step{cfg.simulate_failure_at_step}.done")


def failure_rank_problem(cfg, world_size: int) -> str | None:
    """Why ``--failure-rank`` cannot die in a job of ``world_size`` processes, or None.

    A failure that already happened (its marker is written) needs no rank: the restart of a
    job that lost that rank's node runs on without it.
    """
    if (cfg.simulate_failure_at_step and cfg.failure_rank >= world_size
            and not os.path.exists(failure_marker(cfg))):
        return (f"--failure-rank {cfg.failure_rank} is outside [0, {world_size - 1}] "
                f"(world size {world_size})")
    return None


def after_step(cfg, rank: int, global_step: int) -> None:
    """Kill this process when it is ``--failure-rank`` and ``global_step`` is K."""
    if (cfg.simulate_failure_at_step and not cfg.simulate_failure_during_save
            and global_step == cfg.simulate_failure_at_step and rank == cfg.failure_rank):
        _kill(cfg, rank, global_step, "after the step")


def during_save(cfg, rank: int, global_step: int):
    """The ``before_replace`` hook of this checkpoint write that kills rank 0, or None."""
    if (cfg.simulate_failure_during_save and rank == 0
            and global_step >= cfg.simulate_failure_at_step):
        return lambda tmp: _kill(cfg, rank, global_step, "during the checkpoint write")
    return None


def _kill(cfg, rank: int, global_step: int, where: str) -> None:
    """SIGKILL this process, once per ``--out``.

    The marker is fsync'ed before the kill: a SIGKILL leaves no chance to write it afterwards.
    SIGKILL, not an exception: no ``finally``, no atexit, as when the OOM killer or a lost
    machine ends a worker.
    """
    marker = failure_marker(cfg)
    if os.path.exists(marker):
        return
    with open(marker, "w") as fh:
        fh.write(f"rank {rank} killed {where} at global step {global_step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    if cfg.simulate_node_loss:  # the whole node: its torchrun agent (our parent) too
        print(f"simulated failure: rank {rank} kills its torchrun agent and itself "
              f"(SIGKILL) {where} at global step {global_step}: node lost", flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        print(f"simulated failure: rank {rank} kills itself (SIGKILL) {where} at "
              f"global step {global_step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
