"""Worker of a distributed exercise checker; started by :func:`ddp_lesson.exercises.check`.

    torchrun --nproc-per-node R -m ddp_lesson.exercises._runner EXERCISE_ID CANDIDATES.pkl OUTDIR

Each rank joins a gloo process group with a short timeout, loads the candidates
(cloudpickled: a learner's function travels by value), runs the exercise's ``run_rank`` on
each, and after each one rewrites ``OUTDIR/result{RANK}.pkl`` with everything it has so far,
so that a later hang or crash loses nothing already judged. A candidate that raises ends the
list: its collectives may have left the ranks out of step.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(argv=None) -> int:
    import cloudpickle
    import torch.distributed as dist

    from ..env import init_distributed
    from . import core

    exercise_id, payload, outdir = (argv or sys.argv[1:])[:3]
    env = init_distributed(timeout=core.COLLECTIVE_TIMEOUT_S, backend="gloo", announce=False)
    ex = core.get(exercise_id)
    candidates = cloudpickle.loads(Path(payload).read_bytes())
    out = Path(outdir) / f"result{env.rank}.pkl"
    results = []
    for fn in candidates:
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
