"""Weighted sampling across ranks: every rank draws the same weighted list and takes its stride.

    torchrun --standalone --nproc-per-node 3 -m ddp_lesson.labs.sampler_weighted

``torch.utils.data.WeightedRandomSampler`` has no distributed form. Every rank runs one epoch
of a :class:`ddp_lesson.sampler.DistributedWeightedSampler` over 100 items (:data:`WEIGHTS`);
rank 0 prints that every rank drew the same list, that the interleaved shards give back the
padded draw, that ``set_epoch`` changes the draw everywhere together, and the weights in the
counts. Then the silent trap: torch's ``DistributedSampler(WeightedRandomSampler(...))``
deals out *positions* ``0..99``, never using the weights. Notebook 02's deep dive runs it.
"""
from __future__ import annotations

import argparse

from torch.utils.data import DataLoader, WeightedRandomSampler
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.labs import gather
from ddp_lesson.sampler import DistributedWeightedSampler

#: Weight 2.0 for items 0..49, 1.0 for items 50..99: a 2:1 split whose effect a count of one
#: epoch shows plainly (about 2/3 of the draws from the first half).
WEIGHTS = [2.0] * 50 + [1.0] * 50


def one_epoch(sampler, batch_size: int = 10) -> list[int]:
    """The dataset indices this rank's DataLoader yields for one epoch (local)."""
    loader = DataLoader(range(len(WEIGHTS)), batch_size=batch_size, sampler=sampler)
    return [i for batch in loader for i in batch.tolist()]


def _interleave(shards: list[list[int]]) -> list[int]:
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


def _fmt(xs: list[int], k: int = 10) -> str:
    head = ", ".join(map(str, xs[:k]))
    return f"[{head}, ...] ({len(xs)})" if len(xs) > k else f"[{head}]"


def main(num_samples: int = 100, seed: int = 0) -> None:
    """Run under torchrun (3 processes in the notebook); rank 0 prints, every rank checks.
    Synchronises: six ``all_gather_object`` calls, plus setup and teardown.
    """
    env = init_distributed(timeout=60)
    R = env.world_size
    say = print if env.is_main else (lambda *a, **k: None)
    sampler = DistributedWeightedSampler(WEIGHTS, num_samples, seed=seed)
    shards = gather(one_epoch(sampler))
    draws = gather(sampler.padded_draw())           # each rank's view of the whole draw
    lengths = gather(len(sampler))
    sampler.set_epoch(1)
    shards1 = gather(one_epoch(sampler))
    draws1 = gather(sampler.padded_draw())

    padded = draws[0]
    say(f"weights 2.0 for items 0-49, 1.0 for 50-99; num_samples={num_samples}, R={R}, "
        f"seed={seed}")
    say(f"len(sampler) on every rank: {lengths}; {len(padded)} slots, the draw's first "
        f"{len(padded) - num_samples} dealt again")
    for r, shard in enumerate(shards):
        say(f"  rank {r}: {_fmt(shard)}")
    say(f"every rank drew the same {num_samples} indices: {all(d == padded for d in draws)}")
    say(f"interleaving the {R} shards gives back the padded draw: {_interleave(shards) == padded}")
    heavy = sum(i < 50 for i in padded[:num_samples])
    say(f"draws from items 0-49 (weight 2.0): {heavy} of {num_samples} "
        f"(expected {num_samples * 2 / 3:.1f})")
    same1 = all(d == draws1[0] for d in draws1)
    say(f"set_epoch(1): a new draw: {draws1[0] != padded} | the same on every rank: {same1}")
    say(f"  and its interleaved shards give it back: {_interleave(shards1) == draws1[0]}")

    # the trap: a DistributedSampler sees only len() of what it wraps
    trap = TorchDistributedSampler(WeightedRandomSampler(WEIGHTS, num_samples),
                                   num_replicas=R, rank=env.rank, shuffle=False)
    trapped = gather(list(trap))
    say(f"torch's DistributedSampler(WeightedRandomSampler(w, {num_samples}), shuffle=False):")
    say(f"  rank 0: {_fmt(trapped[0], 6)}: positions, not weighted draws")
    positions = all(t == [p % num_samples for p in range(r, len(padded), R)]
                    for r, t in enumerate(trapped))
    say(f"  every rank got positions r, r+{R}, ... of 0..{num_samples - 1}: {positions}")
    cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    main(a.num_samples, a.seed)
