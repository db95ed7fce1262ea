"""Worker of a distributed exercise checker; started by :func:`ddp_lesson.exercises.check`.

    torchrun --nproc-per-node R -m ddp_lesson.exercises._runner CANDIDATES.pkl OUTDIR TIMEOUT_S

Each rank joins a gloo group with a short timeout (TIMEOUT_S seconds), loads the cloudpickled
candidates (each with its exercise's id) and runs each one's ``run_rank`` at each of its
exercise's world sizes (for a size W below R the default group is rebuilt on ranks 0..W-1
through a FileStore in OUTDIR). After each run it rewrites ``OUTDIR/result{RANK}.pkl`` with
all it has (one ``{W: result}`` per candidate); before each candidate it writes
:data:`~ddp_lesson.exercises.core.CANDIDATE_MARK` to stderr, so the checker reads a rank's last
words from the candidate it died in.

After each world size the ranks agree through marker files on how it went. All clean: the
next run uses the same group. A candidate failed on some rank but every rank came back: the
next starts in a fresh group. A rank did not come back in time, or a candidate left a thread
running: each rank that came back exits with status 3 (torchrun ends the others) and the
checker runs the rest in a fresh launch.
"""
from __future__ import annotations

import linecache
import os
import pickle
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _wait_for(paths: list, wait_s: float, poll_s: float = 0.05) -> list[str] | None:
    """The texts of ``paths`` once every one is written (not empty), polled for up to
    ``wait_s`` seconds; None when some did not come in time."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        texts = [p.read_text() if p.exists() else "" for p in paths]
        if all(texts):
            return texts
        time.sleep(poll_s)
    return None


def _agree(outdir: Path, name: str, rank: int, world_size: int, state: str, threads: bool,
           wait_s: float) -> tuple[str, bool]:
    """A barrier through files: every rank writes ``agree{name}.{rank}`` with its ``state``
    (``"ok"``, or ``"failed"``: the candidate raised or timed out here) and whether the
    candidate left a thread of its own running, then waits up to ``wait_s`` s for every mark.

    Returns ``("ok" | "failed" | "gone", threads)``: every rank ok, every rank came back and
    some failed, or a rank did not come back in time; and whether any has a thread left."""
    (outdir / f"agree{name}.{rank}").write_text(state + (" thread" if threads else ""))
    # Wait for every rank's mark even after a "failed": leaving early makes torchrun end ranks
    # that are about to record their own outcome (say, a timeout naming their line).
    texts = _wait_for([outdir / f"agree{name}.{r}" for r in range(world_size)], wait_s)
    if texts is None:
        return "gone", False
    ok = all(t.split()[0] == "ok" for t in texts)
    return "ok" if ok else "failed", any(" thread" in t for t in texts)


def _leave_group(wait_s: float) -> bool:
    """Destroy this rank's process groups; True when that took less than ``wait_s`` s."""
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
    leaving.start()
    leaving.join(wait_s)
    return not leaving.is_alive()


def _own_threads() -> set:
    """The Python threads of this process, less the placeholders Python makes for foreign
    threads (torch's own C++ threads running a callback)."""
    import threading

    return {t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}


def _join(outdir: Path, timeout_s: float):
    """Meet every rank through marker files (up to a minute: on a loaded machine the ranks
    finish importing torch seconds apart, not the candidate's fault), then join the gloo group
    with the short timeout (gloo fixes a group's send/recv timeout when it is made)."""
    from ..env import init_distributed

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (outdir / f"arrived.{rank}").write_text("here")
    _wait_for([outdir / f"arrived.{r}" for r in range(world_size)], 60.0)
    env = init_distributed(timeout=timeout_s, backend="gloo", announce=False)
    _formed()
    return env


def _formed() -> None:
    """A barrier right after a group is made: a rank returns from gloo's connectFullMesh while
    a peer may still be connecting, and one that left at once (a first world size below the
    launch's) closed its end under it ("Connection closed by peer", seen on a loaded machine)."""
    import torch.distributed as dist

    dist.barrier()


def _save(out: Path, results: list) -> None:
    """Write ``results`` atomically: torchrun may end this process at any moment."""
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(results))
    os.replace(tmp, out)


def _regroup(outdir: Path, tag: str, rank: int, world_size: int, timeout_s: float) -> bool:
    """Leave the current group and make ranks 0..world_size-1 a fresh gloo one (short timeout,
    met through a FileStore); whether this rank is in it. Exits (status 3, ending the launch)
    when leaving takes longer than a collective timeout and a margin."""
    import datetime

    import torch.distributed as dist

    if not _leave_group(timeout_s + 3.0):
        sys.stdout.flush()
        os._exit(3)
    if rank >= world_size:
        return False
    (outdir / f"arrived.{tag}.{rank}").write_text("here")
    # a peer may still be busy in the previous size
    _wait_for([outdir / f"arrived.{tag}.{r}" for r in range(world_size)], 60.0, 0.02)
    store = dist.FileStore(str(outdir / f"store.{tag}"), world_size)
    # the store's own wait (a lazy connection to a peer, e.g. one outside the group) gets the
    # short timeout too; a FileStore's default is 300 s
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _formed()
    return True


#: The variables torchrun sets to the number of worker processes (torch/distributed/elastic/
#: agent/server/local_elastic_agent.py, ``_start_workers``; one machine here, so the local
#: and the role's counts are the world size; GROUP_WORLD_SIZE counts agents, 1, and stays).
_SIZE_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")


@contextmanager
def _environment_of(size: int):
    """Within the block the environment says what a torchrun of ``size`` processes would say,
    so a candidate reading ``os.environ["WORLD_SIZE"]`` is right at every size."""
    saved = {k: os.environ.get(k) for k in _SIZE_VARIABLES}
    try:
        for k in _SIZE_VARIABLES:
            if saved[k] is not None:
                os.environ[k] = str(size)
        yield
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v


def main(argv=None) -> int:
    import cloudpickle
    import torch.distributed as dist

    from . import core
    from .registry import StopCandidate, get
    from .values import error_record

    payload, outdir, timeout_s = (argv or sys.argv[1:])[:3]
    timeout_s = float(timeout_s)
    outdir = Path(outdir)
    env = _join(outdir, timeout_s)
    loaded = cloudpickle.loads(Path(payload).read_bytes())
    out = outdir / f"result{env.rank}.pkl"
    results = []
    current = env.world_size  # the size of the default group now (None: not in one)
    for index, (exercise_id, fn, lines) in enumerate(
            zip(loaded["exercises"], loaded["candidates"], loaded["sources"])):
        ex = get(exercise_id)
        for code in core.code_objects(fn):  # so a traceback shows the learner's lines
            if lines:
                linecache.cache[code.co_filename] = (sum(map(len, lines)), None, lines,
                                                     code.co_filename)
        print(core.CANDIDATE_MARK.format(index), file=sys.stderr, flush=True)
        record: dict = {}
        results.append(record)
        threads = _own_threads()
        for size in ex.sizes():
            if size != current:
                joined = _regroup(outdir, f"{index}.{size}", env.rank, size, timeout_s)
                current = size if joined else None
            state = "ok"
            if env.rank < size:
                try:
                    with _environment_of(size):
                        record[size] = ex.run_rank(fn, env.rank, size)
                except (Exception, SystemExit) as exc:
                    state = "failed"
                    record[size] = (exc.result if isinstance(exc, StopCandidate)
                                    else error_record(exc))
                _save(out, results)
            # Peers waiting for a failing rank give up within one collective timeout; a rank
            # sitting this size out waits as long as a rank joining a group does.
            wait_s = timeout_s + 3.0 if env.rank < size else max(60.0, timeout_s + 3.0)
            agreed, stray = _agree(outdir, f"{index}.{size}", env.rank, env.world_size, state,
                                   bool(_own_threads() - threads), wait_s)
            if agreed != "ok":
                break
        _save(out, results)
        # A thread the candidate left running could call collectives in the next candidate's
        # group: only a fresh launch is safe from it.
        if agreed == "failed" and not stray and _leave_group(timeout_s + 3.0):
            current = None  # the next candidate starts in a fresh group
        elif agreed != "ok" or stray:  # torchrun ends any rank still busy when this one exits
            sys.stdout.flush()
            os._exit(3)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
