"""Pure logic of the bucketed core and ddp_lesson.commsim, no process group: bucket assignment,
link cost, recorder, predictions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddp_lesson.commsim import (
    CommEvent,
    SimulatedLink,
    StepRecord,
    job_exposed_s,
    job_exposed_share,
    union_length,
)
from ddp_lesson.core.bucketed_ddp import (
    MB,
    BucketedDDP,
    assign_buckets,
    bucket_size_limits,
    ddp_buckets,
)
from ddp_lesson.core.naive_ddp import NaiveDDP
from ddp_lesson.cost_model import model_ready_times, predict_bucket_sweep, predict_overlap

DTYPES = (torch.float32, torch.float64, torch.float16)


def _torch_buckets(tensors, limits):
    """torch's own assignment of ``tensors`` in registration order (no process group)."""
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    return buckets


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=25),
       dtype_ids=st.lists(st.integers(0, 2), min_size=25, max_size=25),
       limits=st.lists(st.integers(0, 2000), min_size=1, max_size=3))
def test_assign_buckets_equals_torch(sizes, dtype_ids, limits):
    tensors = [torch.zeros(n, dtype=DTYPES[d]) for n, d in zip(sizes, dtype_ids)]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    keys = [t.dtype for t in tensors]
    assert assign_buckets(nbytes, limits, keys) == _torch_buckets(tensors, limits)
    # a given order (torch's rebuild passes the ready order): walked as given, never sorted
    # (one dtype: torch appends the open buckets of several keys in a hash map's order)
    order = list(range(len(tensors)))[::-1]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i].float() for i in order], limits, [], order)
    assert assign_buckets([4 * n for n in sizes], limits, order=order) == theirs


def test_ddp_buckets_are_filled_from_the_last_parameter():
    # issue 41: 5 parameters of 16 bytes, cap 32: torch's rebuild walks the ready order (the
    # last parameter first) and launches in fill order; its construction-time rule (kept with
    # find_unused_parameters=True) fills in registration order and launches reversed
    assert ddp_buckets([16] * 5, 32 / MB) == [[4, 3], [2, 1], [0]]
    assert assign_buckets([16] * 5, 32)[::-1] == [[4], [2, 3], [0, 1]]
    assert ddp_buckets([16] * 5, 33 / MB) == [[4, 3, 2], [1, 0]]
    assert ddp_buckets([16] * 5, 0) == [[4], [3], [2], [1], [0]]
    assert ddp_buckets([16] * 5, 25) == [[4, 3, 2, 1, 0]]
    # a parameter bigger than the cap closes the bucket it joins
    assert ddp_buckets([8, 1000, 8], 100 / MB) == [[2, 1], [0]]
    # torch's default: the first bucket (last parameters, launched first) holds >= 1 MiB only
    assert bucket_size_limits() == [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MB] == [MB, 25 * MB]
    assert bucket_size_limits(25) == [25 * MB]           # an explicit cap: every bucket
    assert ddp_buckets([MB // 2] * 6) == [[5, 4], [3, 2, 1, 0]]
    assert ddp_buckets([MB // 2] * 6, 25) == [[5, 4, 3, 2, 1, 0]]


@pytest.mark.parametrize("cap", [None, 0, 0.0001, 0.001, 1, 25])
def test_ddp_buckets_are_torchs_assignment_in_ready_order(cap):
    """torch's rebuild: ``_compute_bucket_assignment_by_size`` of the tensors in ready order,
    with their indices (``tensor_indices``), the last parameter first."""
    model = _stack((64, 300, 7, 900, 3))
    params = [p.detach() for p in model.parameters()]
    order = list(range(len(params)))[::-1]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], bucket_size_limits(cap), [], order)
    assert ddp_buckets([p.numel() * 4 for p in params], cap) == theirs


def test_assign_buckets_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"bucket size limits must be >= 0 bytes, got \[-1\]"):
        assign_buckets([4], -1)
    with pytest.raises(ValueError, match="2 keys for 1 parameters"):
        assign_buckets([4], 10, ["a", "b"])
    with pytest.raises(ValueError, match="order must list each of the 2 indices once"):
        assign_buckets([4, 4], 10, order=[0, 0])
    for bad in (-1, math.inf, math.nan, 1e308):  # 1e308 MiB: an infinite number of bytes
        with pytest.raises(ValueError, match=f"bucket_cap_mb must be a finite number >= 0, "
                                             f"got {bad}".replace("+", r"\+")):
            bucket_size_limits(bad)


def _stack(sizes, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


#: (model, bucket_cap_mb) pairs: torch's default cap and explicit ones, several bucket counts.
TORCH_CASES = [((512, 512, 512, 10), None), ((512, 512, 512, 10), 25), ((512, 512, 512, 10), 1),
               ((256,) * 9, 0.5), ((256,) * 9, None), ((64, 300, 7, 900, 3), 0.02),
               ((64, 300, 7, 900, 3), 0)]


def _torch_ddp_buckets(model, iterations, **kwargs):
    """torch's buckets in each iteration, in launch order, read by a comm hook."""
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    seen: list = []

    def hook(state, bucket):
        seen.append((bucket.index(), [index[id(p)] for p in bucket.parameters()]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    out = []
    for _ in range(iterations):
        seen.clear()
        ddp(torch.randn(2, next(model.parameters()).shape[1])).sum().backward()
        out.append([ids for _, ids in sorted(seen)])
    return out


@pytest.mark.slow
def test_bucketed_ddp_builds_torchs_buckets(world_of_one):
    """BucketedDDP's buckets are those torch's DDP uses: by default torch sends one bucket in
    iteration 1 and rebuilds in the ready order before the 2nd forward (static_graph: the 3rd);
    with find_unused_parameters=True it keeps its construction-time buckets."""
    differ = []
    for sizes, cap in TORCH_CASES:
        nbytes = [p.numel() * 4 for p in _stack(sizes).parameters()]
        one = [list(range(len(nbytes)))]
        ours = BucketedDDP(_stack(sizes), bucket_cap_mb=cap).bucket_indices
        assert ours == ddp_buckets(nbytes, cap), (sizes, cap)
        assert _torch_ddp_buckets(_stack(sizes), 3, bucket_cap_mb=cap) == [one, ours, ours]
        assert _torch_ddp_buckets(_stack(sizes), 3, bucket_cap_mb=cap, static_graph=True) == [
            one, one, ours], (sizes, cap)
        kept = _torch_ddp_buckets(_stack(sizes), 3, bucket_cap_mb=cap,
                                  find_unused_parameters=True)
        theirs = _torch_buckets([p.detach() for p in _stack(sizes).parameters()],
                                bucket_size_limits(cap))
        assert kept == [theirs[::-1]] * 3, (sizes, cap)  # construction-time, never rebuilt
        differ.append(theirs[::-1] != ours)
    assert sum(differ) == 6   # other buckets (or order in a bucket), except at cap 0
    # issue 40: on this model torch's default gives two buckets, an explicit 25 MiB one
    nbytes = [p.numel() * 4 for p in _stack((512, 512, 512, 10)).parameters()]
    assert len(ddp_buckets(nbytes)) == 2 and len(ddp_buckets(nbytes, 25)) == 1


class _OutOfOrder(nn.Module):
    """Registers ``a`` before ``b`` but runs ``b`` first: gradients are ready a's first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.a(self.b(x))


@pytest.mark.slow
def test_torch_rebuilds_other_buckets_when_forward_runs_out_of_registration_order(world_of_one):
    """The series assumes reverse registration order; torch walks the order it recorded."""
    nbytes = [p.numel() * 4 for p in _OutOfOrder().parameters()]   # a.w, a.b, b.w, b.b
    cap = 16_000 / MB   # one Linear(64, 64) per bucket (16,640 bytes)
    ours = BucketedDDP(_OutOfOrder(), bucket_cap_mb=cap).bucket_indices
    assert ours == ddp_buckets(nbytes, cap) == [[3, 2], [1, 0]]
    theirs = _torch_ddp_buckets(_OutOfOrder(), 2, bucket_cap_mb=cap)[1]
    assert theirs == [[1, 0], [3, 2]]   # a's gradients were ready first


def test_wrappers_need_a_process_group():
    assert not dist.is_initialized()
    for cls in (NaiveDDP, BucketedDDP):
        with pytest.raises(RuntimeError, match="needs a process group"):
            cls(nn.Linear(2, 1))


def test_simulated_link_cost_is_the_ring_alpha_beta_formula():
    link = SimulatedLink(latency_s=1e-3, bandwidth_bytes_per_s=1e6)
    # T = 2(R-1)·α + 2(R-1)/R · n/bandwidth
    assert link.cost_s(1e6, 2) == pytest.approx(2 * 1e-3 + 1.0)
    assert link.cost_s(3e6, 3) == pytest.approx(4 * 1e-3 + 4 / 3 * 3.0)
    assert link.cost_s(0, 4) == pytest.approx(6e-3)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0, got 0"):
        SimulatedLink(1e-3, 0)
    with pytest.raises(ValueError, match="latency_s must be >= 0, got -1"):
        SimulatedLink(-1, 1e6)


def test_simulated_link_carries_one_message_at_a_time():
    link = SimulatedLink(latency_s=0.5, bandwidth_bytes_per_s=1.0)  # 1 s per message at R=2 + 0 B
    s1, d1 = link.reserve(0, 2)
    s2, d2 = link.reserve(0, 2)
    assert d1 - s1 == pytest.approx(1.0)
    assert s2 == pytest.approx(d1)          # the second waits for the first
    assert d2 - s2 == pytest.approx(1.0)


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(5, 6), (0, 10)]) == 10


def test_step_record_exposed_share():
    rec = StepRecord(rank=0, step=0, backward_end_s=10.0, sync_end_s=12.0,
                     comm=[CommEvent(0, 4, ["a"], 2.0, 2.0, 6.0),
                           CommEvent(1, 4, ["b"], 5.0, 6.0, 12.0)])
    assert rec.comm_s == pytest.approx(10.0)         # 2..12
    assert rec.exposed_s == pytest.approx(2.0)       # 10..12
    assert rec.exposed_share == pytest.approx(0.2)
    back = StepRecord.from_dict(rec.to_dict())
    assert back == rec
    assert StepRecord(rank=0, step=0, backward_end_s=1.0, sync_end_s=1.0).exposed_share == 0.0


def test_job_exposed_counts_from_the_last_rank_to_finish_backward():
    # rank 0 starts at t=100, ends backward at 110, has gradients at 125;
    # rank 1 starts at t=105, ends backward at 120, has gradients at 124.
    r0 = StepRecord(rank=0, step=0, t0_s=100.0, backward_end_s=10.0, sync_end_s=25.0,
                    comm=[CommEvent(0, 4, ["a"], 5.0, 5.0, 25.0)])
    r1 = StepRecord(rank=1, step=0, t0_s=105.0, backward_end_s=15.0, sync_end_s=19.0,
                    comm=[CommEvent(0, 4, ["a"], 6.0, 6.0, 19.0)])
    assert r0.exposed_s == pytest.approx(15.0)          # mostly waiting for rank 1
    assert job_exposed_s([r0, r1]) == pytest.approx(5.0)   # 125 - 120
    assert job_exposed_share([r0, r1]) == pytest.approx(5.0 / 13.0)  # rank 1's comm: 6..19


def test_predict_overlap_by_hand():
    # α=0, bandwidth 1 B/s, R=2: a bucket of n bytes takes n seconds.
    # buckets of 3, 2, 4 bytes ready at 1, 2, 6; backward ends at 6.
    p = predict_overlap([3, 2, 4], [1, 2, 6], 6, 2, 0.0, 1.0)
    assert p["start"] == [1, 4, 6] and p["end"] == [4, 6, 10]
    assert p["exposed_s"] == pytest.approx(4) and p["step_s"] == pytest.approx(10)
    assert p["comm_s"] == pytest.approx(9)
    no = predict_overlap([3, 2, 4], [1, 2, 6], 6, 2, 0.0, 1.0, overlap=False)
    assert no["start"] == [6, 9, 11] and no["exposed_s"] == pytest.approx(9)


def test_model_ready_times_steady_rate_in_reverse_order():
    assert model_ready_times([1, 1, 2], 4.0) == [4.0, 3.0, 2.0]


def test_bucket_sweep_prediction_has_an_interior_optimum():
    # 40 parameters of 10 kB, backward 40 ms (one parameter per ms); link α = 1 ms, 100 MB/s,
    # so a bucket of k parameters costs 2 ms + k·0.1 ms on 2 ranks
    sizes = [10_000] * 40
    caps = [0, 2e4 / MB, 5e4 / MB, 1e5 / MB, 2e5 / MB, 1.0]
    rows = predict_bucket_sweep(sizes, caps, 0.040, 2, 1e-3, 1e8)
    assert [r["buckets"] for r in rows] == [40, 20, 8, 4, 2, 1, 40]
    exposed = [r["exposed_s"] for r in rows]
    # by hand: 8 buckets of 5 keep up with backward (2.5 ms per 5 ms), the last one is exposed;
    # 4 buckets: the last costs 3 ms; 1 bucket: 2 + 4 = 6 ms after backward;
    # 20 buckets of 2 (2.2 ms per 2 ms) fall behind: 2 + 20·2.2 - 40 = 6 ms
    assert exposed[2] == pytest.approx(0.0025)
    assert exposed[3] == pytest.approx(0.0030)
    assert exposed[5] == pytest.approx(0.0060)
    assert exposed[1] == pytest.approx(0.0060)
    assert min(range(len(caps)), key=exposed.__getitem__) == 2
    # NaiveDDP: 40 messages after backward, each 2 ms + 0.1 ms
    assert rows[-1]["cap_mb"] is None and exposed[-1] == pytest.approx(40 * 0.0021)
    assert all(math.isfinite(r["step_s"]) for r in rows)
