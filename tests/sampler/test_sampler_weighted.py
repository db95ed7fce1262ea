"""DistributedWeightedSampler and IterableShard (docs/pitfalls.md A11,
A12, A13), and the labs that notebook 02's deep dive on them launches
(``notebooks/deep/02_weighted_streams_and_seeds.ipynb``: weighted sampling, streams, seeds).

Expectations come from torch's own pieces: ``WeightedRandomSampler`` with a generator seeded
``seed + epoch`` (the draw), torch's ``DistributedSampler`` (its dealing, and the trap of
wrapping a weighted sampler), real ``DataLoader`` workers, and the worker seeding rule of
``torch/utils/data/_utils/worker.py`` (``random`` and ``torch`` get ``base_seed + worker_id``,
``base_seed`` drawn from the loader's generator or the global one). The labs' runs are the deep
dive's cells as stored
(3 and 2 processes; nbval's replay reruns them): one job, one launch (docs/architecture.md).
"""
from __future__ import annotations

import math

import pytest
import torch
from notebook_cells import StoredRun
from sampler_reference import torch_shards
from torch.utils.data import DataLoader, WeightedRandomSampler
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.labs.sampler_streams import CountingStream
from ddp_lesson.sampler import (
    DistributedSampler,
    DistributedWeightedSampler,
    IterableShard,
    iterable_shard_counts,
    weighted_draw,
    weighted_padded_draw,
)

W = [2.0] * 50 + [1.0] * 50

NB = "deep/02_weighted_streams_and_seeds.ipynb"


def torch_draw(weights, n, replacement=True, seed=0, epoch=0):
    """torch's WeightedRandomSampler with a generator seeded seed + epoch."""
    g = torch.Generator().manual_seed(seed + epoch)
    return list(WeightedRandomSampler(weights, n, replacement=replacement, generator=g))


def shards_of(weights, n, R, **kw):
    samplers = [DistributedWeightedSampler(weights, n, num_replicas=R, rank=r, **kw)
                for r in range(R)]
    return samplers, [list(s) for s in samplers]


# --------------------------------------------------------------------------- the issue's case

def test_issue_case_r8_thirteen_per_rank_interleaving_gives_back_the_padded_draw():
    samplers, shards = shards_of(W, 100, 8)
    assert [len(s) for s in samplers] == [13] * 8
    assert [len(s) for s in shards] == [13] * 8
    draw = torch_draw(W, 100)
    padded = draw + draw[:4]               # padded with its own first elements to 104
    assert weighted_padded_draw(W, 100, 8) == padded
    assert [shards[r][j] for j in range(13) for r in range(8)] == padded
    assert all(shards[r] == padded[r::8] for r in range(8))
    assert weighted_draw(W, 100) == draw


def test_every_rank_draws_the_same_and_set_epoch_moves_them_together():
    samplers, _ = shards_of(W, 100, 3, seed=7)
    for s in samplers:
        s.set_epoch(2)
    draws = {tuple(s.padded_draw()) for s in samplers}
    assert len(draws) == 1
    draw = torch_draw(W, 100, seed=7, epoch=2)
    assert list(draws.pop()) == draw + draw[:2]
    assert draw != torch_draw(W, 100, seed=7, epoch=0)


def test_drop_last_cuts_the_tail_and_tiny_draws_wrap_round_several_times():
    _, shards = shards_of(W, 100, 8, drop_last=True)
    draw = torch_draw(W, 100)
    assert [len(s) for s in shards] == [12] * 8
    assert [shards[r][j] for j in range(12) for r in range(8)] == draw[:96]
    _, tiny = shards_of(W, 3, 8)                       # 3 draws, 8 ranks: 8 slots
    d3 = torch_draw(W, 3)
    assert [t[0] for t in tiny] == (d3 * 3)[:8]
    with pytest.warns(UserWarning, match=r"num_samples=3 is smaller than num_replicas R=8"):
        s = DistributedWeightedSampler(W, 3, num_replicas=8, rank=0, drop_last=True)
    assert len(s) == 0 and list(s) == []


def test_without_replacement_matches_torch_and_never_repeats_before_padding():
    _, shards = shards_of(W, 10, 3, replacement=False, seed=3)
    draw = torch_draw(W, 10, replacement=False, seed=3)
    assert len(set(draw)) == 10
    assert [shards[r][j] for j in range(4) for r in range(3)] == draw + draw[:2]


def test_weights_as_a_tensor_and_zero_weights_are_never_drawn():
    w = torch.tensor([0.0, 1.0, 0.0, 3.0])
    _, shards = shards_of(w, 50, 2)
    assert set(shards[0] + shards[1]) <= {1, 3}


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(weights=W, num_samples=100, num_replicas=8, rank=8), ValueError,
     r"rank 8 is outside \[0, 7\] \(num_replicas=8\)"),
    (dict(weights=W, num_samples=100, num_replicas=8, rank=-1), ValueError,
     r"rank -1 is outside \[0, 7\]"),
    (dict(weights=W, num_samples=0, num_replicas=2, rank=0), ValueError,
     r"num_samples must be >= 1, got 0"),
    (dict(weights=[1.0, 2.0, -0.5, 1.0], num_samples=4, num_replicas=2, rank=0), ValueError,
     r"weights must be >= 0: weights\[2\] = -0.5 \(1 of 4 negative\)"),
    (dict(weights=[0.0, 0.0, 0.0], num_samples=4, num_replicas=2, rank=0), ValueError,
     r"weights are all zero \(3 of them\)"),
    (dict(weights=[1.0, float("nan")], num_samples=4, num_replicas=2, rank=0), ValueError,
     r"weights must be finite: weights\[1\] = nan"),
    (dict(weights=[], num_samples=4, num_replicas=2, rank=0), ValueError,
     r"non-empty 1-D sequence, got shape \(0,\)"),
    (dict(weights=[1.0, 0.0, 2.0, 0.0, 5.0], num_samples=4, num_replicas=2, rank=0,
          replacement=False), ValueError,
     r"replacement=False cannot draw num_samples=4 distinct indices: only 3 of the 5 weights"),
    (dict(weights=W, num_samples=2.5, num_replicas=2, rank=0), TypeError,
     r"num_samples must be an int, got 2.5"),
    (dict(weights=W, num_samples=10), RuntimeError,
     r"num_replicas and rank not given and no default process group"),
])
def test_bad_input_names_the_numbers(kwargs, error, message):
    with pytest.raises(error, match=message):
        DistributedWeightedSampler(**kwargs)


def test_trap_distributed_sampler_around_a_weighted_sampler_yields_positions():
    # torch's DistributedSampler uses only len() of what it wraps: positions 0, 8, ..., 96
    trap = TorchSampler(WeightedRandomSampler(W, 100), num_replicas=8, rank=0, shuffle=False)
    assert list(trap) == list(range(0, 100, 8)) == [0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80,
                                                    88, 96]
    ours = DistributedSampler(WeightedRandomSampler(W, 100), num_replicas=8, rank=0,
                              shuffle=False)
    assert list(ours) == list(trap)
    # shuffled, it is a uniform permutation of the positions: the weights never enter
    shuffled = [TorchSampler(WeightedRandomSampler(W, 100), num_replicas=8, rank=r)
                for r in range(8)]
    every = [i for s in shuffled for i in s]
    assert len(every) == 104 and set(every) == set(range(100))  # 4 padded repeats
    # items 0-49 come up about half the time (50 + the repeats among them), not two thirds:
    # the deep dive prints "draws from items 0-49: 52 of 104"
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
    assert sum(i < 50 for i in every) == 50 + sum(i < 50 for i in perm[:4]) == 52


# --------------------------------------------------------------------------- IterableShard

def _rank_items(n, R, rank, workers, batch_size):
    loader = DataLoader(IterableShard(CountingStream(n), num_replicas=R, rank=rank),
                        batch_size=batch_size, num_workers=workers)
    batches = [b.tolist() for b in loader]
    return [i for b in batches for i in b], len(batches)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_issue_case_103_items_two_ranks_two_real_workers_each_item_once():
    got = [_rank_items(103, 2, r, workers=2, batch_size=5) for r in range(2)]
    items = sorted(i for rank_items, _ in got for i in rank_items)
    assert items == list(range(103))
    assert [len(rank_items) for rank_items, _ in got] == [52, 51]
    assert iterable_shard_counts(103, 2, 2) == [[26, 26], [26, 25]]
    assert [nb for _, nb in got] == [12, 11]      # uneven batch counts: 6 + 6 and 6 + 5
    # reader k = rank * W + worker keeps items k, k + 4, ...: rank 1 worker 1 starts at 3
    assert sorted(got[1][0])[:4] == [2, 3, 6, 7]


def test_iterable_shard_without_workers_strides_by_rank_and_checks_the_rank():
    for r in range(3):
        assert list(IterableShard(range(10), num_replicas=3, rank=r)) == list(range(r, 10, 3))
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 1\]"):
        IterableShard(range(10), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"num_workers must be >= 1, got 0"):
        iterable_shard_counts(10, 2, 0)


# ------------------------------------------------------------------------ the labs, on real ranks

# One job, one launch (docs/architecture.md): notebook 02's deep dive runs both labs with these
# arguments (the labs' defaults); the tests read its stored output, which nbval's replay reruns and
# compares, instead of launching the same jobs again.
@pytest.fixture(scope="module")
def weighted_run():
    run = StoredRun(NB, "from ddp_lesson.labs.sampler_weighted import main",
                    "%%torchrun --nproc-per-node 3\n"
                    "from ddp_lesson.labs.sampler_weighted import main\n\n"
                    "main(num_samples=100, seed=0)")
    assert run.other == ["[torchrun] 3 processes and no GPU: using gloo on CPU"]
    return run


@pytest.mark.timeout(150)
def test_weighted_lab_three_ranks_draw_the_same_sequence(weighted_run):
    lines = weighted_run.rank_lines(0)
    draw = torch_draw(W, 100)
    padded = draw + draw[:2]
    assert "len(sampler) on every rank: [34, 34, 34]; 102 slots, the draw's first 2 dealt again" \
        in lines
    for r in range(3):
        head = ", ".join(map(str, padded[r::3][:10]))
        assert f"  rank {r}: [{head}, ...] (34)" in lines
    for fact in ("every rank drew the same 100 indices: True",
                 "interleaving the 3 shards gives back the padded draw: True",
                 "set_epoch(1): a new draw: True | the same on every rank: True",
                 "  and its interleaved shards give it back: True",
                 "  every rank got positions r, r+3, ... of 0..99: True",
                 "  rank 0: [0, 3, 6, 9, 12, 15, ...] (34): positions, not weighted draws"):
        assert fact in lines, "\n".join(lines)
    heavy = sum(i < 50 for i in draw)
    assert f"draws from items 0-49 (weight 2.0): {heavy} of 100 (expected 66.7)" in lines
    assert weighted_run.rank_lines(1) == [] and weighted_run.rank_lines(2) == []


@pytest.fixture(scope="module")
def streams_run():
    return StoredRun(NB, "from ddp_lesson.labs.sampler_streams import main",
                     "%%torchrun --nproc-per-node 2\n"
                     "from ddp_lesson.labs.sampler_streams import main\n\n"
                     'main()   # part="stream", then part="seeds" (section 3)')


def _loader_order(n, R, rank, workers, batch_size):
    """The order a DataLoader with ``workers`` workers yields a rank's stream: round robin."""
    per_worker = [list(range(rank * workers + w, n, R * workers)) for w in range(workers)]
    batches = [[b[i:i + batch_size] for i in range(0, len(b), batch_size)] for b in per_worker]
    order = []
    for k in range(max(map(len, batches))):
        order += [x for w in range(workers) if k < len(batches[w]) for x in batches[w][k]]
    return order, sum(map(len, batches))


@pytest.mark.timeout(150)
def test_streams_lab_each_item_once_and_equalised_batches(streams_run):
    lines = streams_run.rank_lines(0)
    text = "\n".join(lines)
    for r, (count, pw) in enumerate([(52, [26, 26]), (51, [26, 25])]):
        order, nb = _loader_order(103, 2, r, 2, 5)
        assert len(order) == count
        assert f"  rank {r}: {count} items in {nb} batches (per worker {pw}), first {order[:6]}" \
            in lines, text
    for fact in ("every item 0..102 exactly once across ranks and workers: True",
                 "without IterableShard each worker reads it all: item 0 comes 4 times "
                 "([2, 2] per rank)",
                 "batches per rank: [12, 11]: one all_reduce per batch runs 12 vs 11 times",
                 "  -> rank 0's all_reduce number 12 has no partner: it waits until the timeout",
                 "equalised: each step first an all_reduce(MIN) of 'I still have a batch'",
                 "  steps per rank [11, 11], gradient all_reduces per rank [11, 11]: they match",
                 "  batches left unused this epoch: [1, 0]"):
        assert fact in lines, text


def _expected_draws(base_gen_seed, rank, R=2, n=8, workers=2, batch_size=2):
    """Each worker's draws from torch's rule: worker w is seeded base_seed + w, where base_seed
    is one int64 drawn from the generator the loader uses (global or its own)."""
    g = torch.Generator().manual_seed(base_gen_seed)
    base = int(torch.empty((), dtype=torch.int64).random_(generator=g))
    per_rank = math.ceil(n / R)
    batches_of = {w: len(range(w, math.ceil(per_rank / batch_size), workers))
                  for w in range(workers)}
    out = {}
    for w in range(workers):
        gw = torch.Generator().manual_seed(base + w)
        out[w] = [int(torch.randint(0, 100, (), generator=gw)) for _ in
                  range(batches_of[w] * batch_size)]
    return out


def _draws_line(d):
    return " | ".join(f"worker {w}: {d[w]}" for w in sorted(d))


@pytest.mark.timeout(150)
def test_streams_lab_seeds_differ_per_rank_and_worker_only_when_the_rank_enters(streams_run):
    lines = streams_run.rank_lines(0)
    text = "\n".join(lines)
    same = [_expected_draws(0, r) for r in range(2)]          # torch.manual_seed(0) everywhere
    per_rank = [_expected_draws(0 + r, r) for r in range(2)]  # loader generator seed 0 + rank
    i = lines.index("torch.manual_seed(0) on every rank:")
    assert lines[i + 1:i + 4] == [f"  rank 0: {_draws_line(same[0])}",
                                  f"  rank 1: {_draws_line(same[1])}",
                                  "  the ranks draw the same: True | all 4 (rank, worker) "
                                  "streams differ: False"], text
    j = lines.index("DataLoader(generator=Generator().manual_seed(0 + rank)):")
    assert lines[j + 1:j + 4] == [f"  rank 0: {_draws_line(per_rank[0])}",
                                  f"  rank 1: {_draws_line(per_rank[1])}",
                                  "  the ranks draw the same: False | all 4 (rank, worker) "
                                  "streams differ: True"], text
    shards = [sorted(s) for s in torch_shards(8, 2, True, seed=0)]
    assert f"sampler seed 0 everywhere: shards {shards}, a partition: True" in lines, text
