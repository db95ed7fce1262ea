"""Exercise 07.5: the global RANK torchrun gives from node rank and local rank (checked here)."""
from __future__ import annotations

import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import as_whole, call_case, returned

#: (nodes, processes per node): the stored ones, then layouts where nproc_per_node is not 2
#: or 4 and nnodes is not 2 (a constant standing in for either fails), and draws from a seed.
_LAYOUTS = [(2, 2), (2, 4), (3, 2), (4, 3), (1, 5), (5, 1), (3, 7)]
_RNG = random.Random(65)
_LAYOUTS += [(_RNG.randint(1, 8), _RNG.randint(1, 16)) for _ in range(6)]


def _run(fn) -> list[str]:
    for nnodes, nproc in _LAYOUTS:
        got = {}
        for node in range(nnodes):
            for local in range(nproc):
                raw = call_case(fn, (node, local, nproc),
                                f"(node_rank={node}, local_rank={local}, nproc_per_node={nproc})")
                got[node, local] = returned(raw, "a whole number (the global RANK)", as_whole)
        seen = {}
        for (node, local), rank in got.items():
            if rank in seen:
                (n0, l0) = seen[rank]
                return [f"{nnodes} nodes x {nproc} processes: node {n0}, local rank {l0} and node "
                        f"{node}, local rank {local} would share RANK {rank}; every process "
                        "needs its own."]
            seen[rank] = (node, local)
        for (node, local), rank in got.items():
            want = node * nproc + local
            if rank == want:
                continue
            msg = (f"{nnodes} nodes x {nproc} processes: node {node}, local rank {local} got "
                   f"RANK {rank}, torchrun gives {want}")
            if rank == local * nnodes + node:
                msg += ": torchrun numbers the ranks node by node, not round-robin"
            return [msg + "."]
    return []


register(Exercise(
    "07.5", "global rank from node rank and local rank",
    task="Write global_rank(node_rank, local_rank, nproc_per_node) -> int: the RANK torchrun "
         "gives the process with LOCAL_RANK local_rank on node node_rank (GROUP_RANK).",
    signature="fn(node_rank: int, local_rank: int, nproc_per_node: int) -> int",
    reference=S.global_rank, run_local=_run,
    checked="every process of 13 layouts, 1 to 8 nodes x 1 to 16 processes"))
