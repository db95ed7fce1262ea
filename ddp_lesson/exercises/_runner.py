"""Worker of a distributed exercise checker; started by :func:`ddp_lesson.exercises.check`.

    torchrun --nproc-per-node R -m ddp_lesson.exercises._runner \\
        EXERCISE_ID CANDIDATES.pkl OUTDIR TIMEOUT_S

Each rank joins a gloo process group with a short timeout (TIMEOUT_S seconds), loads the
candidates (cloudpickled: a learner's function travels by value), runs the exercise's
``run_rank`` on each, at each of the exercise's world sizes (R is the largest; for a smaller
size W the default process group is rebuilt on ranks 0..W-1 through a FileStore in OUTDIR,
and the other ranks sit that size out), and after each run rewrites
``OUTDIR/result{RANK}.pkl`` with everything it has so far (one ``{W: result}`` per
candidate), so that a later hang or crash loses nothing already judged. A candidate that
raises on any rank ends the list, since its collectives may have left the ranks out of step:
the ranks agree on that through marker files (the process group may be broken), and then
exit with status 3, so torchrun ends any rank still busy in the candidate.
"""
from __future__ import annotations

import linecache
import os
import pickle
import sys
import time
from pathlib import Path


def _all_clean(outdir: Path, index: int, rank: int, world_size: int, clean: bool,
               wait_s: float) -> bool:
    """A barrier through files (the process group may be broken by now): after candidate
    ``index`` every rank writes ``done{index}.{rank}`` saying ``ok`` or ``stop``, then waits up
    to ``wait_s`` seconds for all of them. True when every rank finished it cleanly."""
    (outdir / f"done{index}.{rank}").write_text("ok" if clean else "stop")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        marks = [outdir / f"done{index}.{r}" for r in range(world_size)]
        texts = [m.read_text() if m.exists() else "" for m in marks]
        # Wait for every rank's mark even after a "stop": leaving early makes torchrun end
        # ranks that are about to record their own outcome (say, a timeout naming their line).
        if all(texts):
            return all(t == "ok" for t in texts)
        time.sleep(0.05)
    return False  # a rank is still busy in the candidate (or gone)


def _join(outdir: Path, timeout_s: float):
    """Wait until every rank has started, then join the gloo group with the short timeout.

    Start-up is not the candidate's fault: on a loaded machine the ranks finish importing
    torch seconds apart. So they first meet through marker files (the checker runs on one
    machine; up to a minute), and only then join the group, whose ``timeout_s`` applies to
    every collective and point-to-point wait that follows (gloo fixes a group's timeout for
    send/recv when the group is made, so it cannot be shortened after a patient join).
    """
    from ..env import init_distributed

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (outdir / f"arrived.{rank}").write_text("")
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if all((outdir / f"arrived.{r}").exists() for r in range(world_size)):
            break
        time.sleep(0.05)
    return init_distributed(timeout=timeout_s, backend="gloo", announce=False)


def _save(out: Path, results: list) -> None:
    """Write ``results`` atomically: torchrun may end this process at any moment (a peer
    exited with an error), and a half-written file would hide what was already judged."""
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(results))
    os.replace(tmp, out)


def _regroup(outdir: Path, tag: str, rank: int, world_size: int, timeout_s: float) -> bool:
    """Make the default process group ranks 0..world_size-1 of this launch (a fresh gloo
    group with the short timeout, met through a FileStore), after leaving the current one.
    Returns whether this rank is in the new group."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if rank >= world_size:
        return False
    (outdir / f"arrived.{tag}.{rank}").write_text("")
    deadline = time.monotonic() + 60.0  # a peer may still be busy in the previous size
    while time.monotonic() < deadline:
        if all((outdir / f"arrived.{tag}.{r}").exists() for r in range(world_size)):
            break
        time.sleep(0.02)
    store = dist.FileStore(str(outdir / f"store.{tag}"), world_size)
    # the store's own wait (a lazy connection to a peer, e.g. one outside the group) gets the
    # short timeout too; a FileStore's default is 300 s
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def main(argv=None) -> int:
    import cloudpickle
    import torch.distributed as dist

    from . import core

    exercise_id, payload, outdir, timeout_s = (argv or sys.argv[1:])[:4]
    timeout_s = float(timeout_s)
    outdir = Path(outdir)
    env = _join(outdir, timeout_s)
    ex = core.get(exercise_id)
    loaded = cloudpickle.loads(Path(payload).read_bytes())
    out = outdir / f"result{env.rank}.pkl"
    results = []
    current = env.world_size  # the size of the default group now (None: not in one)
    for index, (fn, lines) in enumerate(zip(loaded["candidates"], loaded["sources"])):
        for code in core._code_objects(fn):  # so a traceback shows the learner's lines
            if lines:
                linecache.cache[code.co_filename] = (sum(map(len, lines)), None, lines,
                                                     code.co_filename)
        clean = True
        record: dict = {}
        results.append(record)
        for size in ex.sizes():
            if size != current:
                joined = _regroup(outdir, f"{index}.{size}", env.rank, size, timeout_s)
                current = size if joined else None
            if env.rank >= size:
                continue
            try:
                record[size] = ex.run_rank(fn, env.rank, size)
            except (Exception, SystemExit) as exc:
                clean = False
                record[size] = (exc.result if isinstance(exc, core.StopCandidate)
                                else core.error_record(exc))
            _save(out, results)
            if not clean:
                break
        _save(out, results)
        # Peers waiting for this rank give up within one collective timeout; a rank still
        # busy after that is ended by torchrun when this one exits with an error status.
        if not _all_clean(outdir, index, env.rank, env.world_size, clean, timeout_s + 3.0):
            sys.stdout.flush()
            os._exit(3)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
