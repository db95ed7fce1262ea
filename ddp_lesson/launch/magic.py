"""The ``%%torchrun`` cell magic and the IPython extension that registers it."""
from __future__ import annotations

import argparse
import shlex
import sys

from ..env import BACKENDS
from .command import launcher_backend
from .output import TorchrunError, TorchrunTimeout, format_rank_outputs, keep_kernel_status_busy
from .supervise import DEFAULT_TIMEOUT_S, run_torchrun


def _magic_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="%%torchrun", add_help=False,
        description="Run the cell (or -m MODULE / SCRIPT) on several processes with torchrun.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="processes per node (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="simulated nodes on this host (default 1)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before every process is ended (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="override the automatic choice (also: DDP_LESSON_BACKEND)")
    p.add_argument("--ranks", default=None,
                   help="comma-separated ranks whose output to show (default: all)")
    p.add_argument("--show-stderr", action="store_true",
                   help="also show each rank's stderr (warnings, progress bars)")
    p.add_argument("--quiet", action="store_true", help="do not print the backend line")
    p.add_argument("-h", "--help", action="store_true")
    return p


_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--max-restarts",
           "--max_restarts", "--timeout", "--backend", "--ranks"}


def split_magic_line(line: str) -> tuple[list[str], str | None, bool, list[str]]:
    """Split ``%torchrun`` options from the program: ``(options, target, is_module, args)``.

    Everything after ``-m NAME`` or after the first bare word (a script path) belongs to the
    program, so ``%torchrun --nproc-per-node 2 -m ddp_lesson.train --epochs 1`` passes
    ``--epochs 1`` to the trainer.
    """
    tokens = shlex.split(line)
    opts, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "-m":
            if i + 1 >= len(tokens):
                raise ValueError("-m needs a module name")
            return opts, tokens[i + 1], True, tokens[i + 2:]
        if tok == "--":
            rest = tokens[i + 1:]
            return (opts, rest[0], False, rest[1:]) if rest else (opts, None, False, [])
        if tok.startswith("-"):
            opts.append(tok)
            if tok in _VALUED:
                if i + 1 >= len(tokens):
                    raise ValueError(f"{tok} needs a value")
                opts.append(tokens[i + 1])
                i += 1
        else:
            return opts, tok, False, tokens[i + 1:]
        i += 1
    return opts, None, False, []


def torchrun_magic(line: str, cell: str | None = None):
    """``%%torchrun [opts]`` runs the cell, ``%torchrun [opts] -m MODULE|SCRIPT [args]`` a program.

    Options (torchrun's own names): ``--nproc-per-node N`` (default 2), ``--nnodes N``,
    ``--max-restarts N``, plus ``--timeout S``, ``--backend {auto,gloo,nccl}``,
    ``--ranks 0,2``, ``--show-stderr``, ``--quiet``. Prints the backend choice once, then each
    rank's output in rank order; raises when a rank fails. Returns nothing (the result is
    kept as ``_torchrun_result`` in the user namespace).
    """
    parser = _magic_parser()
    opt_tokens, target, is_module, args = split_magic_line(line)
    try:
        opts = parser.parse_args(opt_tokens)
    except SystemExit:
        raise ValueError(f"could not parse %%torchrun options {line!r}; "
                         "see %torchrun --help") from None
    if opts.help:
        print(torchrun_magic.__doc__)
        return None
    body = cell if cell is not None and cell.strip() else None
    if body is None and target is None:
        raise ValueError("%%torchrun needs code in the cell, or %torchrun -m MODULE / SCRIPT")
    if body is not None and target is not None:
        raise ValueError("give either a cell body or a program after %%torchrun, not both")
    total = opts.nproc_per_node * opts.nnodes
    ranks = None if opts.ranks is None else {int(r) for r in opts.ranks.split(",") if r.strip()}
    if ranks is not None and not all(0 <= r < total for r in ranks):
        raise ValueError(f"--ranks {opts.ranks}: ranks must be in [0, {total - 1}]")
    if not opts.quiet:
        _, reason = launcher_backend(opts.nproc_per_node, opts.nnodes, opts.backend)
        print(f"[torchrun] {reason}")
    try:
        result = run_torchrun(target, args, code=body, module=is_module,
                              nproc_per_node=opts.nproc_per_node, nnodes=opts.nnodes,
                              max_restarts=opts.max_restarts, timeout=opts.timeout,
                              backend=opts.backend)
    except (TorchrunError, TorchrunTimeout) as e:  # what the ranks printed, then the error
        out = format_rank_outputs(e.result.outputs, ranks)
        if out:
            print(out, end="")
        raise
    print(format_rank_outputs(result.outputs, ranks), end="")
    if opts.show_stderr:
        err = format_rank_outputs({r: t for r, t in result.errors.items() if t.strip()}, ranks)
        if err:
            print(err, end="", file=sys.stderr)
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.user_ns["_torchrun_result"] = result
    except ImportError:
        pass
    return None


def load_ipython_extension(ipython) -> None:
    """Register ``%%torchrun`` / ``%torchrun`` (called by ``%load_ext ddp_lesson``), and keep
    the kernel's status busy while its cells run (:func:`keep_kernel_status_busy`)."""
    ipython.register_magic_function(torchrun_magic, magic_kind="line_cell", magic_name="torchrun")
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None:
        keep_kernel_status_busy(kernel)
