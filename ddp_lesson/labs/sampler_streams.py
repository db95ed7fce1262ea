"""Streaming data and random seeds: split a stream by rank and worker; which seeds must differ.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.sampler_streams --part all

Two parts, each with a ``DataLoader`` of 2 workers on every rank (notebook 02's deep dive,
``notebooks/deep/02_weighted_streams_and_seeds.ipynb``, runs both in one cell):

* ``stream``: 103 items of an ``IterableDataset`` read through
  :class:`ddp_lesson.sampler.IterableShard` (reader ``rank * W + worker`` takes every
  ``R * W``-th item): every item exactly once; without it every reader reads everything.
  The shards are uneven (12 and 11 batches of 5), so one collective per batch would leave
  rank 0's last without a partner; the cure (an all_reduce MIN of "I still have a batch"
  each step) is run and each rank's collectives counted.
* ``seeds``: an augmentation's draws in each worker with ``torch.manual_seed(0)`` on every
  rank (the ranks draw the *same* numbers: worker w is seeded ``base_seed + w``, drawn from
  the rank's seeded generator), then with the DataLoader's generator seeded ``seed + rank``
  (all differ); the sampler's seed stays the same everywhere (a partition).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ddp_lesson.env import cleanup, init_distributed, reduce_device
from ddp_lesson.labs import gather
from ddp_lesson.sampler import DistributedSampler, IterableShard


class CountingStream(IterableDataset):
    """The items ``0, 1, ..., n - 1``, one after another: a stand-in for lines of a corpus."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class AugmentedItems(Dataset):
    """Item ``i`` is ``(i, worker id, an "augmentation" draw torch.randint(0, 100))``, drawn
    from the loading process's generator (a worker's: seeded ``base_seed + worker_id``).
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        worker = -1 if info is None else info.id
        return i, worker, int(torch.randint(0, 100, ()).item())


# --------------------------------------------------------------------------- part 1: stream

def stream_part(env, n: int = 103, workers: int = 2, batch_size: int = 5) -> None:
    """Read a stream split by IterableShard; rank 0 prints the partition and the batch counts.

    Synchronises: ``all_gather_object`` (three times) and one ``all_reduce`` per step of the
    equalised loop, plus one per batch of its stand-in gradient.
    """
    R = env.world_size
    say = print if env.is_main else (lambda *a, **k: None)

    def loader(dataset):
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers)

    batches = [b.tolist() for b in loader(IterableShard(CountingStream(n)))]
    mine = [i for b in batches for i in b]
    per_worker = [sum(1 for i in mine if i % (R * workers) == env.rank * workers + w)
                  for w in range(workers)]
    gathered = gather((mine, len(batches), per_worker))
    say(f"a stream of {n} items, {R} ranks x {workers} DataLoader workers = {R * workers} "
        f"readers; batch {batch_size}")
    for r, (items, nb, pw) in enumerate(gathered):
        say(f"  rank {r}: {len(items)} items in {nb} batches (per worker {pw}), "
            f"first {items[:6]}")
    everything = sorted(i for items, _, _ in gathered for i in items)
    say(f"every item 0..{n - 1} exactly once across ranks and workers: "
        f"{everything == list(range(n))}")
    plain = [i for b in loader(CountingStream(n)) for i in b.tolist()]  # no split at all
    copies = gather(plain.count(0))
    say(f"without IterableShard each worker reads it all: item 0 comes {sum(copies)} times "
        f"({copies} per rank)")

    counts = [nb for _, nb, _ in gathered]
    most = max(range(R), key=lambda r: counts[r])
    say(f"batches per rank: {counts}: one all_reduce per batch runs "
        f"{' vs '.join(map(str, counts))} times")
    if len(set(counts)) > 1:
        say(f"  -> rank {most}'s all_reduce number {counts[most]} has no partner: "
            "it waits until the timeout")
    steps, reduced = _equalised_loop(batches)
    done = gather((steps, reduced))
    say("equalised: each step first an all_reduce(MIN) of 'I still have a batch'")
    say(f"  steps per rank {[s for s, _ in done]}, gradient all_reduces per rank "
        f"{[g for _, g in done]}: they match")
    say(f"  batches left unused this epoch: {[c - s for c, (s, _) in zip(counts, done)]}")
    dist.barrier()


def _equalised_loop(batches: list[list[int]]) -> tuple[int, int]:
    """Step while *every* rank has a batch (first an all_reduce MIN of a flag each step).

    Returns ``(steps, all_reduces of the stand-in gradient)``, equal on every rank.
    """
    device = reduce_device()  # cuda:LOCAL_RANK under NCCL (CUDA tensors only), else cpu
    it = iter(batches)
    steps = reduced = 0
    while True:
        batch = next(it, None)
        flag = torch.tensor([0 if batch is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 0 as soon as any rank ran out
        if flag.item() == 0:
            return steps, reduced
        grad = torch.tensor([float(sum(batch))], device=device)  # stands in for the DDP gradient
        dist.all_reduce(grad)
        steps, reduced = steps + 1, reduced + 1


# --------------------------------------------------------------------------- part 2: seeds

def worker_draws(rank: int, num_replicas: int, loader_seed: int | None, global_seed: int,
                 n: int = 8, workers: int = 2, batch_size: int = 2,
                 sampler_seed: int = 0) -> tuple[list[int], dict[int, list[int]]]:
    """One epoch on this rank: its indices and each worker's augmentation draws (local).

    ``torch.manual_seed(global_seed)`` just before the epoch; with ``loader_seed`` the
    DataLoader gets its own generator, from which ``iter(loader)`` draws the workers'
    ``base_seed``. The sampler is seeded ``sampler_seed`` on every rank.

    Returns:
        ``(indices, {worker: [draws in order]})``.
    """
    data = AugmentedItems(n)
    sampler = DistributedSampler(data, num_replicas=num_replicas, rank=rank, seed=sampler_seed)
    generator = None if loader_seed is None else torch.Generator().manual_seed(loader_seed)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        generator=generator, worker_init_fn=_check_worker_seed)
    torch.manual_seed(global_seed)
    indices, draws = [], {}
    for idx, worker, draw in loader:
        indices += idx.tolist()
        for w, d in zip(worker.tolist(), draw.tolist()):
            draws.setdefault(w, []).append(d)
    return indices, draws


def _check_worker_seed(worker_id: int) -> None:
    """A worker_init_fn checking what torch gave this worker: ``random``, ``torch`` and
    ``numpy`` are seeded ``base_seed + worker_id`` before it runs
    (``torch/utils/data/_utils/worker.py``); seed other libraries here, from ``info.seed``.
    """
    info = get_worker_info()
    assert info.id == worker_id and torch.initial_seed() == info.seed, (worker_id, info.seed)


def seeds_part(env, seed: int = 0) -> None:
    """Rank 0 prints each (rank, worker)'s augmentation draws under two seeding schemes."""
    R = env.world_size
    say = print if env.is_main else (lambda *a, **k: None)
    say(f"augmentation draws per (rank, worker): 8 samples, {R} ranks x 2 workers, batch 2")
    results = {}
    for title, loader_seed in [(f"torch.manual_seed({seed}) on every rank", None),
                               (f"DataLoader(generator=Generator().manual_seed({seed} + rank))",
                                seed + env.rank)]:
        indices, draws = worker_draws(env.rank, R, loader_seed, global_seed=seed,
                                      sampler_seed=seed)
        gathered = gather((indices, draws))
        results[title] = gathered
        say(title + ":")
        for r, (_, d) in enumerate(gathered):
            say(f"  rank {r}: " + " | ".join(f"worker {w}: {d[w]}" for w in sorted(d)))
        streams = [tuple(d[w]) for _, d in gathered for w in sorted(d)]
        distinct = len(set(streams)) == len(streams)
        say(f"  the ranks draw the same: {all(g[1] == gathered[0][1] for g in gathered)} | "
            f"all {len(streams)} (rank, worker) streams differ: {distinct}")
    shards = [sorted(ix) for ix, _ in gathered]
    union = sorted(i for s in shards for i in s)
    say(f"sampler seed {seed} everywhere: shards {shards}, a partition: "
        f"{union == list(range(8))}")


def main(part: str = "all", seed: int = 0) -> None:
    """Run under torchrun (2 processes in the notebook); ``part``: stream, seeds or all."""
    env = init_distributed(timeout=60)
    if part in ("stream", "all"):
        stream_part(env)
    if part in ("seeds", "all"):
        seeds_part(env, seed)
    cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("stream", "seeds", "all"), default="all")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.part, a.seed)
