"""Hang clinic, every repair in one job: each case's ``--fixed`` program, one after another.

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.clinic.fixed [--timeout 10]

One process group for the five repaired programs (``run(env, fixed=True)``, in
:data:`ddp_lesson.labs.clinic.CASES` order), each preceded by ``== <case>`` on every rank
(:func:`ddp_lesson.labs.clinic.split_cases`) and ended by a barrier.
"""
from __future__ import annotations


def main(argv=None) -> None:
    import importlib

    from ...env import barrier, cleanup
    from . import CASES
    from ._common import parse, start

    args = parse(__doc__, argv)
    env = start(args.timeout)
    for name in CASES:
        print(f"== {name}", flush=True)
        importlib.import_module(f"{__package__}.{name}").run(env, fixed=True)
        barrier()
    cleanup()


if __name__ == "__main__":
    main()
