"""Exercise 00.3: the GPU index (LOCAL_RANK) of a global rank, checked in this process."""
from __future__ import annotations

import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import as_whole, call_case, returned, shown

#: (processes per node, nodes): the stored ones first, then sizes that are not powers of two
#: (``rank & (nproc - 1)`` is right only for those), one node, and draws from a fixed seed.
_LAYOUTS = [(4, 2), (2, 3), (8, 2), (3, 2), (6, 3), (1, 4), (5, 1), (7, 3)]
_RNG = random.Random(3)
_LAYOUTS += [(_RNG.randint(1, 16), _RNG.randint(1, 6)) for _ in range(8)]


def _run(fn) -> list[str]:
    for nproc, nnodes in _LAYOUTS:
        for rank in range(nproc * nnodes):
            raw = call_case(fn, (rank, nproc), f"(rank={rank}, nproc_per_node={nproc})")
            got = returned(raw, "a whole number (the GPU index)", as_whole)
            want = rank % nproc
            if got != want:
                hint = ""
                if got == rank // nproc:
                    hint = " (that is the node's number, not the GPU's)"
                elif got == rank:
                    hint = (" (the global rank: on node 1 and beyond there is no GPU with that "
                            "number, the mistake behind the legacy --local_rank pitfall, C1)")
                return [f"rank {rank} with {nproc} processes per node on {nnodes} nodes: got "
                        f"{shown(raw)}, expected {want}{hint}. Each node numbers its GPUs 0 to "
                        f"{nproc - 1}: rank {rank} is node {rank // nproc}'s process {want}."]
    return []


register(Exercise(
    "00.3", "GPU index from the global rank",
    task="Write local_rank_from_rank(rank, nproc_per_node) -> int: which GPU of its node the "
         "process with global rank `rank` uses when every node runs nproc_per_node processes.",
    signature="fn(rank: int, nproc_per_node: int) -> int",
    reference=S.local_rank_from_rank, run_local=_run,
    checked="every rank of 16 layouts, 1 to 16 processes per node on 1 to 6 nodes"))
