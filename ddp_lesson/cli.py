"""The ``ddp-lesson`` command.

``ddp-lesson train --nproc-per-node 2 [trainer flags]`` runs the main job, data-parallel
training of the seed's segmentation model, through torchrun. It prints the equivalent
``torchrun`` command first, so you can run the same thing without this package, then runs the
real launcher with this terminal as its output (rank 0's progress bar is live).
Trainer flags are those of ``python -m ddp_lesson.train --help``; ``ddp-lesson train --help``
lists them beside the launcher's.

``ddp-lesson doctor`` checks the machine, ``ddp-lesson compare SINGLE.py DDP.py`` runs a
one-process script and its DDP version and compares their final weights
(:mod:`ddp_lesson.convert.compare`), ``ddp-lesson bench NAME`` runs a benchmark. Errors name
the command and the flag as the user typed them; help screens are plain text (:func:`plain`).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from .env import BACKENDS, choose_backend

_RST = re.compile(r":[a-z]+:`~?([^`]+)`|``([^`]+)``|`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup, for a help screen: ``x``, `x` and
    :func:`x` become x."""
    return _RST.sub(lambda m: next(g for g in m.groups() if g is not None), text)


def _train_parser(trainer_flags: bool = False) -> argparse.ArgumentParser:
    """``ddp-lesson train``'s launcher flags; with ``trainer_flags``, the trainer's too (for
    ``--help`` and for checking them as the user typed them; :func:`train` passes them on)."""
    p = argparse.ArgumentParser(
        prog="ddp-lesson train",
        description="Data-parallel training of the seed's DeepLab-style model under torchrun. "
        "The launcher's flags (the first group) start torchrun; the trainer's flags are "
        "passed on to every rank's python -m ddp_lesson.train.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="processes on this machine (default 2)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines in the job; >1 needs --rdzv-endpoint (see README)")
    p.add_argument(
        "--node-rank", type=int, default=None, help="this machine's rank (static rendezvous)"
    )
    p.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, for --nnodes > 1"
    )
    p.add_argument("--rdzv-id", default="ddp-lesson", help="job id shared by every node")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun's --max-restarts")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="collective backend (default: nccl when each process can have a GPU, else gloo)",
    )
    if trainer_flags:
        _add_trainer_flags(p)
    return p


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    """The trainer's flags (:func:`ddp_lesson.config.build_parser`) as a group of ``p``, with
    their defaults; a flag the launcher already has (``--backend``) is the launcher's."""
    from .config import build_parser

    group = p.add_argument_group("trainer flags (passed to python -m ddp_lesson.train)")
    taken = set(p._option_string_actions)
    for action in build_parser()._actions:
        if action.dest == "help" or taken & set(action.option_strings):
            continue
        if action.default not in (None, False, argparse.SUPPRESS):
            action.help = f"{action.help} (default: {_shown(action.default)})"
        group._add_action(action)


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def torchrun_argv(opts: argparse.Namespace) -> list[str]:
    """torchrun's own flags for ``opts`` (without the program). Raises ValueError on bad counts.

    The flags come from the launcher's one builder, :func:`ddp_lesson.launch.torchrun_flags`;
    here the counts are checked first, with the messages naming this command's flags.
    """
    from .launch import torchrun_flags

    if opts.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {opts.nproc_per_node}")
    if opts.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {opts.nnodes}")
    if opts.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    return torchrun_flags(opts.nproc_per_node, opts.nnodes, max_restarts=opts.max_restarts,
                          rdzv_endpoint=opts.rdzv_endpoint if opts.nnodes > 1 else None,
                          rdzv_id=opts.rdzv_id,
                          node_rank=opts.node_rank)


def preflight(argv: list[str] | None, world_size: int, prog: str = "ddp-lesson train"):
    """Check a trainer command line before starting ``world_size`` processes that would all
    fail alike; returns the parsed :class:`~ddp_lesson.config.TrainConfig`.

    Runs here, without a process group, what every rank checks at start: the flags, the
    backend, ``--amp`` on that device, the data folder, at least one step per epoch, a
    writable ``--out`` and a checkpoint there this run can resume from
    (:func:`ddp_lesson.train.check_start`). ``prog`` is named in a bad flag's error line.

    Raises:
        SystemExit: a bad flag (one line printed by the parser, status 2).
        TrainInputError: any other bad input (the message names the values).
    """
    from .checkpoint import CHECKPOINT_FILE, layout_problem
    from .config import TrainInputError, check_steps, derived_values, layout_for, parse_config
    from .data import load_datasets
    from .train import check_amp, check_start

    cfg = parse_config(argv, prog)
    if world_size < 1:
        raise TrainInputError(f"the job needs at least 1 process, got {world_size}")
    try:
        backend, _ = choose_backend(world_size, None if cfg.backend == "auto" else cfg.backend)
    except ValueError as exc:
        raise TrainInputError(str(exc)) from None
    check_amp(cfg, "cuda" if backend == "nccl" else "cpu")
    n = len(load_datasets(cfg)[0])
    check_steps(cfg, derived_values(cfg, world_size, n), n)
    problem, layout = check_start(cfg, world_size)
    if problem is None and layout is not None:
        problem = layout_problem(os.path.join(cfg.out, CHECKPOINT_FILE),
                                 layout_for(cfg, n, *layout), world_size)
    if problem:
        raise TrainInputError(problem)
    return cfg


def train(argv: list[str]) -> int:
    """Run the trainer under torchrun; returns torchrun's exit status."""
    import shlex

    from .launch import launch_env

    opts, trainer_args = _train_parser().parse_known_args(argv)
    try:
        flags = torchrun_argv(opts)
    except ValueError as exc:
        print(f"ddp-lesson train: error: {exc}", file=sys.stderr)
        return 2
    backend = None if opts.backend == "auto" else opts.backend
    program = [
        "-m",
        "ddp_lesson.train",
        *(["--backend", backend] if backend else []),
        *trainer_args,
    ]
    print("equivalent command: " + shlex.join(["torchrun", *flags, *program]), flush=True)
    from .config import TrainInputError

    try:
        # "auto" defers to DDP_LESSON_BACKEND, as every rank will: check that too
        chosen, _ = choose_backend(opts.nproc_per_node, backend)
        preflight(program[2:], world_size=opts.nproc_per_node * opts.nnodes)
    except (TrainInputError, ValueError) as exc:
        print(f"ddp-lesson train: error: {exc}", file=sys.stderr)
        return 2
    warning = oversubscription_warning(opts.nproc_per_node, os.cpu_count() or 1)
    if warning and chosen == "gloo":
        print(f"ddp-lesson train: warning: {warning}", file=sys.stderr, flush=True)
    env = launch_env(None, backend, opts.nproc_per_node, announced=False,
                     max_restarts=opts.max_restarts)
    cmd = [sys.executable, "-m", "torch.distributed.run", *flags, *program]
    return _run_forwarding_signals(cmd, env)


def oversubscription_warning(nproc_per_node: int, cpu_cores: int) -> str | None:
    """One line when ``nproc_per_node`` CPU processes (gloo) outnumber this node's ``cpu_cores``,
    else None. torchrun starts them all the same; the line says what the learner will see: each
    process gets a share of a core, so every step waits on the slowest one. Pure; no process group.

    >>> oversubscription_warning(16, 2)
    '16 processes on 2 CPU cores: each gets 1/8 of a core, every step waits on the slowest'
    """
    if nproc_per_node <= cpu_cores:
        return None
    share = nproc_per_node / cpu_cores
    share_text = f"1/{share:g}" if share == int(share) else f"about 1/{share:.1f}"
    return (f"{nproc_per_node} processes on {cpu_cores} CPU cores: each gets {share_text} of a "
            "core, every step waits on the slowest")


def _run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run torchrun and wait; SIGTERM to this process is passed on to it.

    torchrun stays in our process group, so Ctrl-C in a terminal reaches it directly and it
    stops its workers. A SIGTERM sent to this process alone (a scheduler preempting the job)
    would otherwise kill only us and leave torchrun and its workers running: forward it, and
    wait for torchrun to end them. Checkpoints are written atomically, so the latest complete
    one survives whatever step the workers were in.
    """
    import signal

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # torchrun got the same SIGINT; let it finish stopping
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 130 if code == -signal.SIGINT else code


def _parser() -> argparse.ArgumentParser:
    """The whole command line: ``train``, ``doctor``, ``compare`` and
    ``bench {allreduce,ddp,scaling}``, one parser."""
    import importlib

    from .bench import BENCHMARKS
    from .doctor import parser as doctor_parser

    parser = argparse.ArgumentParser(
        prog="ddp-lesson", description="Data-parallel training with PyTorch, the lessons' "
        "command: train (the main job under torchrun), doctor (check this machine), compare "
        "(a script and its DDP version), bench (benchmarks). 'ddp-lesson COMMAND --help' "
        "lists a command's flags.")
    commands = parser.add_subparsers(dest="command", metavar="{train,doctor,compare,bench}")
    commands.add_parser("train", parents=[_train_parser(trainer_flags=True)], add_help=False,
                        help="the main job under torchrun (launcher and trainer flags)")
    commands.add_parser("doctor", parents=[doctor_parser()], add_help=False,
                        help="check this machine before a job (GPUs, port, interface, /dev/shm)")
    from .convert import compare

    compare.add_arguments(commands.add_parser(
        "compare", help="your script and its DDP version: the same final weights?",
        description=compare.DESCRIPTION, epilog=compare.EPILOG,
        usage=compare.USAGE.format(prog="ddp-lesson compare"),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    bench = commands.add_parser("bench", help="benchmarks: allreduce, ddp, scaling")
    which = bench.add_subparsers(dest="benchmark", metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = which.add_parser(name, help=plain(module.__doc__.split("\n")[0]),
                               description=plain(module.__doc__.split("\n\n")[0]))
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, check=getattr(module, "check", None), parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``ddp-lesson train [...]``, ``ddp-lesson doctor [...]``, ``ddp-lesson compare [...]``
    or ``ddp-lesson bench {allreduce,ddp,scaling} [...]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv:
        parser.print_help()
        return 0
    if argv[0] == "compare":            # its own parser: the scripts' arguments follow --
        from .convert.compare import main as compare_main

        return compare_main(argv[1:])
    opts, extra = parser.parse_known_args(argv)
    if opts.command == "train":
        return train(argv[1:])          # the trainer's own flags pass through
    if opts.command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(argv[1:])
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if opts.command == "bench" and getattr(opts, "run", None) is not None:
        if opts.check is not None:
            try:   # bad values refused here, before any process starts, naming the flag
                opts.check(opts)
            except ValueError as exc:
                opts.parser.error(str(exc))
        return opts.run(opts)
    parser.parse_args([*argv, "--help"])  # 'bench' alone: its help, listing the benchmarks
    return 0


if __name__ == "__main__":
    sys.exit(main())
