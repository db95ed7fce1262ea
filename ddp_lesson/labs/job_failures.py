"""A job that fails on purpose under *plain* torchrun (deep dive 07 · debugging a real job).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.job_failures raise

Rank 1 misbehaves per mode: ``raise`` (an exception, main under ``@record``),
``raise-unrecorded`` (without ``@record``), ``kill`` (SIGKILL, as the OOM killer), ``hang``
(stuck outside any collective; rank 0's ``monitored_barrier`` names it), ``shape``
(``all_reduce`` of 2 elements against 3), ``unused`` (a DDP model whose forward skips a
layer on rank 1). :func:`run_plain` launches it and returns torchrun's output, masked.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("raise", "raise-unrecorded", "kill", "hang", "shape", "unused")
#: Seconds rank 0's ``monitored_barrier`` waits in ``hang``; rank 1 sleeps 10 times longer.
BARRIER_S = 2


class _TwoLayers(torch.nn.Module):
    """``used`` in every forward; ``skipped`` too on rank 0 (times 0), never on rank 1."""

    def __init__(self, skip: bool):
        super().__init__()
        self.used, self.skipped = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.skip = skip

    def forward(self, x):
        return self.used(x) if self.skip else self.used(x) + 0 * self.skipped(x)


def _unused(rank: int) -> None:
    """Two DDP steps of :class:`_TwoLayers` (``find_unused_parameters=False``): rank 1's second
    forward raises, its first reduction unfinished (``reducer.cpp``,
    ``Reducer::ensure_prior_reduction_finished``); rank 0 waits for it until rank 1 is gone.
    """
    ddp = DDP(_TwoLayers(skip=rank == 1))
    for _ in range(2):
        ddp(torch.ones(2, 4)).sum().backward()


def _work(mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()}: started", flush=True)
    if mode.startswith("raise") and rank == 1:
        raise ValueError("rank 1: batch 3 has 7 samples, expected 8")
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        if rank == 1:
            time.sleep(10 * BARRIER_S)  # stuck elsewhere (a slow disk, a deadlock)
        else:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=BARRIER_S))
    if mode == "shape":
        dist.all_reduce(torch.zeros(rank + 2))  # 2 elements on rank 0, 3 on rank 1
    if mode == "unused":
        _unused(rank)
    dist.barrier()
    dist.destroy_process_group()


@record
def _recorded(mode: str) -> None:
    """:func:`_work` under ``@record``: an exception and its traceback go to torchrun's
    ``TORCHELASTIC_ERROR_FILE``, and torchrun's summary shows it.
    """
    _work(mode)


def main(argv=None) -> None:
    """``job_failures MODE`` (one of :data:`MODES`); synchronises ranks."""
    mode = (sys.argv[1:] if argv is None else argv)[0]
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    try:
        (_work if mode == "raise-unrecorded" else _recorded)(mode)
    except Exception:
        sys.excepthook(*sys.exc_info())  # torch's hook: each line prefixed "[rankN]: "
        sys.stderr.flush()
        # leave at once: an orderly exit tears gloo down, which waits for a peer still inside
        # a collective with this rank (rank 0 in ``unused``) until its timeout
        os._exit(1)


#: What :func:`mask` replaces: values that change from run to run or machine to machine.
_VOLATILE = [
    (r"pid: \d+", "pid: PID"), (r"PID \d+", "PID PID"),
    (r"(time\s+: ).*", r"\1TIME"), (r"(host\s+: ).*", r"\1HOST"),
    (r"(error_file: )/\S*/(attempt_\d+/\d+/error\.json)", r"\1LOG_DIR/.../\2"),
    (r"(error_file: )/\S+", r"\1TMP/error.json"),
    (r'File "/\S*/((torch|ddp_lesson)/\S+)"', r'File "\1"'),
    (r"of binary: \S+", "of binary: PYTHON"), (r"\]:\d+", "]:PORT"),
    (r"\[[^\]\s]*/[^\]\s]*:\d+\] ", ""),  # gloo's source location [/path/file.cc:78]
]


def mask(text: str) -> str:
    """``text`` with pids, times, the host, temporary paths and gloo's source locations
    replaced by fixed words (``PID``, ``TIME``, ``HOST``, ``LOG_DIR``, ``TMP``)."""
    for pattern, repl in _VOLATILE:
        text = re.sub(pattern, repl, text)
    return text


def run_plain(mode: str, *flags: str, env: dict | None = None, timeout: float = 120.0
              ) -> tuple[int, str]:
    """Launch this lab on 2 processes with plain ``python -m torch.distributed.run
    --standalone`` (no ddp_lesson launcher) and wait.

    Args:
        mode: one of :data:`MODES`.
        flags: torchrun's own flags, before the program (``"--log-dir", "runs/x"``).
        env: variables added to this process's environment (``TORCH_DISTRIBUTED_DEBUG``).
        timeout: wall-clock seconds before the launch is killed.

    Returns:
        (torchrun's exit code, its stdout and stderr merged, :func:`mask` ed).

    Raises:
        ValueError: an unknown ``mode`` (names the known ones).
        subprocess.TimeoutExpired: the launch outlived ``timeout``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *flags, "-m", __name__, mode]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    done = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    return done.returncode, mask(done.stdout)


def summary(text: str) -> list[str]:
    """The lines of torchrun's failure summary (``ChildFailedError``'s message: from the first
    ``=====`` border to the last), empty when there is none."""
    lines = text.splitlines()
    borders = [i for i, line in enumerate(lines) if re.fullmatch(r"=+", line.strip())]
    return lines[borders[0]:borders[-1] + 1] if len(borders) >= 2 else []


def failures(text: str) -> dict:
    """torchrun's failure summary as ``{rank: {"exitcode", "error_file", "says"}}`` (``says``:
    the exception's first line, or the traceback field itself, "Signal 9 (SIGKILL) received by
    PID PID"), and ``"root"``: the rank under "Root Cause (first observed failure)".
    """
    table, entry, root_next = {}, {}, False
    for line in summary(text):
        key, _, value = (part.strip() for part in line.partition(": "))
        if line.startswith("Root Cause"):
            root_next = True
        elif key == "rank":
            entry = table[int(value.split()[0])] = {}
            if root_next:
                table["root"], root_next = int(value.split()[0]), False
        elif key == "exitcode":
            entry["exitcode"] = re.sub(r"\s*\(pid: PID\)\s*", " ", value).strip()
        elif key == "error_file":
            entry["error_file"] = value
        elif key == "traceback":
            entry["says"] = None if value.startswith("Traceback") else value
        elif entry.get("says", "") is None and re.match(r"  \S", line):
            entry["says"] = line.strip()  # the exception line, below the frames
    return table


if __name__ == "__main__":
    main()
