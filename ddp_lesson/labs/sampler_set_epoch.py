"""Does the data order change between epochs? Each rank runs epochs without and with set_epoch.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.sampler_set_epoch \\
        --dataset-len 8 --epochs 3

Every rank runs the epoch loop of a ``DataLoader`` over a shuffled
:class:`ddp_lesson.sampler.DistributedSampler` twice, without ``sampler.set_epoch(epoch)``
(the seed script's loop) and with it; rank 0 prints the gathered indices side by side.
Without, every epoch repeats epoch 0 (seeded ``seed + 0``, docs/pitfalls.md A1); with, each
epoch is a new permutation that still covers the dataset once. Notebook 02 runs it.
"""
from __future__ import annotations

import argparse

from torch.utils.data import DataLoader

from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.labs import gather
from ddp_lesson.sampler import DistributedSampler


def epoch_orders(n: int, num_replicas: int, rank: int, epochs: int, seed: int,
                 call_set_epoch: bool, batch_size: int = 2) -> list[list[int]]:
    """The indices this rank's DataLoader yields in each of ``epochs`` epochs (local: the
    sampler is told ``num_replicas`` and ``rank``). Returns ``orders[e]``, epoch ``e``'s indices.
    """
    dataset = range(n)  # item i is the integer i, so a batch shows which indices it holds
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                 shuffle=True, seed=seed)
    # shuffle=False on the DataLoader: the sampler does the shuffling (a DataLoader refuses
    # shuffle=True together with a sampler)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            # before iter(loader): the epoch's order is fixed when the iterator is created
            sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            seen += batch.tolist()  # a training step would use the batch here
        orders.append(seen)
    return orders


def _fmt(xs) -> str:
    return "[" + ",".join(str(x) for x in xs) + "]"


def main(n: int = 8, epochs: int = 3, seed: int = 0) -> None:
    """Run under torchrun: every rank runs both loops; rank 0 prints the orders and the facts.
    Synchronises: one ``all_gather_object`` (and the group's setup and teardown).
    """
    env = init_distributed(timeout=60)
    R = env.world_size
    without = epoch_orders(n, R, env.rank, epochs, seed, call_set_epoch=False)
    with_ = epoch_orders(n, R, env.rank, epochs, seed, call_set_epoch=True)
    print(f"my epochs are all the same without set_epoch: "
          f"{all(o == without[0] for o in without)}; "
          f"all different with it: {len({tuple(o) for o in with_}) == epochs}")
    gathered = gather((without, with_))
    if env.is_main:
        print(f"N={n}, {R} ranks, shuffle=True, seed={seed}: indices each rank got, per epoch")
        width = R * (len(_fmt(without[0])) + 4)
        print(f"epoch | {'without set_epoch':<{width}}| with set_epoch(epoch)")
        for e in range(epochs):
            left = " ".join(f"r{r} {_fmt(gathered[r][0][e])}" for r in range(R))
            right = " ".join(f"r{r} {_fmt(gathered[r][1][e])}" for r in range(R))
            print(f"{e:>5} | {left:<{width}}| {right}")
        per_epoch_without = [[i for r in range(R) for i in gathered[r][0][e]]
                             for e in range(epochs)]
        per_epoch_with = [[i for r in range(R) for i in gathered[r][1][e]]
                          for e in range(epochs)]
        print("without set_epoch, every epoch repeats epoch 0:",
              all(o == per_epoch_without[0] for o in per_epoch_without))
        print(f"with set_epoch, the {epochs} epochs are all different:",
              len({tuple(o) for o in per_epoch_with}) == epochs)
        covers = all(sorted(o) == list(range(n)) for o in per_epoch_with)
        print(f"with set_epoch, each epoch still covers 0..{n - 1} exactly once:", covers)
    cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset-len", type=int, default=8, help="dataset length N")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.dataset_len, a.epochs, a.seed)
