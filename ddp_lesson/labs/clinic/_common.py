"""Shared pieces of the hang clinic: the command line and the group setup (5 s timeout)."""
from __future__ import annotations

import argparse

#: Seconds every rank may take to start and join the group, whatever ``--timeout`` is: ranks
#: started together can still arrive seconds apart on a busy machine, and a late start is
#: not the bug a clinic case shows.
JOIN_TIMEOUT_S = 60.0


def parse(doc: str, argv=None) -> argparse.Namespace:
    """``--fixed`` (run the repaired program) and ``--timeout`` (seconds, default 5)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="run the repaired version")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds a collective waits for its peers before raising "
                             "(gloo honours the process group's timeout)")
    parser.add_argument("--flight-dir", default=None,
                        help="write each rank's flight record to DIR/trace_<rank> while the "
                             "case hangs (read it with python -m ddp_lesson.flight DIR)")
    parser.add_argument("--flight-stacks", action="store_true",
                        help="with the callers' stacks (file:line; the first such dump of a "
                             "process costs a few CPU-seconds)")
    return parser.parse_args(argv)


#: How long a collective must stay unfinished before a rank writes its flight record, as a
#: fraction of ``--timeout``: long enough that a collective merely finishing is not taken for
#: a hang, short enough that the group's timeout has not yet failed it (a failed collective
#: is recorded as completed, :func:`ddp_lesson.flight.verdict`).
STUCK_AT = 0.5


def flight_recorder(args, rank: int):
    """With ``--flight-dir``: a :class:`ddp_lesson.flight.HangWatch` writing this rank's
    record to ``DIR/trace_<rank>`` once it is stuck in a collective for ``STUCK_AT * --timeout``
    seconds, or at ``finish()`` (every rank leaves one); else None. Local.
    """
    if not args.flight_dir:
        return None
    from ...flight import HangWatch

    return HangWatch(args.flight_dir, rank, stuck_s=STUCK_AT * args.timeout,
                     stacks=args.flight_stacks)


def start(timeout: float):
    """Join the group, then give its collectives a short timeout; dump stacks on SIGUSR1.

    The join gets :data:`JOIN_TIMEOUT_S` and a barrier; later collectives ``timeout`` seconds
    (``distributed_c10d._set_pg_timeout``, as torch's ``dist.breakpoint`` changes a live group's
    timeout; gloo honours it). ``kill -USR1 <pid>`` prints where each thread of a stuck worker
    is, without ending it (``faulthandler``). Synchronises ranks. Returns the
    :class:`ddp_lesson.env.DistEnv`.
    """
    import datetime
    import faulthandler
    import signal

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from ...env import barrier, group_active, init_distributed

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # gloo, always: the cases build CPU tensors (NCCL refuses them: "Tensors must be CUDA and
    # dense", ProcessGroupNCCL.cpp) and the lessons read gloo's own timeout errors
    env = init_distributed(timeout=max(timeout, JOIN_TIMEOUT_S), backend="gloo")
    if group_active():
        barrier()
        _set_pg_timeout(datetime.timedelta(seconds=timeout), dist.group.WORLD)
    return env


def main(doc: str, run, argv=None) -> None:
    """A case's entry point: parse ``argv``, join (:func:`start`), start the flight record,
    ``run(env, fixed)``, leave the group. Synchronises ranks. When ``run`` raises and a record is
    kept: print the error, write the record, wait (at most :data:`JOIN_TIMEOUT_S`) until every
    rank's record is final, exit 1.
    """
    import sys
    import traceback

    from ...env import cleanup

    args = parse(doc, argv)
    env = start(args.timeout)
    recorder = flight_recorder(args, env.rank)
    try:
        run(env, args.fixed)
    except Exception:
        if recorder is None:
            raise
        # With a record to leave: the error first (once every rank is done torchrun may stop
        # this process), then the record, written while the group lives, then keep this
        # rank's connections open until every rank's record is final. Leaving at once would
        # fail a peer's collective with it before the peer was recorded stuck in it
        # (HangWatch's docstring): the peers' records would depend on the machine's load.
        traceback.print_exc()
        sys.stderr.flush()
        recorder.finish(failed=True, world_size=env.world_size, timeout_s=JOIN_TIMEOUT_S)
        sys.exit(1)
    except BaseException:  # an interrupt: leave the record and go
        if recorder is not None:
            recorder.finish(failed=True)
        raise
    if recorder is not None:
        recorder.finish()
    cleanup()
