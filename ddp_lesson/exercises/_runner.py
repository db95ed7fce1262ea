"""Worker of a distributed exercise checker; started by :func:`ddp_lesson.exercises.check`.

    torchrun --nproc-per-node R -m ddp_lesson.exercises._runner EXERCISE_ID CANDIDATES.pkl OUTDIR TIMEOUT_S

Each rank joins a gloo process group with a short timeout (TIMEOUT_S seconds), loads the candidates
(cloudpickled: a learner's function travels by value), runs the exercise's ``run_rank`` on
each, and after each one rewrites ``OUTDIR/result{RANK}.pkl`` with everything it has so far,
so that a later hang or crash loses nothing already judged. A candidate that raises ends the
list: its collectives may have left the ranks out of step.
"""
from __future__ import annotations

import linecache
import pickle
import sys
from pathlib import Path


def main(argv=None) -> int:
    import cloudpickle
    import torch.distributed as dist

    from ..env import init_distributed
    from . import core

    exercise_id, payload, outdir, timeout_s = (argv or sys.argv[1:])[:4]
    env = init_distributed(timeout=float(timeout_s), backend="gloo", announce=False)
    ex = core.get(exercise_id)
    loaded = cloudpickle.loads(Path(payload).read_bytes())
    out = Path(outdir) / f"result{env.rank}.pkl"
    results = []
    for fn, lines in zip(loaded["candidates"], loaded["sources"]):
        for code in core._code_objects(fn):  # so a traceback shows the learner's lines
            if lines:
                linecache.cache[code.co_filename] = (sum(map(len, lines)), None, lines,
                                                     code.co_filename)
        try:
            res = ex.run_rank(fn, env.rank, env.world_size)
        except Exception as exc:
            results.append(core.error_record(exc))
            out.write_bytes(pickle.dumps(results))
            break
        results.append(res)
        out.write_bytes(pickle.dumps(results))
    else:
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
