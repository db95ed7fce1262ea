"""Notebook 07's three training runs: one uninterrupted, one killed mid-run, one killed mid-write.

    torchrun --nproc-per-node 2 --max-restarts 1 -m ddp_lesson.train $TINY --out runs/nb07/killed \\
        --simulate-failure-at-step 5 --failure-rank 1

:data:`TINY`: 4 steps per epoch (32 samples, 2 ranks, batch 4), 2 epochs, a checkpoint every
2 global steps; :data:`JOBS`: each run's extra flags.
"""
from __future__ import annotations

import textwrap

import torch

TINY = ["--size", "32", "64", "--width", "8", "--num-train", "32", "--num-val", "8", "-b", "4",
        "--epochs", "2", "--checkpoint-every-steps", "2"]
#: name -> (torchrun's --max-restarts, the trainer's extra flags).
JOBS = {
    "reference": (0, []),
    "killed": (1, ["--simulate-failure-at-step", "5", "--failure-rank", "1"]),
    "torn": (1, ["--simulate-failure-at-step", "5", "--simulate-failure-during-save"]),
}
#: Where the lines of :func:`story` start (losses and progress are left out).
KEEP = ("simulated failure", "[restart", "resuming from", "world_size")


def commands(root: str = "runs/nb07") -> list[str]:
    """Each run of :data:`JOBS` as its torchrun command line, its extra flags on the next line
    (``$TINY`` stands for :data:`TINY`).
    """
    lines = ["TINY=" + " ".join(TINY)]
    for name, (restarts, extra) in JOBS.items():
        again = f" --max-restarts {restarts}" if restarts else ""
        lines.append(f"torchrun --nproc-per-node 2{again} -m ddp_lesson.train $TINY "
                     f"--out {root}/{name}")
        if extra:
            lines.append("    " + " ".join(extra))
    return lines


def run_jobs(root: str = "runs/nb07", timeout: float = 300.0) -> dict:
    """Start every run of :data:`JOBS` at once (2 processes each, gloo) and wait for all:
    ``{name: TorchrunResult}`` (about as long as the slowest). Raises what
    :func:`ddp_lesson.launch.run_torchrun_many` raises.
    """
    from ..launch import run_torchrun_many

    return run_torchrun_many({
        name: dict(target="ddp_lesson.train", args=TINY + ["--out", f"{root}/{name}", *extra],
                   module=True, timeout=timeout, backend="gloo", nproc_per_node=2,
                   max_restarts=restarts)
        for name, (restarts, extra) in JOBS.items()})


def story(result, keep: tuple = KEEP) -> list[str]:
    """``[rank N] line`` for each rank's lines that start with one of ``keep``, in rank order,
    wrapped at 100 characters (a continuation indented 11 spaces)."""
    return [textwrap.fill(f"[rank {rank}] {line}", 100, subsequent_indent=" " * 11)
            for rank in sorted(result.outputs)
            for line in result.rank_lines(rank) if line.startswith(keep)]


def same_weights(run: str, other: str, root: str = "runs/nb07") -> bool:
    """Whether the two runs' final checkpoints hold bit-equal model weights (same names)."""
    a, b = (torch.load(f"{root}/{n}/checkpoint.pt", weights_only=True)["model"]
            for n in (run, other))
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def without_docstring(fn) -> str:
    """``fn``'s source with its docstring left out: the code a notebook walks through."""
    import ast
    import inspect

    source = inspect.getsource(fn)
    body = getattr(ast.parse(textwrap.dedent(source)).body[0], "body", None)
    first = body[0] if isinstance(body, list) else None  # a lambda's body is an expression
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return source
    lines = source.splitlines(keepends=True)
    return "".join(lines[:first.lineno - 1] + lines[first.end_lineno:])
