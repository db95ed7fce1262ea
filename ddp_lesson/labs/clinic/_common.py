"""Shared pieces of the hang clinic: the command line and the group setup (5 s timeout)."""
from __future__ import annotations

import argparse


def parse(doc: str, argv=None) -> argparse.Namespace:
    """``--fixed`` (run the repaired program) and ``--timeout`` (seconds, default 5)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="run the repaired version")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds a collective waits for its peers before raising "
                             "(gloo honours the process group's timeout)")
    return parser.parse_args(argv)


def start(timeout: float):
    """Join the group with a short timeout and dump every thread's stack on SIGUSR1.

    ``faulthandler.register(SIGUSR1)``: ``kill -USR1 <pid>`` on a stuck worker prints where
    each of its threads is (the Python line of the collective it waits in) without ending it.
    """
    import faulthandler
    import signal

    from ...env import init_distributed

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return init_distributed(timeout=timeout)
