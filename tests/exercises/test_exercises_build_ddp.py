"""The checkers of the exercises that build DDP (04.3, 04.4), the global-count loss (06.5), the
stuck rank (07.6) and ZeRO-1 (08.5) accept correct answers written differently and refuse the
plausible wrong ones, each with a verdict naming the step (or case), the rank and the value.

The distributed candidates below are judged together, two processes each, in as few torchrun
launches as ``run_pairs`` needs (the ``verdicts`` fixture, once per module); every test reads
its verdicts from there. ``docs/exercises.md`` lists every case and its verdict.
"""
from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_lesson.core.bucketed_ddp import MB, BucketedDDP, assign_buckets, ddp_buckets
from ddp_lesson.core.naive_ddp import NaiveDDP, all_reduce_mean_
from ddp_lesson.core.zero1 import Zero1Optimizer
from ddp_lesson.exercises import check, describe, reference
from ddp_lesson.exercises.catalog import ex_07_6_stuck_rank as stuck_rank_module
from ddp_lesson.exercises.core import run_candidates, run_pairs

# A hanging candidate costs one collective timeout; keep it short here.
os.environ.setdefault("DDP_LESSON_CHECK_TIMEOUT_S", "4")


# ----------------------------------------------------------------------------- 04.3 answers

class HookNaive(nn.Module):
    """Right, written differently: a blocking all-reduce in each parameter's own hook."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average)

    @staticmethod
    def _average(p):
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def forward(self, x):
        return self.module(x)


class NoBroadcast(NaiveDDP):
    def _broadcast_state(self):
        pass


class TrainableBroadcast(NaiveDDP):
    def _broadcast_state(self):
        with torch.no_grad():
            for p in self.module.parameters():
                if p.requires_grad:
                    dist.broadcast(p, 0)


class NoDivide(NaiveDDP):
    def _after_backward(self):
        self._callback_queued = False
        for p in self._params:
            dist.all_reduce(p.grad)


class DividedTwice(NaiveDDP):
    def _after_backward(self):
        super()._after_backward()
        for p in self._params:
            p.grad /= self.world_size


class EveryParameter(NaiveDDP):
    """Averages every parameter's .grad, the frozen one's (None) too."""

    def _after_backward(self):
        self._callback_queued = False
        for p in self.module.parameters():
            all_reduce_mean_(p.grad)


class RankZeroAverages(NaiveDDP):
    """Only rank 0 all-reduces: it waits for a peer that never comes."""

    def _after_backward(self):
        if dist.get_rank() == 0:
            super()._after_backward()
        self._callback_queued = False


class ParametersOnly(NaiveDDP):
    """Broadcasts every parameter, no buffer."""

    def _broadcast_state(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.broadcast(p, 0)


class FromLastRank(NaiveDDP):
    """Broadcasts from rank R - 1: the ranks agree, on the wrong weights."""

    def _broadcast_state(self):
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, dist.get_world_size() - 1)


class HooksEveryForward(HookNaive):
    """Registers its hooks again in every forward: averaging an average changes no value, but
    each step all-reduces once more per gradient."""

    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0)

    def forward(self, x):
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average)
        return self.module(x)


class HalfNaive(NaiveDDP):
    """Divides by a constant 2 (right at 2 ranks only)."""

    def _after_backward(self):
        self._callback_queued = False
        for p in self._params:
            p.grad /= 2
            dist.all_reduce(p.grad)


# ----------------------------------------------------------------------------- 04.4 answers

class FutureBuckets(nn.Module):
    """Right, written differently: own bucket table, futures, SUM first and divide after."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        self.module, self.syncing = module, True
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, 0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = ddp_buckets([p.numel() * 4 for p in self.params], bucket_cap_mb)
        self.where = {i: b for b, ids in enumerate(self.buckets) for i in ids}
        self.left, self.futures, self.started = {}, {}, False
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.ready(i))

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, x):
        self.this_backward = self.syncing
        return self.module(x)

    def ready(self, i):
        if not self.this_backward:
            return
        if not self.started:
            self.started, self.next = True, 0
            self.left = {b: len(ids) for b, ids in enumerate(self.buckets)}
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.left[self.where[i]] -= 1
        while self.next < len(self.buckets) and self.left[self.next] == 0:
            flat = torch.cat([self.params[j].grad.reshape(-1) for j in self.buckets[self.next]])
            self.futures[self.next] = dist.all_reduce(flat, async_op=True).get_future()
            self.next += 1

    def finish(self):
        for b, ids in enumerate(self.buckets):
            flat = self.futures.pop(b).wait()[0] / dist.get_world_size()
            for j, piece in zip(ids, flat.split([self.params[j].numel() for j in ids])):
                self.params[j].grad.copy_(piece.view_as(self.params[j]))
        self.started = False


class AfterBackward(BucketedDDP):
    """Buckets, but every all-reduce issued at the end of backward."""

    def _grad_ready(self, index):
        self._pending[self._bucket_of[index]] -= 1


class WaitInHook(BucketedDDP):
    def _launch(self, b):
        super()._launch(b)
        self._wait(self._work[b])  # the core's (work, recorder event) handle


class _Done:
    def wait(self):
        return True


class BlockingInHook(BucketedDDP):
    def _launch(self, b):
        params = [self._params[i] for i in self.bucket_indices[b]]
        self._flat[b] = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce_mean_(self._flat[b], self.process_group)
        self._work[b] = (_Done(), None)  # the core's (work, recorder event) handle


class ForwardOrder(BucketedDDP):
    def __init__(self, module, bucket_cap_mb=25):
        super().__init__(module, bucket_cap_mb)
        # filled and launched in registration order (the first layer first: not reversed)
        self.bucket_indices = assign_buckets([p.numel() * 4 for p in self._params],
                                             int(bucket_cap_mb * MB))
        self._bucket_of = {i: b for b, ids in enumerate(self.bucket_indices) for i in ids}
        self._reset_buckets()


class ConstructionBuckets(BucketedDDP):
    """Filled in registration order, sent reversed: torch's buckets at construction (kept only
    with find_unused_parameters=True), not those it uses after its rebuild."""

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__(module, bucket_cap_mb)
        self.bucket_indices = assign_buckets([p.numel() * 4 for p in self._params],
                                             int(bucket_cap_mb * MB))[::-1]
        self._bucket_of = {i: b for b, ids in enumerate(self.bucket_indices) for i in ids}
        self._reset_buckets()


class CapIgnored(BucketedDDP):
    def __init__(self, module, bucket_cap_mb=25):
        super().__init__(module, bucket_cap_mb=1024)


class SyncsInNoSync(BucketedDDP):
    def no_sync(self):
        return contextlib.nullcontext()


class HalfBuckets(BucketedDDP):
    """Divides by a constant 2 (right at 2 ranks only)."""

    def _launch(self, b):
        params = [self._params[i] for i in self.bucket_indices[b]]
        self._flat[b] = torch.cat([p.grad.reshape(-1) for p in params]) / 2
        self._work[b] = (dist.all_reduce(self._flat[b], async_op=True), None)


class ZeroesInForward(BucketedDDP):
    """A synchronised forward starts from fresh gradients: the accumulated ones are lost."""

    def forward(self, *inputs):
        if self.require_backward_grad_sync:
            for p in self._params:
                p.grad = None
        return super().forward(*inputs)


# ----------------------------------------------------------------------------- 06.5 answers

def global_count_stacked(sums, counts):
    n = torch.tensor(sum(counts), dtype=torch.int64)
    dist.all_reduce(n)
    return torch.stack(sums).sum() * dist.get_world_size() / n


def micro_mean(sums, counts):
    return sum(s / n for s, n in zip(sums, counts)) / len(sums)


def micro_mean_summed(sums, counts):
    return sum(s / n for s, n in zip(sums, counts))


def rank_count(sums, counts):
    return sum(sums) / sum(counts)


def global_count_only(sums, counts):
    n = torch.tensor([float(sum(counts))])
    dist.all_reduce(n)
    return sum(sums) / n


def count_averaged(sums, counts):
    n = torch.tensor([float(sum(counts))])
    dist.all_reduce(n)
    n /= dist.get_world_size()
    return sum(sums) * dist.get_world_size() / n


def global_count_times_two(sums, counts):  # a constant 2 for the world size
    n = torch.tensor(sum(counts), dtype=torch.int64)
    dist.all_reduce(n)
    return torch.stack(sums).sum() * 2 / n


# ----------------------------------------------------------------------------- 08.5 answers

class RoundRobin(torch.optim.Optimizer):
    """Right, written differently: owner i % R, one flat all-reduce of every gradient."""

    divide, broadcast_from_owner, broadcast, pass_defaults = True, True, True, True

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, defaults)
        self.all = [p for g in self.param_groups for p in g["params"]]
        R, me = dist.get_world_size(), dist.get_rank()
        self.owner = [i % R for i in range(len(self.all))]
        mine = [p for p, o in zip(self.all, self.owner) if o == me]
        self.local = optimizer_class(mine, **(defaults if self.pass_defaults else {}))

    @torch.no_grad()
    def step(self, closure=None):
        flat = torch.cat([p.grad.reshape(-1) for p in self.all])
        dist.all_reduce(flat)
        if self.divide:
            flat /= dist.get_world_size()
        for p, g in zip(self.all, flat.split([p.numel() for p in self.all])):
            p.grad.copy_(g.view_as(p))
        self.local.step()
        if self.broadcast:
            for p, o in zip(self.all, self.owner):
                dist.broadcast(p, o if self.broadcast_from_owner else 0)


class Summed(RoundRobin):
    divide = False


class NoBroadcastZero(RoundRobin):
    broadcast = False


class FromRankZero(RoundRobin):
    broadcast_from_owner = False


class DefaultsDropped(RoundRobin):
    pass_defaults = False


class FullState(torch.optim.Optimizer):
    """Averages the gradients and steps one optimizer over every parameter: not sharded."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, defaults)
        self.all = [p for g in self.param_groups for p in g["params"]]
        self.local = optimizer_class(self.all, **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.all:
            all_reduce_mean_(p.grad)
        self.local.step()


class NotAveraged(Zero1Optimizer):
    average_gradients = False


class TwoOwners(RoundRobin):
    """owner = i % 2: right values at every world size, the state on two ranks only."""

    def __init__(self, params, optimizer_class, **defaults):
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.all = [p for g in self.param_groups for p in g["params"]]
        self.owner = [i % 2 for i in range(len(self.all))]
        mine = [p for p, o in zip(self.all, self.owner) if o == dist.get_rank()]
        # a rank that owns nothing (rank 2 of 3) builds no optimizer: torch's refuses an empty
        # parameter list
        self.local = optimizer_class(mine, **defaults) if mine else None

    @torch.no_grad()
    def step(self, closure=None):
        flat = torch.cat([p.grad.reshape(-1) for p in self.all])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(self.all, flat.split([p.numel() for p in self.all])):
            p.grad.copy_(g.view_as(p))
        if self.local is not None:
            self.local.step()
        for p, o in zip(self.all, self.owner):
            dist.broadcast(p, o)


class TwoOwnersUnguarded(RoundRobin):
    """owner = i % 2 as a learner first writes it: rank 2 builds an optimizer over nothing."""

    def __init__(self, params, optimizer_class, **defaults):
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.all = [p for g in self.param_groups for p in g["params"]]
        self.owner = [i % 2 for i in range(len(self.all))]
        mine = [p for p, o in zip(self.all, self.owner) if o == dist.get_rank()]
        self.local = optimizer_class(mine, **defaults)


class HalvedZero(RoundRobin):
    """Divides the summed gradients by a constant 2."""

    divide = False

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.all:
            p.grad /= 2
        super().step(closure)


# ----------------------------------------------------------------------------- judging

ANSWERS = {
    "04.3": {"reference": reference("04.3"), "hook": HookNaive, "no_broadcast": NoBroadcast,
             "trainable_broadcast": TrainableBroadcast, "no_divide": NoDivide,
             "divided_twice": DividedTwice, "every_parameter": EveryParameter,
             "parameters_only": ParametersOnly, "from_last_rank": FromLastRank,
             "hooks_every_forward": HooksEveryForward, "half": HalfNaive,
             "rank_zero": RankZeroAverages},
    "04.4": {"reference": reference("04.4"), "futures": FutureBuckets,
             "after_backward": AfterBackward, "wait_in_hook": WaitInHook,
             "blocking": BlockingInHook, "forward_order": ForwardOrder,
             "construction_buckets": ConstructionBuckets,
             "cap_ignored": CapIgnored, "syncs_in_no_sync": SyncsInNoSync,
             "zeroes_in_forward": ZeroesInForward, "half": HalfBuckets},
    "06.5": {"reference": reference("06.5"), "stacked": global_count_stacked,
             "micro_mean": micro_mean, "micro_mean_summed": micro_mean_summed,
             "rank_count": rank_count, "global_count_only": global_count_only,
             "count_averaged": count_averaged, "times_two": global_count_times_two},
    "08.5": {"reference": reference("08.5"), "round_robin": RoundRobin, "summed": Summed,
             "no_broadcast": NoBroadcastZero, "from_rank_zero": FromRankZero,
             "defaults_dropped": DefaultsDropped, "full_state": FullState,
             "not_averaged": NotAveraged, "two_owners": TwoOwners, "halved": HalvedZero,
             "two_owners_unguarded": TwoOwnersUnguarded},
}


@pytest.fixture(scope="module")
def verdicts():
    """(exercise, name) -> verdict for every answer above, judged in shared launches."""
    pairs = [(e, fn) for e, table in ANSWERS.items() for fn in table.values()]
    keys = [(e, name) for e, table in ANSWERS.items() for name in table]
    return dict(zip(keys, run_pairs(pairs)))


def _children(parent: int | None = None) -> list[int]:
    """Pids of the children of ``parent`` (default: this process) that are still alive (Linux
    /proc), [] elsewhere."""
    me, out = str(os.getpid() if parent is None else parent), []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append(int(pid))
    return out


def _first(verdict) -> str:
    assert not verdict.passed, str(verdict)
    return verdict.problems[0]


@pytest.mark.slow
@pytest.mark.parametrize("exercise", sorted(ANSWERS))
def test_correct_answers_written_differently_pass(verdicts, exercise):
    right = [n for n in ANSWERS[exercise] if n in
             ("reference", "hook", "futures", "stacked", "round_robin")]
    assert len(right) == 2
    for name in right:
        assert verdicts[exercise, name].passed, (name, str(verdicts[exercise, name]))


@pytest.mark.slow
def test_04_3_naive_ddp_refuses_the_plausible_wrong_answers(verdicts):
    v = lambda name: _first(verdicts["04.3", name])  # noqa: E731
    assert v("no_broadcast").startswith("after construction, rank 1: a.weight[0] = ")
    assert "broadcast rank 0's parameters" in v("no_broadcast")
    assert v("trainable_broadcast").startswith("after construction, rank 1: frozen.weight[0]")
    assert "frozen parameter was not broadcast" in v("trainable_broadcast")
    assert v("no_divide").startswith("step 1, rank 0: a.weight[0] = ")
    assert "the gradients are 2x the average" in v("no_divide")
    assert v("divided_twice").startswith("step 1, rank 0: ")
    assert "1/2 of the average" in v("divided_twice")
    assert v("every_parameter").startswith("rank 0 raised ")
    assert v("parameters_only").startswith("after construction, rank 1: shift[0] = ")
    assert "the buffer shift was not broadcast" in v("parameters_only")
    # the ranks agree with each other: rank 0's weights were replaced by rank 1's
    last = v("from_last_rank")
    assert last.startswith("after construction, rank 0: a.weight[0] = "), last
    assert "the ranks agree, but every rank holds rank 1's initial weights" in last
    assert "Broadcast from rank 0 (src=0)" in last and "of its own" not in last
    again = v("hooks_every_forward")
    assert again.startswith("step 2, rank 0: the weights are right, but this backward made 10 "
                            "dist.all_reduce calls for 5 gradients (all-reduces per backward: "
                            "[5, 10, 15, 20])"), again
    assert "hooks were registered again in every forward" in again
    # a constant 2 for the world size: right at 2 processes, 3/2 of the average at 3
    assert v("half").startswith("with 3 processes: step 1, rank 0: a.weight[0] = "), v("half")
    # a collective only rank 0 reaches: a verdict naming the rank, not a frozen check
    hang = v("rank_zero")
    assert "rank 0 at line" in hang and "rank 1 finished" in hang
    # every launch, the hung one too, left no process behind: none of ours but the standard
    # library's fork server of the agents (ddp_lesson.launch.forkserver) and its resource
    # tracker, and the server has none left either
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    assert [p for p in _children() if p not in (server, tracker)] == []
    assert server is None or _children(server) == []


@pytest.mark.slow
def test_04_4_bucketed_ddp_checks_weights_buckets_overlap_and_no_sync(verdicts):
    v = lambda name: _first(verdicts["04.4", name])  # noqa: E731
    assert v("after_backward").startswith("bucket_cap_mb = 0/2**20 (0 bytes), step 1, rank 0: "
                                          "the first bucket's all-reduce was issued after the "
                                          "last gradient was ready")
    assert "was blocking (async_op=False)" in v("blocking")
    assert "waited for before backward had produced every gradient" in v("wait_in_hook")
    assert v("forward_order").startswith("bucket_cap_mb = 0/2**20 (0 bytes), step 1, rank 0: "
                                         "all-reduced messages of [15, 5, 20, 4, 8, 2] "
                                         "elements: buckets sent in forward order")
    assert "[2, 8, 4, 20, 5, 15]" in v("forward_order")
    assert v("construction_buckets") == (
        "bucket_cap_mb = 40/2**20 (40 bytes), step 1, rank 0: all-reduced messages of "
        "[2, 12, 25, 15] elements: buckets filled in registration order, sent last first: "
        "torch's buckets at construction, kept only with find_unused_parameters=True; by "
        "default torch rebuilds them in the order gradients become ready (the last parameter "
        "first), each closed once it holds at least the cap, sent in that order: [10, 24, 20].")
    cap = v("cap_ignored")
    assert cap.startswith("bucket_cap_mb = 0/2**20 (0 bytes), step 1, rank 0: all-reduced "
                          "messages of [54] elements") and "1 bucket(s) instead of 6" in cap
    assert v("syncs_in_no_sync").startswith("bucket_cap_mb = 0/2**20 (0 bytes), step 3, rank 0: "
                                            "the backward of a forward inside no_sync() "
                                            "all-reduced 6 message(s)")
    half = v("half")
    assert half.startswith("with 3 processes: bucket_cap_mb = 0/2**20 (0 bytes): step 1, "
                           "rank 0: "), half
    lost = v("zeroes_in_forward")
    assert lost.startswith("bucket_cap_mb = 0/2**20 (0 bytes): step 3 (two micro-batches, the "
                           "first inside no_sync()), rank 0: ")


@pytest.mark.slow
def test_06_5_global_count_loss_names_the_normalisation(verdicts):
    v = lambda name: _first(verdicts["06.5", name])  # noqa: E731
    first = ("2 micro-batch(es) per rank, valid tokens by rank [[1, 4], [2, 5]]: rank 0's "
             "averaged gradient[")
    assert v("micro_mean").startswith(first)
    assert "each micro-batch's mean, averaged over the K micro-batches" in v("micro_mean")
    assert "summed over the K" in v("micro_mean_summed")
    assert v("rank_count").startswith(first) and "a loss divided per rank" in v("rank_count")
    assert v("global_count_only").startswith(first)
    assert "not multiplied by the world size R" in v("global_count_only")
    assert "the count was averaged over the ranks" in v("count_averaged")
    assert v("times_two").startswith("with 3 processes: 2 micro-batch(es) per rank, valid "
                                     "tokens by rank [[1, 4], [2, 5], [3, 6]]: rank 0's "
                                     "averaged gradient["), v("times_two")


@pytest.mark.slow
def test_08_5_zero1_checks_the_update_and_the_sharded_state(verdicts):
    v = lambda name: _first(verdicts["08.5", name])  # noqa: E731
    assert v("full_state") == ("rank 0 holds optimizer state for all 6 parameters: ZeRO-1 keeps "
                               "on each rank the state of its own shard only; build the local "
                               "optimizer over the parameters this rank owns.")
    assert v("summed").startswith("step 1, rank 0: parameter 0 (shape [6, 4])[0] = ")
    assert "summed over the ranks, not averaged" in v("summed")
    assert "that is its value before the step" in v("no_broadcast")
    assert "that is its value before the step" in v("from_rank_zero")
    assert v("defaults_dropped").startswith("step 1, rank 0: parameter 0")
    assert "**defaults" in v("defaults_dropped")
    assert v("not_averaged").startswith("step 1, rank ")
    assert v("two_owners") == ("rank 2 holds no optimizer state: the 6 "
                               "parameters are shared among rank(s) 0, 1 of the 3. Partition "
                               "them over all dist.get_world_size() ranks (owner = i % R, not "
                               "a constant), so each rank keeps about 1/R of the state.")
    assert v("halved").startswith("step 1, rank 0: parameter 0 "), v("halved")
    raw = v("two_owners_unguarded")
    assert re.match(r"rank 2 raised ValueError: optimizer got an empty parameter list: rank 2 of "
                    r"3 owns no parameter. Partition the 6 parameters over all "
                    r"dist.get_world_size\(\) ranks \(owner = i % R, not a constant\) at line "
                    r"\d+ \(self.local = optimizer_class\(mine, \*\*defaults\)\)", raw), raw


# ----------------------------------------------------------------------------- 07.6 (local)

def _entries(dump, group="0"):
    return [e for e in dump["entries"]
            if e["process_group"][0] == group and not e["is_p2p"]]


def stuck_by_vote(dumps):
    """Right, written differently: per sequence id, a vote over (op, sizes, dtypes)."""
    seqs = {r: {e["collective_seq_id"]: e for e in _entries(d)} for r, d in dumps.items()}
    start = max(min(s) for s in seqs.values())
    for seq in sorted({k for s in seqs.values() for k in s if k >= start}):
        for r in sorted(dumps):
            if seq not in seqs[r]:
                other = next(s[seq] for s in seqs.values() if seq in s)
                return r, seq, other["profiling_name"]
        sig = {r: (s[seq]["profiling_name"], str(s[seq]["input_sizes"]),
                   str(s[seq]["input_dtypes"])) for r, s in seqs.items()}
        votes = Counter(sig.values())
        if len(votes) > 1:
            r = min(sig, key=lambda r: (votes[sig[r]], r))
            return r, seq, seqs[r][seq]["profiling_name"]
    return None


def lowest_completed(dumps):
    r = min(dumps, key=lambda r: (dumps[r]["pg_status"]["0"]["last_completed_collective"], r))
    seq = dumps[r]["pg_status"]["0"]["last_completed_collective"] + 1
    return r, seq, "all_reduce"


def fewest_entries(dumps):
    r = min(dumps, key=lambda r: (len(_entries(dumps[r])), r))
    return r, _entries(dumps[r])[-1]["collective_seq_id"] + 1, "all_reduce"


def _naive(dumps, group_of=lambda e: e["process_group"][0] == "0", p2p=False, sizes=True,
           window=True):
    seqs = {r: {e["collective_seq_id"]: e for e in d["entries"]
                if group_of(e) and (p2p or not e["is_p2p"])} for r, d in dumps.items()}
    start = max(min(s) for s in seqs.values()) if window else min(min(s) for s in seqs.values())
    for seq in sorted({k for s in seqs.values() for k in s if k >= start}):
        have = {r: s[seq] for r, s in seqs.items() if seq in s}
        if len(have) < len(seqs):
            r = min(set(seqs) - set(have))
            return r, seq, next(iter(have.values()))["profiling_name"]
        sig = {r: (e["profiling_name"], str(e["input_sizes"]) if sizes else "")
               for r, e in have.items()}
        votes = Counter(sig.values())
        if len(votes) > 1:
            r = min(sig, key=lambda r: (votes[sig[r]], r))
            return r, seq, have[r]["profiling_name"]
    return 0, 0, "none"


def ops_only(dumps):
    return _naive(dumps, sizes=False)


def every_group(dumps):
    return _naive(dumps, group_of=lambda e: True)


def with_p2p(dumps):
    return _naive(dumps, p2p=True)


def from_oldest(dumps):
    return _naive(dumps, window=False)


def first_waiting(dumps):
    for r in sorted(dumps):
        done = dumps[r]["pg_status"]["0"]["last_completed_collective"]
        later = [e for e in _entries(dumps[r]) if e["collective_seq_id"] > done]
        if later:
            return r, later[0]["collective_seq_id"], later[0]["profiling_name"]
    return 0, 0, "none"


def _key(dumps):
    return json.dumps(dumps, sort_keys=True, default=str)


#: A lookup table of the seven hand-built hangs' answers (what a learner could hard-code).
SEVEN = {_key(d): want for d, want, _ in stuck_rank_module._hangs().values()}


def table_of_seven(dumps):
    return SEVEN.get(_key(dumps), (0, 1, "all_reduce"))


def ignores_dtypes(dumps):  # compares ops and shapes per sequence id, not dtypes
    return _naive(dumps)


def test_07_6_draws_its_hangs_anew_and_names_the_seed(monkeypatch):
    # the seven hand-built hangs pass a table; the drawn ones do not, and the verdict names
    # the seed that draws them again
    (table,) = run_candidates("07.6", [table_of_seven])
    text = _first(table)
    assert re.match(r"hang '1 of seed \d+: rank \d issues #\d+|hang '1 of seed \d+: rank \d "
                    r"never issues", text), text
    seed = int(re.search(r"DDP_LESSON_CHECK_SEED=(\d+)", text).group(1))
    monkeypatch.setenv("DDP_LESSON_CHECK_SEED", str(seed))
    (again,) = run_candidates("07.6", [table_of_seven])
    assert _first(again) == text  # the seed reproduces the verdict
    # a finder that ignores dtypes passes the seven and every drawn hang but the dtype ones
    for seed in (1, 2, 3):
        monkeypatch.setenv("DDP_LESSON_CHECK_SEED", str(seed))
        good, dtypes = run_candidates("07.6", [reference("07.6"), ignores_dtypes])
        assert good, str(good)
        assert f"of seed {seed}: rank " in _first(dtypes)
        assert "issues #" in _first(dtypes) and "with another dtype" in _first(dtypes)
        assert "same op and shape everywhere: the dtypes (" in _first(dtypes)


def test_07_6_drawn_hangs_cover_every_kind_and_a_lagging_status():
    hangs = list(stuck_rank_module.drawn_hangs(7).values())
    assert len(hangs) == stuck_rank_module.DRAWN == 16
    names = list(stuck_rank_module.drawn_hangs(7))
    for kind in ("never issues", "as another op", "with another shape", "with another dtype"):
        assert sum(kind in name for name in names) == 4, (kind, names)
    for trap in ("lags", "ring buffers", "subgroups", "is_p2p", "retired"):
        assert sum(trap in why for _, _, why in hangs) >= 3, trap
    lagging = 0
    for dumps, (rank, seq, op), why in hangs:
        assert reference("07.6")(copy.deepcopy(dumps)) == (rank, seq, op), why
        done = {r: d["pg_status"]["0"]["last_completed_collective"] for r, d in dumps.items()}
        if "lags" in why:  # the status alone names an innocent rank
            lagging += 1
            assert min(done, key=lambda r: (done[r], r)) != rank, (done, rank, why)
    assert lagging >= 3
    # another seed draws other hangs
    assert [w for _, w, _ in hangs] != [w for _, w, _ in
                                        stuck_rank_module.drawn_hangs(8).values()]


def test_07_6_stuck_rank_on_seven_recorded_hangs():
    good, vote, *wrong = run_candidates("07.6", [
        reference("07.6"), stuck_by_vote, lowest_completed, fewest_entries, ops_only,
        every_group, with_p2p, from_oldest, first_waiting])
    assert good and vote, (str(good), str(vote))
    low, few, ops, groups, p2p, oldest, waiting = (_first(v) for v in wrong)
    assert low.startswith("hang 'rank 2 never calls #4' (3 ranks): you named rank 0, #4 "
                          "all_reduce; the records say rank 2, #4 all_reduce: ")
    assert few.startswith("hang 'rank 1 broadcasts where the others all-reduce' (4 ranks): you "
                          "named rank 0, #4 all_reduce; the records say rank 1, #3 broadcast")
    assert ops.startswith("hang 'rank 0 all-reduces a larger tensor'") and "[1000]" in ops
    assert groups.startswith("hang 'subgroups with sequence ids of their own'")
    assert p2p.startswith("hang 'point-to-point entries between the collectives'")
    assert oldest.startswith("hang 'ring buffers dropped different old entries'")
    assert waiting.startswith("hang 'rank 2 never calls #4' (3 ranks): you named rank 0, #4")
    (none,) = run_candidates("07.6", [lambda dumps: None])
    assert "returned None (missing return?)" in _first(none)


def test_new_exercises_describe_their_call():
    for i, call in [("04.3", "cls(module: nn.Module)"), ("04.4", "bucket_cap_mb: float"),
                    ("06.5", "fn(sums: list[Tensor ()], counts: list[int])"),
                    ("07.6", "fn(dumps: dict[int, dict]) -> tuple[int, int, str]"),
                    ("08.5", "cls(params: list[Tensor], optimizer_class, **defaults)")]:
        text = describe(i)
        assert call in text and f'check("{i}", your_' in text
    with pytest.raises(TypeError, match="needs your function"):
        check("07.6", None)
