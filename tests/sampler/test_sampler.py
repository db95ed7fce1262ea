"""ddp_lesson.sampler against torch's DistributedSampler and the cases in pitfalls.md §A.

Expected values come from torch's own sampler (``torch.utils.data.DistributedSampler``)
or are the literal values stated in the cases; nothing here is read back from the code
under test. No process group is needed: num_replicas and rank are passed explicitly.
"""
from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.core import sampler as core
from ddp_lesson.sampler import (
    DistributedEvalSampler,
    DistributedSampler,
    contiguous_shard_indices,
    global_order,
    num_samples_per_rank,
    padded_order,
    padding_count,
    shard_indices,
)

#: The one sampler (ddp_lesson.sampler's is the core's, checks included): it must equal torch's.
SAMPLERS = pytest.mark.parametrize("Sampler", [core.DistributedSampler], ids=["core"])


def test_one_sampler_implementation():
    import ddp_lesson.sampler as pkg

    for name in ("DistributedSampler", "global_order", "num_samples_per_rank"):
        assert getattr(pkg, name) is getattr(core, name), name
    assert DistributedSampler is core.DistributedSampler


def test_a_dataset_that_changed_length_is_a_clear_error():
    data = list(range(10))
    s = DistributedSampler(data, num_replicas=3, rank=0, shuffle=False)
    data.extend(range(10, 13))              # 13 items now: 5 per rank, not the 4 fixed at init
    with pytest.raises(RuntimeError, match=r"changed to 13 .*num_samples=4, num_replicas=3"):
        list(s)


def ours(n, r, rank, **kw):
    return list(DistributedSampler(range(n), num_replicas=r, rank=rank, **kw))


def theirs(n, r, rank, epoch=0, **kw):
    s = TorchSampler(range(n), num_replicas=r, rank=rank, **kw)
    s.set_epoch(epoch)
    return list(s)


def all_shards(n, r, **kw):
    return [ours(n, r, rank, **kw) for rank in range(r)]


# --------------------------------------------------------------------------- property test

@st.composite
def configs(draw):
    # half the draws small, so N < R and 2N < R (the multi-wrap padding of A7) are common
    n = draw(st.one_of(st.integers(0, 8), st.integers(0, 60)))
    r = draw(st.integers(1, 8))
    rank = draw(st.integers(0, r - 1))
    return dict(n=n, r=r, rank=rank, shuffle=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)), epoch=draw(st.integers(0, 20)),
                drop_last=draw(st.booleans()))


@pytest.mark.filterwarnings("ignore:DistributedSampler with drop_last=True")
@settings(max_examples=200, deadline=None, database=None)
@given(configs())
@SAMPLERS
def test_equals_torch_index_for_index(Sampler, c):
    kw = dict(shuffle=c["shuffle"], seed=c["seed"], drop_last=c["drop_last"])
    ref = TorchSampler(range(c["n"]), num_replicas=c["r"], rank=c["rank"], **kw)
    mine = Sampler(range(c["n"]), num_replicas=c["r"], rank=c["rank"], **kw)
    ref.set_epoch(c["epoch"])
    mine.set_epoch(c["epoch"])
    expected = list(ref)
    got = list(mine)
    assert got == expected
    assert len(mine) == len(ref) == len(got)
    assert (mine.num_samples, mine.total_size) == (ref.num_samples, ref.total_size)
    # the pure helper is the same computation, without a sampler object
    assert shard_indices(c["n"], c["r"], c["rank"], c["shuffle"], c["seed"], c["epoch"],
                         c["drop_last"]) == expected
    assert num_samples_per_rank(c["n"], c["r"], c["drop_last"]) == ref.num_samples
    if not c["drop_last"]:
        assert padding_count(c["n"], c["r"]) == ref.total_size - c["n"]


@SAMPLERS
def test_attributes_match_torch(Sampler):
    kw = dict(num_replicas=3, rank=1, shuffle=False, seed=7, drop_last=True)
    mine, ref = Sampler(range(11), **kw), TorchSampler(range(11), **kw)
    for name in ("num_replicas", "rank", "epoch", "shuffle", "seed", "drop_last",
                 "num_samples", "total_size"):
        assert getattr(mine, name) == getattr(ref, name), name
    mine.set_epoch(5)
    assert mine.epoch == 5


@SAMPLERS
def test_empty_dataset_matches_torch(Sampler):
    # N = 0: torch gives num_samples = total_size = 0 and pads nothing, either drop_last.
    for drop_last in (False, True):
        for r in (1, 3):
            assert theirs(0, r, 0, drop_last=drop_last) == []
            s = Sampler([], num_replicas=r, rank=r - 1, drop_last=drop_last)
            assert (list(s), len(s), s.total_size) == ([], 0, 0)
    assert padding_count(0, 4) == 0


# --------------------------------------------------------------------------- A1

def test_a1_without_set_epoch_every_pass_is_identical():
    s = DistributedSampler(range(22), num_replicas=1, rank=0, shuffle=True, seed=0)
    passes = [list(s) for _ in range(3)]
    assert passes[0] == passes[1] == passes[2]
    assert sorted(passes[0]) == list(range(22)) and passes[0] != list(range(22))


def test_a1_set_epoch_gives_the_seed_plus_epoch_permutation():
    s = DistributedSampler(range(22), num_replicas=1, rank=0, shuffle=True, seed=0)
    passes = []
    for e in range(3):
        s.set_epoch(e)
        passes.append(list(s))
        expected = torch.randperm(22, generator=torch.Generator().manual_seed(0 + e)).tolist()
        assert passes[-1] == expected
        assert passes[-1] == global_order(22, shuffle=True, seed=0, epoch=e)
    assert passes[0] != passes[1] != passes[2]


def test_a1_seed_and_epoch_only_enter_as_their_sum():
    a = DistributedSampler(range(22), num_replicas=1, rank=0, seed=0)
    a.set_epoch(1)
    b = DistributedSampler(range(22), num_replicas=1, rank=0, seed=1)
    assert list(a) == list(b)
    assert list(b) == theirs(22, 1, 0, seed=1)


# --------------------------------------------------------------------------- A2

@pytest.mark.parametrize("seed,epoch", [(0, 3), (0, 0), (1, 4), (42, 17), (65536, 20)])
def test_a2_same_seed_and_epoch_partition_the_data(seed, epoch):
    shards = []
    for rank in range(2):
        s = DistributedSampler(range(10), num_replicas=2, rank=rank, seed=seed)
        s.set_epoch(epoch)
        shards.append(list(s))
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(10))


def test_a2_different_seeds_overlap():
    # rank 0 seeded 0, rank 1 seeded 1, both at epoch 3 (pitfalls A2 case b)
    ref0 = theirs(10, 2, 0, epoch=3, seed=0)
    ref1 = theirs(10, 2, 1, epoch=3, seed=1)
    expected_overlap = set(ref0) & set(ref1)
    a = DistributedSampler(range(10), num_replicas=2, rank=0, seed=0)
    b = DistributedSampler(range(10), num_replicas=2, rank=1, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    overlap = set(a) & set(b)
    assert overlap == expected_overlap
    # values from torch's CPU generator: rank 0 (seed+epoch=3) gets [6, 3, 8, 1, 2],
    # rank 1 (seed+epoch=4) gets [4, 6, 3, 8, 5]
    assert (list(a), list(b)) == ([6, 3, 8, 1, 2], [4, 6, 3, 8, 5]) == (ref0, ref1)
    assert overlap == {3, 6, 8}
    # each rank still has 5 indices, so every duplicate leaves a sample unseen
    missing = set(range(10)) - (set(a) | set(b))
    assert missing == {0, 7, 9} and len(missing) == len(overlap)
    # different epochs with the same seed break the partition the same way
    assert set(theirs(10, 2, 0, epoch=3)) & set(theirs(10, 2, 1, epoch=4)) == (
        set(shard_indices(10, 2, 0, True, 0, 3)) & set(shard_indices(10, 2, 1, True, 0, 4)))


# --------------------------------------------------------------------------- A3

def test_a3_padding_duplicates_and_skewed_accuracy():
    shards = all_shards(10, 3, shuffle=False)
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert shards == [theirs(10, 3, r, shuffle=False) for r in range(3)]
    assert padding_count(10, 3) == 2
    assert padded_order(10, 3) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]

    def correct(i):  # the model is right on every sample except index 0
        return i != 0

    gathered = [i for shard in shards for i in shard]
    naive = Fraction(sum(map(correct, gathered)), len(gathered))
    assert naive == Fraction(10, 12)
    assert float(naive) == pytest.approx(0.8333, abs=1e-4)

    eval_shards = [list(DistributedEvalSampler(range(10), num_replicas=3, rank=r))
                   for r in range(3)]
    gathered = [i for shard in eval_shards for i in shard]
    assert Fraction(sum(map(correct, gathered)), len(gathered)) == Fraction(9, 10)


@pytest.mark.parametrize("n,r", [(10, 3), (11, 4), (7, 7), (3, 8), (1, 5), (12, 5)])
def test_a3_padding_count_formula(n, r):
    ref = TorchSampler(range(n), num_replicas=r, rank=0, drop_last=False)
    assert padding_count(n, r) == (r - n % r) % r == ref.total_size - n


def test_a5_eval_sampler_is_order_free_and_exact():
    # The eval sampler ignores epochs and never shuffles: two evaluations of the same
    # model give the same shards, and the gathered accuracy equals single-process 9/10.
    first = [list(DistributedEvalSampler(range(10), 3, r)) for r in range(3)]
    second = []
    for r in range(3):
        s = DistributedEvalSampler(range(10), 3, r)
        s.set_epoch(7)
        second.append(list(s))
    assert first == second
    gathered = [i for shard in second for i in shard]
    assert Fraction(sum(i != 0 for i in gathered), len(gathered)) == Fraction(9, 10)


# --------------------------------------------------------------------------- A6

def test_a6_sampler_drop_last_cuts_the_tail():
    assert num_samples_per_rank(10, 3, drop_last=True) == 3 == math.ceil((10 - 3) / 3)
    shards = all_shards(10, 3, shuffle=False, drop_last=True)
    assert shards == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert DistributedSampler(range(10), 3, 0, drop_last=True).total_size == 9
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) and 9 not in flat


def test_a6_n11_drop_last_still_three_per_rank():
    shards = all_shards(11, 3, shuffle=False, drop_last=True)
    assert [len(s) for s in shards] == [3, 3, 3] and 11 // 3 == 3
    assert set(range(11)) - {i for s in shards for i in s} == {9, 10}
    assert shards == [theirs(11, 3, r, shuffle=False, drop_last=True) for r in range(3)]


def test_a6_dataloader_drop_last_drops_short_batches():
    data = list(range(10))
    batches = {}
    for loader_drop_last in (False, True):
        batches[loader_drop_last] = []
        for rank in range(3):
            s = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=False)
            assert len(s) == 4
            loader = DataLoader(data, batch_size=3, sampler=s, drop_last=loader_drop_last)
            got = [b.tolist() for b in loader]
            assert len(loader) == len(got)
            batches[loader_drop_last].append(got)
    assert [[len(b) for b in rank_batches] for rank_batches in batches[False]] == [[3, 1]] * 3
    assert batches[True] == [[[0, 3, 6]], [[1, 4, 7]], [[2, 5, 8]]]
    # the dropped tail entries are 9, 0 and 1; only 9 is seen by no rank
    dropped = [b[-1][0] for b in batches[False]]
    assert dropped == [9, 0, 1]
    seen = {i for rank_batches in batches[True] for b in rank_batches for i in b}
    assert set(range(10)) - seen == {9}


def test_a6_divisible_n_drop_last_makes_no_difference():
    assert all_shards(12, 3, shuffle=False) == all_shards(12, 3, shuffle=False, drop_last=True)
    assert [len(s) for s in all_shards(12, 3, drop_last=True)] == [4, 4, 4]
    assert num_samples_per_rank(12, 3) == num_samples_per_rank(12, 3, drop_last=True) == 4


# --------------------------------------------------------------------------- A7

@pytest.mark.parametrize("r,padded", [(7, [0, 1, 2, 0, 1, 2, 0]),
                                      (8, [0, 1, 2, 0, 1, 2, 0, 1])])
def test_a7_dataset_smaller_than_world_wraps_round(r, padded):
    assert padded_order(3, r) == padded
    shards = all_shards(3, r, shuffle=False)
    assert shards == [[rank % 3] for rank in range(r)]
    assert shards == [theirs(3, r, rank, shuffle=False) for rank in range(r)]
    assert padding_count(3, r) == r - 3


@pytest.mark.parametrize("r", [7, 8])
def test_a7_drop_last_with_n_below_r_gives_empty_shards_and_warns(r):
    for rank in range(r):
        with pytest.warns(UserWarning, match=rf"N=3 .*R={r}"):
            s = DistributedSampler(range(3), num_replicas=r, rank=rank, drop_last=True)
        assert list(s) == [] and len(s) == 0
        assert theirs(3, r, rank, drop_last=True) == []  # upstream behaves the same


def test_a7_torch_gives_empty_shards_silently():
    # notebook 02 prints torch's sampler next to the package's: len 0, nothing yielded, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = TorchSampler(range(3), num_replicas=7, rank=0, drop_last=True)
    assert (len(s), list(s), caught) == (0, [], [])


def test_a7_no_warning_when_nothing_is_lost():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedSampler(range(3), num_replicas=7, rank=0, drop_last=False)
        DistributedSampler(range(0), num_replicas=7, rank=0, drop_last=True)
        DistributedSampler(range(14), num_replicas=7, rank=0, drop_last=True)


# --------------------------------------------------------------------------- A8

def test_a8_len_is_per_rank_not_dataset_length():
    data = list(range(800))
    for rank in range(4):
        s = DistributedSampler(data, num_replicas=4, rank=rank)
        assert len(s) == 200
        assert len(DataLoader(data, batch_size=10, sampler=s, drop_last=True)) == 20
    assert len(DistributedSampler(range(10), 3, 0)) == 4
    assert len(DistributedSampler(range(10), 3, 0, drop_last=True)) == 3


@pytest.mark.parametrize("n,r,drop_last", [(10, 3, False), (10, 3, True), (800, 4, False),
                                            (3, 7, False), (0, 2, False), (13, 5, True)])
@SAMPLERS
def test_a8_len_equals_number_yielded_on_every_rank(Sampler, n, r, drop_last):
    for rank in range(r):
        for shuffle in (False, True):
            s = Sampler(range(n), r, rank, shuffle=shuffle, drop_last=drop_last)
            assert len(s) == len(list(s)) == len(TorchSampler(range(n), r, rank,
                                                              drop_last=drop_last))


# --------------------------------------------------------------------------- A9

def test_a9_interleaved_vs_contiguous_n10_r2():
    assert [shard_indices(10, 2, r) for r in range(2)] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [contiguous_shard_indices(10, 2, r) for r in range(2)] == [[0, 1, 2, 3, 4],
                                                                      [5, 6, 7, 8, 9]]


def test_a9_interleaved_vs_contiguous_n10_r3():
    interleaved = [shard_indices(10, 3, r) for r in range(3)]
    contiguous = [contiguous_shard_indices(10, 3, r) for r in range(3)]
    assert interleaved[0] == [0, 3, 6, 9] == theirs(10, 3, 0, shuffle=False)
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert interleaved[0] != contiguous[0]
    padded = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    for scheme in (interleaved, contiguous):
        assert sorted(i for s in scheme for i in s) == sorted(padded)


@pytest.mark.parametrize("n,r,drop_last", [(10, 3, False), (23, 4, True), (3, 8, False)])
def test_a9_both_schemes_partition_the_same_padded_list(n, r, drop_last):
    ref_shards = [theirs(n, r, rank, epoch=2, seed=5, drop_last=drop_last) for rank in range(r)]
    ref_total = sorted(i for s in ref_shards for i in s)
    cont = [contiguous_shard_indices(n, r, rank, True, 5, 2, drop_last) for rank in range(r)]
    assert sorted(i for s in cont for i in s) == ref_total
    assert [len(s) for s in cont] == [len(s) for s in ref_shards]


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("cls", [DistributedSampler, DistributedEvalSampler])
def test_bad_rank_and_world_size_name_the_numbers(cls):
    with pytest.raises(ValueError, match=r"rank 3 is outside \[0, 1\]"):
        cls(range(10), num_replicas=2, rank=3)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 1\]"):
        cls(range(10), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"rank -1 is outside \[0, 1\]"):
        cls(range(10), num_replicas=2, rank=-1)
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1, got 0"):
        cls(range(10), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1, got -2"):
        cls(range(10), num_replicas=-2, rank=0)
    with pytest.raises(TypeError, match=r"num_replicas must be an int, got 2.0"):
        cls(range(10), num_replicas=2.0, rank=0)


def test_helpers_reject_bad_input():
    with pytest.raises(ValueError, match=r"rank 3 is outside \[0, 2\]"):
        shard_indices(10, 3, 3)
    with pytest.raises(ValueError, match=r"rank 5 is outside \[0, 3\]"):
        contiguous_shard_indices(10, 4, 5)
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1, got 0"):
        num_samples_per_rank(10, 0)
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1, got 0"):
        padding_count(10, 0)
    with pytest.raises(ValueError, match=r"must be >= 0, got -1"):
        global_order(-1)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(),
                    reason="a process group exists in this process")
@pytest.mark.parametrize("cls", [DistributedSampler, DistributedEvalSampler])
def test_missing_world_without_process_group_is_a_clear_error(cls):
    with pytest.raises(RuntimeError, match=r"num_replicas and rank not given.*process group"):
        cls(range(10))
    with pytest.raises(RuntimeError, match=r"^rank not given.*init_process_group"):
        cls(range(10), num_replicas=2)


# --------------------------------------------------------------------------- eval sampler

def test_eval_sampler_partitions_exactly():
    for n in range(21):
        for r in range(1, 6):
            shards = [list(DistributedEvalSampler(range(n), num_replicas=r, rank=rank))
                      for rank in range(r)]
            flat = [i for s in shards for i in s]
            assert len(flat) == len(set(flat)) == n
            assert sorted(flat) == list(range(n))
            lens = [len(DistributedEvalSampler(range(n), r, rank)) for rank in range(r)]
            assert lens == [len(s) for s in shards]
            assert max(lens) - min(lens) <= 1


def test_eval_sampler_a10_uneven_shards():
    shards = [list(DistributedEvalSampler(range(10), 3, r)) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [len(DataLoader(list(range(10)), batch_size=1,
                           sampler=DistributedEvalSampler(range(10), 3, r)))
            for r in range(3)] == [4, 3, 3]
