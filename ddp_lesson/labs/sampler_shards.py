"""Who got which samples? Each rank iterates its sampler; rank 0 gathers and checks the shards.

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.sampler_shards

Every rank runs one epoch of a ``DataLoader`` over a
:class:`ddp_lesson.sampler.DistributedSampler` (rank and world size from the process group);
rank 0 prints the gathered lists and whether they are *disjoint* and *cover the dataset*, in
four settings: N divisible by R; not divisible (padding repeats samples); with
``drop_last=True`` (the tail dropped); every rank seeding with its own rank
(docs/pitfalls.md A2: overlaps *and* misses). Notebook 02 runs it on 3 ranks.
"""
from __future__ import annotations

import argparse
from collections import Counter

from torch.utils.data import DataLoader

from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.labs import gather
from ddp_lesson.sampler import DistributedSampler


def local_shard(n: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, batch_size: int = 2) -> list[int]:
    """The indices this rank's DataLoader yields in one epoch (needs a process group: the
    sampler reads ``num_replicas`` and ``rank`` from it, a local query).
    """
    dataset = range(n)
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False)
    return [i for batch in loader for i in batch.tolist()]


def gather_shards(n: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                  drop_last: bool = False) -> list[list[int]]:
    """Every rank's one-epoch index list, on every rank: ``shards[r]`` is rank r's. A
    collective; ranks may pass different ``seed``/``epoch`` to show what that breaks (A2).
    """
    return gather(local_shard(n, shuffle, seed, epoch, drop_last))


def partition_facts(shards: list[list[int]], n: int) -> dict:
    """Disjoint? Covering? Which samples repeat, which are missed? Pure.

    Returns:
        ``disjoint``, ``covers`` (every index of ``range(n)`` somewhere), ``repeated`` (sorted
        extra occurrences: an index seen k times appears k-1 times), ``missing``, ``total``.
    """
    counts = Counter(i for shard in shards for i in shard)
    repeated = sorted(i for i, c in counts.items() for _ in range(c - 1))
    missing = [i for i in range(n) if i not in counts]
    return {"disjoint": not repeated, "covers": not missing, "repeated": repeated,
            "missing": missing, "total": sum(counts.values())}


def _report(title: str, shards: list[list[int]], n: int) -> None:
    f = partition_facts(shards, n)
    print(title)
    for r, shard in enumerate(shards):
        print(f"  rank {r}: {shard}")
    line = f"  disjoint: {f['disjoint']} | covers all: {f['covers']}"
    if f["repeated"]:
        line += f" | repeated: {f['repeated']}"
    if f["missing"]:
        line += f" | never seen: {f['missing']}"
    print(line)


def main(seed: int = 0, epoch: int = 0) -> None:
    """Run under torchrun (best with 3 processes); rank 0 prints the four settings.
    Synchronises: one ``all_gather_object`` per setting, plus setup and teardown.
    """
    env = init_distributed(timeout=60)
    R = env.world_size
    # 4R - 2 is not a multiple of an odd R >= 3; 4R - 1 is not a multiple of an even R
    n_even, n_odd = 4 * R, (4 * R - 2 if R % 2 else 4 * R - 1)
    cases = [
        (f"N={n_even}, shuffle=True, seed={seed}, set_epoch({epoch}) on every rank:",
         n_even, dict(seed=seed, epoch=epoch)),
        (f"N={n_odd} (not divisible by {R}), drop_last=False: padded by wrapping round",
         n_odd, dict(seed=seed, epoch=epoch)),
        (f"N={n_odd}, drop_last=True: the tail is cut",
         n_odd, dict(seed=seed, epoch=epoch, drop_last=True)),
        (f"N={n_even}, each rank seeds with its own rank number (the A2 bug):",
         n_even, dict(seed=env.rank, epoch=epoch)),
    ]
    for title, n, kw in cases:
        shards = gather_shards(n, **kw)
        if env.is_main:
            _report(title, shards, n)
    cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    a = p.parse_args()
    main(a.seed, a.epoch)
