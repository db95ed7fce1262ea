"""The trainer's micro-batches at any world size (``ddp_lesson.layout``), without processes.

At the world size that started the run the batch sampler is torch's DistributedSampler and a
DataLoader of batch B, index for index; at another world size R' it deals the very same
micro-batches (groups of samples), K' = K x R / R' to each rank per step, numbered
``g = k x R + r`` -> ``k' x R' + r'``. Refusals name R, K and R'.
"""
import itertools

import pytest
import torch.utils.data as tud

from ddp_lesson.config import TrainConfig, derived_values, layout_for
from ddp_lesson.layout import DataLayout, LayoutBatchSampler, processes, regroup_problem

CASES = [(n, r, b, k, drop_last)
         for n, r, b, k, drop_last in itertools.product((5, 17, 33), (1, 2, 3), (1, 4), (1, 3),
                                                         (False, True))
         if DataLayout(n, r, k, b, drop_last).micro_batches_per_rank > 0]


def _torch_batches(n, r, rank, b, drop_last, seed, epoch):
    """Rank ``rank``'s batches from torch's own sampler and loader (the independent reference)."""
    sampler = tud.DistributedSampler(range(n), num_replicas=r, rank=rank, shuffle=True,
                                     seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    loader = tud.DataLoader(list(range(n)), batch_size=b, sampler=sampler, drop_last=drop_last)
    return [batch.tolist() for batch in loader]


def _rank_batches(layout, world_size, rank, epoch, start_step=0):
    sampler = LayoutBatchSampler(layout, world_size, rank)
    sampler.set_epoch(epoch)
    sampler.start_step = start_step
    batches = list(sampler)
    assert len(sampler) == len(batches)
    return batches


def test_at_its_own_world_size_it_is_torchs_sampler_and_loader():
    for n, r, b, k, drop_last in CASES:
        layout = DataLayout(n, r, k, b, drop_last, seed=3)
        for rank in range(r):
            ref = _torch_batches(n, r, rank, b, drop_last, seed=3, epoch=2)
            assert _rank_batches(layout, r, rank, epoch=2) == ref, (n, r, b, k, drop_last)
            assert layout.micro_batches_per_rank == len(ref)
            # resuming after s steps: the tail of the same list, K micro-batches a step skipped
            for s in range(layout.steps_per_epoch + 1):
                assert _rank_batches(layout, r, rank, 2, start_step=s) == ref[s * k:]


def test_at_another_world_size_every_step_holds_the_same_micro_batches():
    for case in CASES:
        _check_regrouping(*case)


def _check_regrouping(n, r, b, k, drop_last):
    layout = DataLayout(n, r, k, b, drop_last, seed=1)
    ref = [_torch_batches(n, r, rank, b, drop_last, seed=1, epoch=0) for rank in range(r)]
    for r2 in range(1, 7):
        if layout.problem_at(r2):
            with pytest.raises(ValueError, match=f"R'={r2} processes cannot share"):
                LayoutBatchSampler(layout, r2, 0)
            continue
        mine = [_rank_batches(layout, r2, rank, 0) for rank in range(r2)]
        at = [0] * r2  # how far each rank is in its list
        for step in range(layout.steps_per_epoch):
            count = min(k, layout.micro_batches_per_rank - step * k)  # per rank at R
            # the run at R: micro-batch k of rank r in this step, numbered g = k x R + r
            groups = [ref[rank][step * k + j] for j in range(count) for rank in range(r)]
            for g, group in enumerate(groups):
                k2, rank2 = divmod(g, r2)  # ... is micro-batch k' of rank r' at R'
                assert mine[rank2][at[rank2] + k2] == group, (n, r, b, k, drop_last, r2)
            for rank2 in range(r2):
                at[rank2] += len(groups) // r2
        assert at == [len(m) for m in mine]  # nothing more, nothing less


def test_two_ranks_to_one_and_back_worked_example():
    # N=16, R=2, K=1, B=2: rank 0 and rank 1 read their shards two samples at a time
    layout = DataLayout(16, 2, 1, 2, seed=0)
    two = [_rank_batches(layout, 2, rank, epoch=1) for rank in range(2)]
    assert two == [_torch_batches(16, 2, rank, 2, False, 0, 1) for rank in range(2)]
    one = _rank_batches(layout, 1, 0, epoch=1)
    assert LayoutBatchSampler(layout, 1, 0).accumulation == 2  # K' = 1 x 2 / 1
    # one process takes rank 0's micro-batch, then rank 1's, step after step
    assert one == [batch for pair in zip(*two) for batch in pair]
    # after 2 steps: the cursor is 2 x (B x R x K) = 8 samples; the rest is dealt again
    assert layout.cursor(2) == 8 and one[4:] == _rank_batches(layout, 1, 0, 1, start_step=2)
    # ... and the run started at R=1, K=2 resumed on 2 processes: one micro-batch each
    single = DataLayout(16, 1, 2, 2, seed=0)
    ranks = [_rank_batches(single, 2, rank, epoch=1) for rank in range(2)]
    whole = _torch_batches(16, 1, 0, 2, False, 0, 1)
    assert ranks == [whole[0::2], whole[1::2]]


def test_cursor_counts_the_samples_read():
    layout = DataLayout(17, 2, 2, 4)  # 9 per rank (one padded), micro-batches 4, 4, 1
    assert (layout.samples_per_rank, layout.micro_batches_per_rank,
            layout.steps_per_epoch) == (9, 3, 2)
    assert [layout.cursor(s) for s in range(3)] == [0, 16, 18]  # the epoch's 18: 17 + 1 pad
    assert [layout.micro_batches_in_step(s) for s in range(2)] == [4, 2]
    dropped = DataLayout(17, 2, 2, 4, drop_last=True)  # 8 per rank, micro-batches 4, 4
    assert [dropped.cursor(s) for s in range(2)] == [0, 16]


def test_derived_values_of_a_run_resumed_at_another_world_size():
    cfg = TrainConfig(num_train=32, batch_size=4)
    two = derived_values(cfg, 2)
    one = derived_values(cfg, 1, layout=layout_for(cfg, 32, 2, 1))
    assert two == derived_values(cfg, 2, layout=layout_for(cfg, 32, 2, 1))
    assert one == {**two, "world_size": 1, "grad_accum_steps": 2, "samples_per_rank": 32,
                   "micro_batches_per_epoch": 8}
    assert (one["global_batch"], one["steps_per_epoch"], one["effective_lr"]) == (8, 4, 0.05)
    # a run of 1 process x K=2 resumed on 2 processes: 30 samples, micro-batches of 4, the
    # 8th holds 2; rank 0 takes micro-batches 0, 2, 4, 6 (16 samples), rank 1 the others (14)
    accum = TrainConfig(num_train=30, batch_size=4, grad_accum_steps=2)
    d = derived_values(accum, 2, layout=layout_for(accum, 30, 1, 2))
    assert (d["grad_accum_steps"], d["global_batch"], d["micro_batches_per_epoch"]) == (1, 8, 4)
    assert d["samples_per_rank"] == 16 and d["samples_per_epoch"] == 30
    # 28 samples: 7 micro-batches, the 7th alone in the last step: 2 processes cannot share it
    with pytest.raises(ValueError, match="the epoch's last step holds 1 micro-batch"):
        derived_values(accum, 2, num_train=28, layout=layout_for(accum, 28, 1, 2))


def test_refusals_name_r_k_and_r_prime():
    assert regroup_problem(2, 1, 3) == (
        "a step holds K x R = 1 x 2 = 2 micro-batches (R=2 processes, K=1 accumulation step), "
        "which R'=3 processes cannot share: K' = K x R / R' = 2/3 is not a whole number; use "
        "1 or 2 processes")
    assert regroup_problem(2, 2, 4) is None and regroup_problem(4, 1, 2) is None
    assert processes(1) == "1 process" and processes(4) == "1, 2 or 4 processes"
    # 28 samples, B=4, K=2 on 1 process: 7 micro-batches, steps of 2, 2, 2 and 1
    assert DataLayout(28, 1, 2, 4).problem_at(2) == (
        "the epoch's last step holds 1 micro-batch (7 per rank and epoch at R=1, K=2), which "
        "R'=2 processes cannot share; use 1 process")
    assert DataLayout(28, 1, 2, 4).problem_at(1) is None
    with pytest.raises(ValueError, match="rank 2 is outside"):
        LayoutBatchSampler(DataLayout(16, 2, 1, 2), 2, 2)
