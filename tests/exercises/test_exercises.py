"""Every exercise checker accepts the package's reference and rejects the typical wrong answers.

The wrong answers are the mistakes the series teaches about (the seed's sampler defects, a
sum instead of a mean, a forgotten set_epoch, a ring without its all-gather phase, ...); each
test asserts the verdict's specific words, not only that it failed. Distributed checkers
start real torchrun jobs, so each test declares the distributed candidates it judges
(``@judges``) and the ``judged`` fixture judges those of every selected test that start the
same number of processes together (``run_pairs``: one launch per number of processes, plus
one after a candidate that ends its launch); the public ``check()`` path is exercised too.
"""
from __future__ import annotations

import json
import linecache
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddp_lesson.exercises import check, describe, exercise_ids, reference
from ddp_lesson.exercises.core import get, run_candidates, run_pairs

ROOT = Path(__file__).resolve().parents[2]

# A raising or hanging candidate costs one collective timeout; keep it short here.
os.environ.setdefault("DDP_LESSON_CHECK_TIMEOUT_S", "4")


class Attempt:
    """Stands for :func:`notebook_attempt` of ``exercise_id`` in ``@judges``: the notebook's
    code is run when the candidates are judged, not when this file is imported."""

    def __init__(self, exercise_id):
        self.exercise_id = exercise_id


# test name -> [(exercise id, candidate)]: the distributed candidates each test judges, and
# those that end their launch (a rank exits, gloo aborts a process), judged after all others
JUDGED: dict[str, list] = {}
ENDS_LAUNCH: dict[str, list] = {}


def judges(exercise_id, *candidates, ends_launch=False):
    """Declare the distributed candidates a test judges; the test reads their verdicts, in
    this order, from the ``judged`` fixture (after its other candidates when it has both)."""
    def declare(test):
        table = ENDS_LAUNCH if ends_launch else JUDGED
        table.setdefault(test.__name__, []).extend((exercise_id, c) for c in candidates)
        return test
    return declare


class _Verdicts:
    """The verdicts of the selected tests' declared candidates, judged on first need: all
    those that start the same number of processes in one ``run_pairs`` call (declared order,
    the ones that end a launch last), so each number of processes costs one launch."""

    def __init__(self, selected):
        self.selected, self.done = selected, {}

    @staticmethod
    def _processes(test):
        return {get(e).world_size for t in (JUDGED, ENDS_LAUNCH) for e, _ in t.get(test, [])}

    def of(self, test):
        for size in sorted(self._processes(test) - set(self.done)):
            owners, pairs = [], []
            for table in (JUDGED, ENDS_LAUNCH):
                for name, declared in table.items():
                    for e, c in declared:
                        if name in self.selected and get(e).world_size == size:
                            owners.append(name)
                            pairs.append((e, notebook_attempt(c.exercise_id)
                                          if isinstance(c, Attempt) else c))
            found: dict[str, list] = {}
            for name, verdict in zip(owners, run_pairs(pairs)):
                found.setdefault(name, []).append(verdict)
            self.done[size] = found
        return [v for found in self.done.values() for v in found.get(test, [])]


@pytest.fixture(scope="module")
def _verdicts(request):
    selected = {item.originalname for item in request.session.items
                if getattr(item, "module", None) is request.module}
    return _Verdicts(selected)


@pytest.fixture
def judged(_verdicts, request):
    """The verdicts of the candidates this test declared with ``@judges``, in order."""
    return _verdicts.of(request.node.originalname)


def notebook_attempt(exercise_id):
    """The 'first attempt' a notebook's last cell defines and checks, run from its own source.

    The cell ends in ``check("NN.K", name)``; everything before that line is executed here
    (as the reader's kernel would) and ``name`` is returned, so the tests below judge exactly
    the code whose verdict the notebook stores.
    """
    nb = next((ROOT / "notebooks").glob(exercise_id[:2] + "_*.ipynb"))
    cell = next(c for c in json.loads(nb.read_text())["cells"]
                if "exercise-check" in c.get("metadata", {}).get("tags", []))
    src = "".join(cell["source"])
    m = re.search(rf'^check\("{re.escape(exercise_id)}", (\w+)\)\s*$', src, re.M)
    assert m, src
    namespace = {"__name__": f"notebook_{exercise_id[:2]}_attempt"}
    filename = f"<notebook {nb.name}, exercise cell>"
    lines = src[:m.start()].splitlines(keepends=True)
    linecache.cache[filename] = (len(src), None, lines, filename)  # as IPython does for cells
    exec(compile(src[:m.start()], filename, "exec"), namespace)
    return namespace[m.group(1)]


# ----------------------------------------------------------------------------- catalogue

def test_every_exercise_in_the_notebooks_has_a_checker_and_vice_versa():
    mentioned = set()
    for nb in sorted((ROOT / "notebooks").rglob("*.ipynb")):  # deep dives' exercises too
        cells = json.loads(nb.read_text())["cells"]
        text = "".join("".join(c["source"]) for c in cells)
        ids = set(re.findall(r'check\("(\d\d\.\d+)"', text))
        assert all(i.startswith(nb.name[:2]) for i in ids), (nb.name, ids)
        mentioned |= ids
    assert mentioned == set(exercise_ids())
    # at least one checkable exercise per notebook
    assert {i[:2] for i in exercise_ids()} == {f"{k:02d}" for k in range(10)}


def test_describe_names_the_task_and_how_to_check():
    text = describe("02.1")
    assert "02.1" in text and "num_replicas" in text and 'check("02.1", your_class)' in text
    assert "3 and 2 processes" in text
    with pytest.raises(KeyError, match="02.1"):
        describe("99.9")
    with pytest.raises(TypeError, match="needs your function"):
        check("00.3", 5)


# ----------------------------------------------------------------------------- local ones

def test_00_3_local_rank():
    good, glob, node = run_candidates("00.3", [reference("00.3"), notebook_attempt("00.3"),
                                               lambda r, n: r // n])
    assert good.passed and str(good).startswith("PASSED 00.3")
    # the notebook's attempt returns the global rank: rank 4 is node 1's GPU 0
    assert not glob and "rank 4 with 4 processes per node on 2 nodes: got 4, expected 0" in str(
        glob
    )
    assert "C1" in glob.problems[0]
    assert "node's number" in node.problems[0]


def test_03_3_tree_ring_crossover():
    # R=8, alpha=5 us, beta=0.1 ns/byte: 4 alpha / (2.125 beta) bytes, from the two formulas
    assert reference("03.3")(5e-6, 1e-10, 8) == pytest.approx(4 * 5e-6 / (2.125 * 1e-10))

    def forgot_latency_levels(alpha, beta, R):  # uses log2 R without the ceiling
        L = math.log2(R)
        return max(0.0, (R - 1 - L) * alpha / ((L - (R - 1) / R) * beta))

    def bisect(alpha, beta, R):  # a numerical answer is fine
        from ddp_lesson.cost_model import ring_allreduce_time, tree_allreduce_time
        lo, hi = 0.0, 1e12
        if tree_allreduce_time(0, R, alpha, beta) >= ring_allreduce_time(0, R, alpha, beta):
            return 0.0
        for _ in range(200):
            mid = (lo + hi) / 2
            if tree_allreduce_time(mid, R, alpha, beta) < ring_allreduce_time(mid, R, alpha, beta):
                lo = mid
            else:
                hi = mid
        return lo

    good, wrong, numeric = run_candidates(
        "03.3", [reference("03.3"), forgot_latency_levels, bisect]
    )
    assert good and numeric
    assert not wrong and "R=5" in wrong.problems[0] and "They cross at" in wrong.problems[0]


def test_06_4_effective_lr():
    divided = notebook_attempt("06.4")
    no_accum = lambda lr, bb, b, R, k, rule: reference("06.4")(lr, bb, b, R, 1, rule)  # noqa: E731
    good, v_div, v_acc = run_candidates("06.4", [reference("06.4"), divided, no_accum])
    assert good
    # 0.1 tuned at 256, 4 x 128 = 512 samples: linear gives 0.2; divided by 4, 0.05
    assert (
        "got 0.05, expected 0.2 (global batch 512): yours is divided by the 4 processes"
        in v_div.problems[0]
    )
    assert "accumulation steps are part of the global batch" in v_acc.problems[0]
    def sqrt_as_linear(lr, bb, b, R, k, rule):
        return reference("06.4")(lr, bb, b, R, k, "linear" if rule == "sqrt" else rule)

    (v_sqrt,) = run_candidates("06.4", [sqrt_as_linear])
    # 0.4 tuned at 64, 4 x 4 x 2 = 32: sqrt gives 0.4 * sqrt(1/2) = 0.2828, linear 0.2, which
    # is also what sqrt gives without the accumulation steps; the diagnosis names the rule
    assert v_sqrt.problems[0] == (
        "lr 0.4 tuned at batch 64, 4 processes x 4 samples x 2 accumulation step(s), rule 'sqrt': "
        "got 0.2, expected 0.2828 (global batch 32): that is the 'linear' rule's value for this "
        "global batch, not the 'sqrt' rule's. sqrt: base_lr x sqrt(global batch / base_batch).")
    # notebook 06's exercise: 0.1 tuned at 16, 4 processes x 8 samples, linear -> 0.2
    assert reference("06.4")(0.1, 16, 8, 4, 1, "linear") == pytest.approx(0.2)


def test_07_5_global_rank():
    good, rr, collide = run_candidates("07.5", [reference("07.5"), notebook_attempt("07.5"),
                                                lambda n, l, p: n + l])
    assert good
    assert rr.problems[0].startswith(
        "2 nodes x 2 processes: node 0, local rank 1 got RANK 2, torchrun gives 1"
    )
    assert "node by node, not round-robin" in rr.problems[0]
    assert "node 0, local rank 1 and node 1, local rank 0 would share RANK 1" in collide.problems[0]


def test_08_1_zero3_ranks():
    assert reference("08.1")(70e9, 80e9) == 14  # 16 * 70e9 / 80e9 = 14 exactly
    floor = notebook_attempt("08.1")
    stage0 = lambda psi, gpu: 1000  # noqa: E731 (a candidate as a learner may write it)
    good, v_floor, v_many = run_candidates("08.1", [reference("08.1"), floor, stage0])
    assert good
    assert "7.5B parameters on 80 GB ranks: on 1 rank ZeRO-3 keeps 120 GB" in v_floor.problems[0]
    assert "fewest" in v_many.problems[0]


# ----------------------------------------------------------------------------- 01

def plain_mean(grad, count):
    g = grad.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def plain_sum(grad, count):
    g = grad.clone()
    dist.all_reduce(g)
    return g


def undivided(grad, count):
    g = grad * count
    dist.all_reduce(g)
    return g


def over_eight(grad, count):  # right while the shards total 8 samples
    g = grad * count
    dist.all_reduce(g)
    return g / 8


def as_row(grad, count):  # the right values, shaped (1, 3)
    return reference("01.4")(grad, count).reshape(1, 3)


def as_double(grad, count):  # the right values in float64 (the reference's own precision)
    return reference("01.4")(grad, count).double()


@pytest.mark.slow
@judges("01.4", reference("01.4"), plain_mean, Attempt("01.4"), plain_sum, undivided,
        over_eight, as_row, as_double)
def test_01_4_weighted_average(judged):
    good, mean, nb_mean, total, undiv, eight, row, double = judged
    assert good
    # shards 3, 6, 2 total 11
    assert eight.problems[0].startswith("with shards of 3, 6, 2 samples, rank 0 returned "), (
        eight.problems
    )
    assert "yours divides by 8, the total of another case; here it is 11" in eight.problems[0]
    # rank r's gradient is [r+1, -(r+1)/2, r^2 + 1/4]: plain mean [2, -1, 23/12], weighted
    # by 4, 2, 2: [14, -7, 12] / 8
    assert mean.problems[0].startswith("with shards of 4, 2, 2 samples, rank 0 returned "
                                       "[2, -1, 1.917]; the global-batch gradient is "
                                       "[1.75, -0.875, 1.5]")
    assert nb_mean.problems == mean.problems
    assert "plain mean of the 3 gradients" in mean.problems[0]
    assert "the plain sum" in total.problems[0]
    assert "divide it by the total count 8" in undiv.problems[0]
    # the values are right; the shape and the dtype are checked too
    assert row.problems[0] == ("with shards of 4, 2, 2 samples, rank 0 returned the right values "
                               "as float32 of shape [1, 3]; the gradient is a float32 tensor "
                               "of shape [3]: return it shaped and typed like grad.")
    assert "as float64 of shape [3]" in double.problems[0]


def summed(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def weights_only(model):
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def divided_by_two(model):  # right with 2 ranks only: a constant for the world size
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


def by_environment(model):  # right: torchrun's WORLD_SIZE, read where the group is made
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= int(os.environ["WORLD_SIZE"])


@pytest.mark.slow
@judges("01.5", reference("01.5"), summed, weights_only, divided_by_two, by_environment)
def test_01_5_average_gradients(judged):
    good, v_sum, v_weights, v_two, v_env = judged
    assert good
    # at each world size the checker's environment says that size, as torchrun's would
    assert v_env.passed, str(v_env)
    assert "2x too big" in v_sum.problems[0] and "divide by world_size (2)" in v_sum.problems[0]
    assert "Not averaged here: 0.bias, 2.bias" in v_weights.problems[0]
    # passes with 2 ranks; with 3 the sum over 3 ranks divided by 2 is 1.5x the mean
    assert not v_two
    assert v_two.problems[0].startswith("with 3 processes: rank 0: 0.weight.grad is "), (
        v_two.problems
    )
    assert "the sum over the 3 ranks divided by 2" in v_two.problems[0]
    assert "not a constant" in v_two.problems[0]


# ----------------------------------------------------------------------------- 02

class SeedSampler(Sampler):
    """The seed's sampler, as printed: pads once, and its __len__ sits inside __iter__."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.num_samples = math.ceil(len(dataset) / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices += indices[:(self.total_size - len(indices))]
        assert len(indices) == self.total_size
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def set_epoch(self, epoch):
        self.epoch = epoch


class SeedSamplerWithLen(SeedSampler):
    def __len__(self):
        return self.num_samples


class EpochIgnored(SeedSamplerWithLen):
    """set_epoch is there but does nothing: the same 'shuffle' every epoch."""

    def set_epoch(self, epoch):
        pass


class RankSeeded(Sampler):
    """Each rank draws its own permutation (seed + rank): shards overlap."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.inner = reference("02.1")(dataset, num_replicas, rank, shuffle, seed + rank, drop_last)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


class Contiguous(Sampler):
    """Each rank takes one contiguous block of the padded order (PyTorch 0.3)."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.args = (len(dataset), num_replicas, rank, shuffle, seed, 0, drop_last)

    def set_epoch(self, epoch):
        n, R, r, s, seed, _, d = self.args
        self.args = (n, R, r, s, seed, epoch, d)

    def __iter__(self):
        from ddp_lesson.sampler import contiguous_shard_indices
        return iter(contiguous_shard_indices(*self.args))

    def __len__(self):
        from ddp_lesson.sampler import num_samples_per_rank
        return num_samples_per_rank(self.args[0], self.args[1], self.args[6])


class PadsWithTheEnd(SeedSamplerWithLen):
    """Pads with the last indices instead of wrapping round to the first."""

    def __iter__(self):
        indices = list(range(len(self.dataset)))
        pad = self.total_size - len(indices)
        indices += indices[len(indices) - pad:] if pad else []
        return iter(indices[self.rank:self.total_size:self.num_replicas])


class LenAlwaysZero(Sampler):
    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.inner = reference("02.1")(dataset, num_replicas, rank, shuffle, seed, drop_last)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return 0


class SeedIgnored(LenAlwaysZero):
    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.inner = reference("02.1")(dataset, num_replicas, rank, shuffle, 0, drop_last)

    def __len__(self):
        return len(self.inner)


class RankFromTheGroup(SeedIgnored):
    """Ignores its rank argument and asks the process group: right on each process, wrong
    for a sampler built for another rank."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.inner = reference("02.1")(dataset, num_replicas, dist.get_rank(), shuffle, seed,
                                       drop_last)


class CountsItsPasses(Sampler):
    """set_epoch does nothing; the sampler counts its own passes and uses that as the epoch:
    right when iterated once per epoch from epoch 0, wrong after a resume."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.args, self.passes = (dataset, num_replicas, rank, shuffle, seed, drop_last), 0

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        inner = reference("02.1")(*self.args)
        inner.set_epoch(self.passes)
        self.passes += 1
        return iter(inner)

    def __len__(self):
        return len(reference("02.1")(*self.args))


class YieldsItems(Sampler):
    """Yields dataset[i] where i belongs (right while the dataset is range(N))."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.dataset = dataset
        self.inner = reference("02.1")(dataset, num_replicas, rank, shuffle, seed, drop_last)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        return (self.dataset[i] for i in self.inner)

    def __len__(self):
        return len(self.inner)


class ThreeReplicas(SeedIgnored):
    """Right with 3 processes only: a constant 3 where num_replicas belongs."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.inner = reference("02.1")(dataset, 3, 0, shuffle, seed, drop_last)
        self.inner.rank = rank      # unchecked, as a learner's: rank 3 of "3" deals [3::3]


@pytest.mark.slow
def test_02_1_reference_passes_through_the_public_check():
    v = check("02.1", reference("02.1"))
    assert v.passed, str(v)
    assert "3 and 2 processes (torchrun, gloo)" in str(v)


@pytest.mark.slow
@judges("02.1", SeedSampler, SeedSamplerWithLen, EpochIgnored, RankSeeded, Contiguous,
        Attempt("02.1"), PadsWithTheEnd, LenAlwaysZero, SeedIgnored, RankFromTheGroup,
        CountsItsPasses, ThreeReplicas, YieldsItems)
def test_02_1_sampler_rejects_the_typical_mistakes(judged):
    verdicts = judged
    (seed, seed_len, epoch, ranked, contiguous, nopad, ends, len0, noseed, group_rank, passes,
     three, items) = [v.problems[0] if v.problems else "" for v in verdicts]
    assert not any(verdicts)
    assert items.startswith("N=9, R=3, shuffle=False: rank 0's sampler yielded ('sample', 0) "
                            "(tuple), not an index: a sampler yields indices i into the dataset "
                            "(whole numbers 0 to N-1); the DataLoader reads dataset[i] itself. "
                            "(The checker's dataset item i is ('sample', i).)"), items
    # the first shuffled setting: N=10, seed 0; a fresh sampler's first pass is epoch 0's order
    assert passes.startswith("N=10, R=3, shuffle=True, seed=0: on rank 0, a fresh sampler given "
                             "set_epoch(5) yields "), passes
    from ddp_lesson.sampler import shard_indices
    assert f"torch's yields {shard_indices(10, 3, 0, True, 0, 5)}" in passes
    assert "yours gave epoch 0's" in passes and "not the number of passes" in passes
    # every check at 3 processes passes; a sampler for num_replicas=2 built in one process fails
    assert three.startswith("N=9, R=2, shuffle=False: the sampler built with num_replicas=2, "
                            "rank=0 yields [0, 3, 6], torch's yields [0, 2, 4, 6, 8]"), three
    assert "no constant 3" in three
    # named because the lists show it: process 0's samplers for 2 ranks give num_replicas=3's
    assert ("(ranks 0 to 1: yours [0, 3, 6], [1, 4, 7]; torch's [0, 2, 4, 6, 8], [1, 3, 5, 7, 0]). "
            "These are the lists of num_replicas=3") in three
    assert len0.startswith(
        "N=9, R=3, shuffle=False: rank 0 yields 3 indices but len(sampler) says 0"
    )
    # the first shuffled setting with a seed: N=7, seed=5; the ranks agree on seed 0's order
    assert noseed.startswith(
        "N=7, R=3, shuffle=True, seed=5, epoch 0: the ranks agree on one order"
    )
    assert "the seed argument (5) was ignored" in noseed
    assert ("the sampler built with rank=1 in process 0 gives [0, 3, 6], but rank 1's own gives "
            "[1, 4, 7]") in group_rank
    assert "use the rank and num_replicas arguments" in group_rank
    assert "len(sampler) raised TypeError" in seed and "indented into __iter__" in seed
    assert ("N=1, R=3, shuffle=True, seed=0: iterating rank 0's sampler raised AssertionError"
            in seed_len and "case A7" in seed_len)
    assert "epoch 1: the same order as epoch 0" in epoch and "case A1" in epoch
    assert "case A2" in ranked and re.search(r"index \d+ (is on ranks|twice)", ranked)
    assert "contiguous block [0, 1, 2]" in contiguous and "[0, 3, 6]" in contiguous
    # the notebook's attempt (interleaved, unpadded): N=9 is right, N=10 leaves rank 0 one longer
    assert nopad == ("N=10, R=3, shuffle=False: ranks got 4, 3, 3 indices; every rank needs "
                     "ceil(10/3) = 4, so the order is padded by wrapping round: the padded indices "
                     "are 0 and 1. (8 of 10 settings fail)")
    assert ends.startswith("N=10, R=3, shuffle=False: index 8 is on ranks 1, 2")
    assert "the padded indices are 0 and 1" in ends


class DropsWhenDivisible(Sampler):
    """With drop_last, cuts the order to whole rounds by ceil((N - R) / R) even when N divides
    by R (torch cuts only when it does not): right for every setting at 3 processes (N = 10
    and 11 with drop_last), wrong for N=10 at num_replicas 2 and 5."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        import math
        self.n, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        if drop_last:
            self.num_samples = math.ceil((self.n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(self.n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        if not self.drop_last:
            while 0 < len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples


@pytest.mark.slow
@judges("02.1", DropsWhenDivisible)
def test_02_1_hint_names_the_case_that_differs_and_guesses_no_cause(judged):
    (v,) = judged
    text = v.problems[0]
    # the case: N, R, shuffle, drop_last, and every rank's list against torch's
    assert text.startswith("N=10, R=2, shuffle=False, drop_last=True: the sampler built with "
                           "num_replicas=2, rank=0 yields [0, 2, 4, 6], torch's yields "
                           "[0, 2, 4, 6, 8]"), text
    assert ("(ranks 0 to 1: yours [0, 2, 4, 6], [1, 3, 5, 7]; torch's [0, 2, 4, 6, 8], "
            "[1, 3, 5, 7, 9])") in text
    assert "Ranks got 4, 4 indices; with drop_last=True every rank gets 5: 10 divides by 2, " \
           "so no index is dropped." in text
    # the lists are not num_replicas=3's, so no constant 3 is blamed
    assert "constant 3" not in text and "3 processes" not in text, text


def local_only(seed, epoch):
    assert seed == seed and epoch == epoch


def raises_on_rank0_only(seed, epoch):
    mine = torch.tensor([seed, epoch])
    all_ = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(all_, mine)
    if dist.get_rank() == 0 and any(not torch.equal(t, all_[0]) for t in all_):
        raise RuntimeError("ranks disagree")


def seed_only(seed, epoch):
    mine = torch.tensor([seed])
    all_ = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(all_, mine)
    bad = [r for r, t in enumerate(all_) if not torch.equal(t, all_[0])]
    if bad:
        raise RuntimeError(f"ranks {bad} have another seed")


def unnamed(seed, epoch):
    mine = torch.tensor([seed, epoch])
    all_ = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(all_, mine)
    if any(not torch.equal(t, all_[0]) for t in all_):
        raise RuntimeError("seeds differ")


def multiline(seed, epoch):  # right: the ranks are named on the lines after the first
    mine = torch.tensor([seed, epoch])
    all_ = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(all_, mine)
    if any(not torch.equal(t, all_[0]) for t in all_):
        raise RuntimeError("the ranks disagree on (seed, epoch):\n" + "\n".join(
            f"  rank {r}: seed {int(t[0])}, epoch {int(t[1])}" for r, t in enumerate(all_)))


def three_ranks(seed, epoch):  # a constant 3 for the world size
    mine = torch.tensor([seed, epoch])
    all_ = [torch.zeros_like(mine) for _ in range(3)]
    dist.all_gather(all_, mine)
    bad = [r for r, t in enumerate(all_) if not torch.equal(t, all_[0])]
    if bad:
        raise RuntimeError(f"ranks {bad} differ from rank 0")


@pytest.mark.slow
@judges("02.3", reference("02.3"), local_only, raises_on_rank0_only, seed_only, unnamed,
        multiline, three_ranks)
def test_02_3_seed_epoch_check(judged):
    good, v_local, v_rank0, v_seed, v_unnamed, v_lines, v_three = judged
    assert good
    assert v_lines.passed, v_lines.problems
    # right with 3 ranks; with 2, all_gather refuses a list of 3 tensors
    assert not v_three and v_three.problems[0].startswith(
        "with 2 processes: with seeds 4, 4 and epochs 2, 2 on ranks 0, 1 (all agree), rank 0 "
        "raised RuntimeError: "), v_three.problems
    assert "names, as numbers, the ranks whose (seed, epoch) differs from rank 0's" in describe(
        "02.3"
    )
    assert "seeds 7, 8, 9" in v_local.problems[0] and "nothing was raised" in v_local.problems[0]
    assert "only rank(s) 0 raised; rank(s) 1, 2 returned normally" in v_rank0.problems[0]
    assert "epochs 1, 1, 0" in v_seed.problems[0] and "the epoch matters too" in v_seed.problems[0]
    assert "does not name rank(s) 1, 2" in v_unnamed.problems[0]


def mean_of_means(correct, count):
    acc = torch.tensor([correct / count])
    dist.all_reduce(acc)
    return acc.item() / dist.get_world_size()


def local(correct, count):
    return correct / count


def float32_counts(correct, count):  # float32 arithmetic: right within rounding
    t = torch.tensor([correct, count], dtype=torch.float32)
    dist.all_reduce(t)
    return t[0] / t[1]


def three_pairs(correct, count):  # right with 3 ranks only: a list of 3 for all_gather
    pairs = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    dist.all_gather(pairs, torch.tensor([correct, count]))
    total = sum(pairs)
    return total[0].item() / total[1].item()


@pytest.mark.slow
@judges("02.4", reference("02.4"), mean_of_means, local, float32_counts, three_pairs)
def test_02_4_exact_accuracy(judged):
    good, v_means, v_local, v_f32, v_three = judged
    assert good
    assert v_f32.passed, v_f32.problems
    # N=7 over 2 ranks: shards of 4 and 3; all_gather refuses a list of 3 tensors
    assert v_three.problems[0].startswith("with 2 processes: N=7 split 4, 3 over 2 ranks: rank 0 "
                                          "raised RuntimeError: "), v_three.problems
    # N=7, model wrong on index 6 only: exact 6/7; the mean of 2/3, 1, 1 is 8/9
    assert "rank 0 returned 0.8889, the exact accuracy is 0.8571" in v_means.problems[0]
    assert "mean of the ranks' accuracies" in v_means.problems[0]
    assert "rank 0 returned 0.6667" in v_local.problems[0]
    assert "this rank's own accuracy" in v_local.problems[0]


def guarded_mean_of_means(correct, count):  # right on the first three cases only
    pair = torch.tensor([correct, count])
    dist.all_reduce(pair)
    if count == 0:
        raise ZeroDivisionError("division by zero")
    return pair[0].item() / pair[1].item()


@pytest.mark.slow
@judges("02.4", guarded_mean_of_means)
def test_02_4_empty_shard_crash_is_reported_not_hung(judged):
    (v,) = judged
    assert "N=2 split 1, 1, 0 over 3 ranks: rank 2 raised ZeroDivisionError" in v.problems[0]
    assert "divide once, after the all-reduce" in v.problems[0]


# ----------------------------------------------------------------------------- 03

def ring_without_all_gather(tensor):
    rank, R = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    b = [(flat.numel() * c // R, flat.numel() * (c + 1) // R) for c in range(R)]
    for step in range(R - 1):
        s0, s1 = b[(rank - step) % R]
        r0, r1 = b[(rank - step - 1) % R]
        buf = torch.empty(r1 - r0, dtype=flat.dtype)
        reqs = [
            dist.isend(flat[s0:s1].contiguous(), (rank + 1) % R),
            dist.irecv(buf, (rank - 1) % R),
        ]
        for q in reqs:
            q.wait()
        flat[r0:r1] += buf
    return tensor


def ring_mean(tensor):
    reference("03.6")(tensor)
    if tensor.is_floating_point():
        tensor /= dist.get_world_size()
    else:
        tensor //= dist.get_world_size()
    return tensor


def out_of_place(tensor):
    out = tensor.clone()
    reference("03.6")(out)
    return out


def all_to_all_exchange(tensor):
    """Right values, wrong method: every rank sends its whole tensor to every other rank."""
    rank, R = dist.get_rank(), dist.get_world_size()
    incoming = [torch.empty_like(tensor) for _ in range(R)]
    reqs = []
    for peer in range(R):
        if peer != rank:
            reqs += [dist.isend(tensor.contiguous(), peer), dist.irecv(incoming[peer], peer)]
    for q in reqs:
        q.wait()
    for peer in range(R):
        if peer != rank:
            tensor += incoming[peer]
    return tensor


def whole_tensor_relay(tensor):
    """Neighbours only, but whole tensors passed R-1 times round the ring."""
    rank, R = dist.get_rank(), dist.get_world_size()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(R - 1):
        buf = torch.empty_like(passing)
        reqs = [dist.isend(passing, (rank + 1) % R), dist.irecv(buf, (rank - 1) % R)]
        for q in reqs:
            q.wait()
        total += buf
        passing = buf
    tensor.copy_(total)
    return tensor


def ring_for_four(tensor):
    """The reference ring with R fixed at 4: right at 4 processes only."""
    rank, R = dist.get_rank(), 4
    flat = tensor.view(-1)
    b = [(flat.numel() * c // R, flat.numel() * (c + 1) // R) for c in range(R)]
    for step in range(2 * (R - 1)):
        s0, s1 = b[(rank - step) % R]
        r0, r1 = b[(rank - step - 1) % R]
        buf = torch.empty(r1 - r0, dtype=flat.dtype)
        reqs = [dist.isend(flat[s0:s1].contiguous(), (rank + 1) % R),
                dist.irecv(buf, (rank - 1) % R)]
        for q in reqs:
            q.wait()
        if step < R - 1:
            flat[r0:r1] += buf
        else:
            flat[r0:r1] = buf
    return tensor


def ring_batched(tensor):
    """A right ring whose exchanges go through dist.batch_isend_irecv and P2POp."""
    rank, R = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    b = [(flat.numel() * c // R, flat.numel() * (c + 1) // R) for c in range(R)]
    for step in range(2 * (R - 1)):
        s0, s1 = b[(rank - step) % R]
        r0, r1 = b[(rank - step - 1) % R]
        buf = torch.empty(r1 - r0, dtype=flat.dtype)
        ops = [dist.P2POp(dist.isend, flat[s0:s1].contiguous(), (rank + 1) % R),
               dist.P2POp(dist.irecv, buf, (rank - 1) % R)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        if step < R - 1:
            flat[r0:r1] += buf
        else:
            flat[r0:r1] = buf
    return tensor


@pytest.mark.slow
@judges("03.6", reference("03.6"), ring_without_all_gather, Attempt("03.6"), ring_mean,
        out_of_place, all_to_all_exchange, whole_tensor_relay, ring_batched, ring_for_four)
def test_03_6_ring_all_reduce(judged):
    good, v_half, v_nb, v_mean, v_copy, v_a2a, v_relay, v_batched, v_four = judged
    assert good
    assert v_batched.passed, v_batched.problems
    # rank 0's neighbours on a ring of 4 are 3 and 1; the all-to-all also talks to rank 2
    assert v_a2a.problems[0].startswith("an int64 tensor of shape (10,): the values are right, but "
                                        "rank 0 exchanged messages with rank(s) 2, which are not "
                                        "its neighbours 3 and 1"), v_a2a.problems
    assert "all-to-all" in v_a2a.problems[0]
    # 3 whole tensors of 10 elements; a ring sends 2(R-1) = 6 chunks of at most 3
    assert v_relay.problems[0].startswith(
        "an int64 tensor of shape (10,): the values are right, "
        "but rank 0 sent 30 elements for a tensor of 10"
    ), v_relay.problems
    assert "(at most 18 here)" in v_relay.problems[0]
    # at 3 processes, rank 2 sends to rank (2 + 1) % 4 = 3, which does not exist
    # the rule, not a guess: a constant 4 and a missing % R send rank 2's message to the same 3
    assert re.match(r"with 3 processes: rank \d raised ValueError: dist.i(send|recv) with rank 3, "
                    r"but there are 3 ranks \(0 to 2\): a ring's neighbours are \(rank \+ 1\) % R "
                    r"and \(rank - 1\) % R, with R = dist.get_world_size\(\) at line \d+",
                    v_four.problems[0]), v_four.problems
    half = v_half.problems[0]
    # rank k's input is (i+1)*10**k; after the 3 reduce-scatter steps rank 0 holds chunk 1
    # (elements 2-4) summed by all 4 ranks, chunk 3 by ranks 0 and 3, chunk 2 by 0, 2, 3
    assert half.startswith("an int64 tensor of shape (10,): rank 0 got "
                           "[1, 2, 3333, 4444, 5555, 6606, 7707, 8008, ...]")
    # notebook 03's starting point returns the tensor untouched
    assert "rank 0's tensor is unchanged after your call" in v_nb.problems[0], v_nb.problems
    # rank 0 holds the full sum only in chunk 1 after a reduce-scatter (elements 2-4 of 10)
    assert "the full sum is only in elements 2-4" in half and "all-gather phase" in half
    assert "Element 0 holds the values of rank(s) 0 only" in half
    assert "the mean" in v_mean.problems[0]
    assert "work in place" in v_copy.problems[0]


def recv_from_anyone(tensor):  # irecv without src: it takes a message from any rank
    buf = torch.empty_like(tensor)
    dist.irecv(buf).wait()
    return reference("03.6")(tensor)


def to_itself(tensor):  # (rank + 1) % R written as rank + 0
    dist.isend(tensor, dist.get_rank()).wait()
    return reference("03.6")(tensor)


@pytest.mark.slow
@judges("03.6", recv_from_anyone, to_itself)
def test_03_6_names_a_recv_from_anyone_and_a_send_to_itself(judged):
    anyone, itself = (v.problems[0] for v in judged)
    assert re.match(r"rank 0 raised ValueError: dist.irecv without src on rank 0: it receives "
                    r"from any rank, so the ring's order is left to chance. Name the previous "
                    r"rank, src=\(rank - 1\) % R \(3 here\) at line \d+", anyone), anyone
    assert "None" not in anyone and "all-to-all" not in anyone
    assert re.match(r"rank 0 raised ValueError: dist.isend on rank 0 with dst=0, its own rank: "
                    r"a rank cannot send to itself", itself), itself
    assert "Pair is not connected" not in itself


def chunked_ring(tensor):  # tensor.chunk(R) returns fewer than R chunks when numel < R
    rank, R = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).chunk(R))
    for step in range(2 * (R - 1)):
        send, recv = chunks[(rank - step) % R], chunks[(rank - step - 1) % R]
        buf = torch.empty_like(recv)
        reqs = [dist.isend(send.contiguous(), (rank + 1) % R), dist.irecv(buf, (rank - 1) % R)]
        for q in reqs:
            q.wait()
        if step < R - 1:
            recv += buf
        else:
            recv.copy_(buf)
    return tensor


@pytest.mark.slow
@judges("03.6", chunked_ring)
def test_03_6_chunking_that_breaks_below_world_size_is_reported(judged):
    (v,) = judged
    assert not v
    assert re.match(r"rank \d raised IndexError: list index out of range", v.problems[0]), (
        v.problems
    )


# ----------------------------------------------------------------------------- 04

def _fp16_hook(divide_by, group_of=lambda state: state):
    """A float16 hook for torch's DDP that divides by ``divide_by(state)`` and all-reduces over
    ``group_of(state)``: the reference is ``divide_by = group size``, ``group_of = state``."""
    def hook(state, bucket):
        buffer = bucket.buffer()
        half = buffer.to(torch.float16).div_(divide_by(state))
        fut = dist.all_reduce(half, group=group_of(state), async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return fut.then(decompress)

    return hook


def _group_size(state):
    return (state if state is not None else dist.group.WORLD).size()


no_division = _fp16_hook(lambda state: 1)
constant_two = _fp16_hook(lambda state: 2)
global_world_size = _fp16_hook(lambda state: dist.get_world_size())
default_group = _fp16_hook(_group_size, group_of=lambda state: None)


def uncompressed(state, bucket):  # torch's allreduce_hook: right average, float32 on the wire
    t = bucket.buffer().div_(_group_size(state))
    return dist.all_reduce(t, group=state, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def returns_work(state, bucket):  # BucketedDDP's old contract: a handle with .wait()
    half = bucket.buffer().to(torch.float16).div_(_group_size(state))
    return dist.all_reduce(half, group=state, async_op=True)


def returns_list(state, bucket):  # the raw future: its value is a list of tensors
    half = bucket.buffer().to(torch.float16).div_(_group_size(state))
    return dist.all_reduce(half, group=state, async_op=True).get_future()


@pytest.mark.slow
@judges("04.2", reference("04.2"), Attempt("04.2"), no_division, constant_two,
        global_world_size, default_group, uncompressed, returns_work, returns_list)
def test_04_2_fp16_comm_hook_under_torch_ddp(judged):
    good, v_nb, v_none, v_two, v_world, v_group, v_full, v_work, v_list = judged
    assert good, good.problems
    assert v_nb.problems == v_none.problems
    assert v_none.problems[0].startswith(
        "at world size 3 the gradients are 3x the average (gradients 3x too large): with a hook "
        "registered, torch's DDP does not divide by the world size -- the hook must."
    ), v_none.problems
    # R is not a constant: a hook that divides by 2 is right at 2 ranks only
    assert v_two.problems[0].startswith(
        "at world size 3 the gradients are 3/2 of the average: your hook divided the sum over "
        "the 3 ranks by 2."), v_two.problems
    # nor is it the default group's size: alone, a hook dividing by 3 gives 1/3
    assert v_world.problems[0].startswith(
        "in a process group of 1 rank (state = that group; rank 0 "
        "alone), your gradients are 1/3 of the right ones"), v_world.problems
    for v in (v_two, v_world):
        assert "state.size()" in v.problems[0]
    assert "all-reduced over the default group" in v_group.problems[0], v_group.problems
    assert v_full.problems[0].startswith("the gradients are right but not compressed: your hook "
                                         "all-reduced float32"), v_full.problems
    assert v_work.problems[0].startswith("your hook returned a Work on rank 0; torch's DDP needs "
                                         "a torch.futures.Future"), v_work.problems
    assert v_list.problems[0].startswith(
        "your hook's future completed with a list of 1 (Tensor)"
    ), v_list.problems
    assert ("checked: 3 and 2 processes (torchrun, gloo), torch's DistributedDataParallel"
            in str(good))


# ----------------------------------------------------------------------------- 07

def truncating(shard, total):  # assumes equal shards: cuts every piece to the shortest
    R = dist.get_world_size()
    n = total // R
    pieces = [torch.empty(n, dtype=shard.dtype) for _ in range(R)]
    dist.all_gather(pieces, shard[:n].contiguous())
    return torch.cat(pieces)


def reversed_order(shard, total):
    out = reference("08.4")(shard, total)
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), dist.get_world_size())]
    return torch.cat(list(reversed(torch.split(out, sizes))))


def broadcasts(shard, total):  # right values, R rounds where one all-gather is asked
    R = dist.get_world_size()
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), R)]
    pieces = []
    for src, n in enumerate(sizes):
        piece = shard.clone() if src == dist.get_rank() else torch.empty(n, dtype=shard.dtype)
        dist.broadcast(piece, src)
        pieces.append(piece)
    return torch.cat(pieces)


def three_pieces(shard, total):  # a constant 3 for the world size
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), 3)]
    padded = torch.zeros(max(sizes), dtype=shard.dtype)
    padded[:shard.numel()] = shard
    pieces = [torch.empty_like(padded) for _ in range(3)]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)])


def float_pad(shard, total):  # a float32 pad buffer whatever the shard's dtype
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), dist.get_world_size())]
    padded = torch.zeros(max(sizes))
    padded[:shard.numel()] = shard
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)])


@pytest.mark.slow
@judges("08.4", reference("08.4"), truncating, reversed_order, broadcasts, three_pieces,
        float_pad)
def test_08_4_gather_flat(judged):
    good, v_trunc, v_rev, v_bcast, v_three, v_float = judged
    assert good
    assert v_float.problems[0] == (
        "10 int64 elements in shards of 4, 3, 3: rank 0 returned the right values as float32 of "
        "shape [10]; the shards are int64, so the whole is a int64 tensor of shape [10]: make "
        "the pad buffer like the shard (torch.zeros(n, dtype=shard.dtype), or "
        "shard.new_zeros(n))."), v_float.problems
    assert v_bcast.problems[0].startswith(
        "10 elements over 3 ranks: the values are right, but rank 0 made these calls: broadcast x3."
    ), v_bcast.problems
    assert "3 broadcasts are 3 rounds" in v_bcast.problems[0]
    assert v_three.problems[0].startswith("with 2 processes: "), v_three.problems
    assert v_trunc.problems[0].startswith("10 int64 elements in shards of 4, 3, 3: rank 0 got")
    assert (
        "(9 elements instead of 10)" in v_trunc.problems[0]
        and "pad every shard" in v_trunc.problems[0]
    )
    assert "wrong order" in v_rev.problems[0]


def lonely(shard, total):
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))
    return reference("08.4")(shard, total)


@pytest.mark.slow
@judges("08.4", lonely)
def test_a_collective_only_one_rank_calls_ends_in_a_verdict_not_a_hang(judged):
    (v,) = judged
    assert not v
    # rank 0 waits in its extra all_reduce, ranks 1 and 2 in the all_gather it should have
    # joined: both places are named
    assert v.problems[0].startswith("ranks waited for peers that never answered and gave up "
                                    "after the checker's 4 s timeout: "), v.problems
    assert re.search(r"rank 0 at line \d+ \(dist.all_reduce\(torch.zeros\(1\)\)\)", v.problems[0])


def recv_first(tensor):  # every rank waits to receive before it sends: nobody sends
    rank, R = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(tensor)
    dist.recv(buf, (rank - 1) % R)
    dist.send(tensor, (rank + 1) % R)
    return tensor


@pytest.mark.slow
@judges("03.6", recv_first)
def test_a_deadlocked_exchange_ends_in_a_verdict(judged):
    (v,) = judged
    assert re.search(r"ranks? [\d, ]+ at line \d+ \(dist.recv\(buf, \(rank - 1\) % R\)\)",
                     v.problems[0]), v.problems
    assert "use isend/irecv" in v.problems[0]


def not_a_ring(tensor):
    dist.all_reduce(tensor)
    return tensor


@pytest.mark.slow
@judges("03.6", not_a_ring)
def test_03_6_a_ring_may_not_call_torchs_all_reduce(judged):
    (v,) = judged
    assert re.match(r"rank \d raised BuiltInCollectiveUsed: your ring called dist.all_reduce; "
                    r"build it from dist.isend / dist.irecv", v.problems[0]), v.problems


def rank1_leaves(grad, count):
    if dist.get_rank() == 1:
        os._exit(0)
    return reference("01.4")(grad, count)


@pytest.mark.slow
@judges("01.4", rank1_leaves, ends_launch=True)
def test_a_rank_that_exits_is_named(judged):
    (v,) = judged
    assert v.problems[0].startswith("rank(s) 1 did not finish your function: no error message: "
                                    "it was still running when the job was ended, or it left "
                                    "without one (os._exit)"), v.problems


def returns_none(grad, count):
    reference("01.4")(grad, count)


@pytest.mark.slow
@judges("01.4", returns_none)
def test_what_a_function_returns_is_checked_before_it_is_judged(judged):
    (v,) = judged
    assert re.match(r"rank \d: your function returned None \(missing return\?\); the exercise "
                    r"expects a tensor of 3 numbers\.", v.problems[0]), v.problems
    half, none = run_candidates("08.1", [lambda psi, gpu: 16 * psi / gpu, lambda psi, gpu: None])
    # 16 * 7.5e9 / 80e9 = 1.5 ranks: not a whole number
    assert half.problems[0] == ("7.5B parameters on 80 GB ranks: got 1.5 ranks; a number of ranks "
                                "is a whole number (round up: 2).")
    assert none.problems[0] == ("your function returned None (missing return?); the exercise "
                                "expects a whole number of ranks.")


def test_unsendable_globals_and_loose_ids_get_clear_answers():
    import threading

    lock = threading.Lock()

    def uses_a_lock(grad, count):
        with lock:
            return reference("01.4")(grad, count)

    uses_a_lock.__module__ = "__main__"  # as if typed into a notebook cell
    with pytest.raises(TypeError, match="cannot be sent.*inside your function"):
        check("01.4", uses_a_lock)
    assert describe(" 2.1 ").startswith("02.1")


# ----------------------------------------------------------------------------- shortcuts, local

def test_local_checkers_vary_what_a_constant_or_a_table_could_stand_in_for():
    from ddp_lesson.exercises.catalog.ex_03_3_tree_vs_ring import _CASES as _CASES_03_3
    from ddp_lesson.exercises.catalog.ex_06_4_effective_lr import _CASES as _CASES_05_4
    from ddp_lesson.exercises.catalog.ex_08_1_zero3_ranks import _CASES as _CASES_07_1

    table = {(psi, gpu): reference("08.1")(psi, gpu) for psi, gpu in _CASES_07_1[:6]}
    crossover = {R: reference("03.3")(a, b, R) for a, b, R in _CASES_03_3[:7]}
    lr_table = {c: reference("06.4")(*c) for c in _CASES_05_4[:7]}
    v_cross, v_lr = run_candidates("03.3", [lambda a, b, R: crossover.get(R, 0.0)]) + \
        run_candidates("06.4", [lambda *c: lr_table.get(c, 0.1)])
    assert not v_cross and v_cross.problems[0].startswith("R="), v_cross.problems
    assert not v_lr and v_lr.problems[0].startswith("lr "), v_lr.problems
    bitmask, node_times_two, from_table = run_candidates("00.3", [
        lambda rank, nproc: rank & (nproc - 1),  # right when nproc is a power of two
    ]) + run_candidates("07.5", [lambda node, local, nproc: node * 2 + local]) + run_candidates(
        "08.1", [lambda psi, gpu: table.get((psi, gpu), 1)])
    # 3 processes per node (the first layout that is not a power of two): 1 & 2 = 0
    assert bitmask.problems[0].startswith("rank 1 with 3 processes per node on 2 nodes: got 0, "
                                          "expected 1"), bitmask.problems
    # 2 x 4: node 1's local rank 0 is RANK 4, not 2
    assert node_times_two.problems[0] == ("2 nodes x 4 processes: node 0, local rank 2 and node 1, "
                                          "local rank 0 would share RANK 2; every process needs "
                                          "its own.")
    psi, gpu = _CASES_07_1[6]
    assert from_table.problems[0].startswith(f"{psi / 1e9:g}B parameters on {gpu / 1e9:g} GB "
                                             "ranks: "), from_table.problems


def test_local_checks_have_a_time_limit_and_show_the_learners_line(monkeypatch):
    monkeypatch.setenv("DDP_LESSON_CHECK_CASE_TIMEOUT_S", "0.5")

    def endless(num_params, gpu_bytes):
        ranks = 1
        while True:  # never leaves: the cell must not freeze
            try:
                ranks += 1
            except Exception:  # a learner's broad except does not swallow the time limit
                pass

    def as_text(rank, nproc):
        return str(rank % nproc)

    def no_return(rank, nproc):
        rank % nproc  # noqa: B018

    def library_raises(base_lr, base_batch, per_rank_batch, world_size, grad_accum_steps, rule):
        import statistics
        return statistics.mean([])

    v_loop, = run_candidates("08.1", [endless])
    v_text, v_none = run_candidates("00.3", [as_text, no_return])
    v_lib, = run_candidates("06.4", [library_raises])
    assert v_loop.problems[0].startswith("case (70B, 80 GB) did not return within 0.5 s"), (
        v_loop.problems
    )
    # a string is shown as one: '0', not 0
    assert v_text.problems[0] == ("your function returned '0' (str); the exercise expects a whole "
                                  "number (the GPU index).")
    assert v_none.problems[0] == ("your function returned None (missing return?); the exercise "
                                  "expects a whole number (the GPU index).")
    assert v_lib.problems[0].startswith("your function raised StatisticsError: mean requires at "
                                        "least one data point at line "), v_lib.problems
    assert v_lib.problems[0].endswith("(return statistics.mean([]))")


def too_small_buffer(tensor):  # receives the whole tensor into a one-element buffer
    rank, R = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(1, dtype=tensor.dtype)
    reqs = [dist.isend(tensor.reshape(-1).contiguous(), (rank + 1) % R),
            dist.irecv(buf, (rank - 1) % R)]
    for q in reqs:
        q.wait()
    return tensor


@pytest.mark.slow
@judges("03.6", too_small_buffer, ends_launch=True)
def test_a_size_mismatch_on_the_wire_is_named_as_such(judged):
    (v,) = judged
    # the first case is 10 int64 elements: 80 bytes into a buffer of 8
    assert re.match(r"size mismatch on the wire: rank \d received a message of 80 bytes into a "
                    r"buffer of 8 bytes", v.problems[0]), v.problems



def test_a_launch_blames_only_the_candidate_it_stopped_in(monkeypatch):
    """What a launch left as a whole (stderr, its wall clock) speaks about the candidate it
    stopped in, never about one it survived: a torchrun stand-in writes what the workers
    would after candidate 0 timed out on every rank (the launch went on) and candidate 1 lost
    rank 1, whose stderr holds lines from candidate 0."""
    import pickle
    from types import SimpleNamespace

    from ddp_lesson import launch
    from ddp_lesson.exercises import core

    waited = {"error": "DistBackendError", "where": "line 3 (dist.all_gather(pieces, shard))",
              "message": "Timed out waiting 4000ms for recv operation to complete"}
    mark = core.CANDIDATE_MARK.format
    launches, how = [], {}

    def stand_in(target, *, args, nproc_per_node, timeout, **kwargs):
        launches.append((nproc_per_node, timeout))
        for r in range(3):  # every rank came back from candidate 0; rank 1 not from 1
            records = [{3: waited}] + ([{3: waited}] if r != 1 and not how.get("unrecorded")
                                       else [])
            (Path(args[1]) / f"result{r}.pkl").write_bytes(pickle.dumps(records))
        rank1 = f"{mark(0)}\n[E ProcessGroupGloo.cpp:67] Connection closed by peer\n{mark(1)}\n"
        if how.get("last_words"):
            rank1 += how["last_words"] + "\n"
        if how.get("timed_out"):
            raise launch.TorchrunTimeout("torchrun", timeout,
                                         SimpleNamespace(stdout="", launcher_stderr=""))
        return SimpleNamespace(errors={0: f"{mark(0)}\n{mark(1)}\n", 1: rank1, 2: ""})

    monkeypatch.setattr(launch, "run_torchrun", stand_in)
    candidates = [(get("08.4"), reference("08.4")) for _ in range(3)]
    done, problems = core._launch(candidates)
    # candidate 2 never started: it is left to a fresh launch. One launch of 3 processes that
    # allows 90 s, and 2 world sizes x (2 x 4 s timeout + 5 s) for each further candidate
    assert done == 2 and launches == [(3, 90 + 2 * 2 * (2 * 4 + 5))]
    assert problems[0][0].startswith("ranks waited for peers that never answered and gave up "
                                     "after the checker's 4 s timeout: ranks 0, 1, 2 at line 3 "
                                     "(dist.all_gather(pieces, shard))"), problems[0]
    # rank 1's line from candidate 0 is not taken for its last words in candidate 1
    assert problems[1][0].startswith("rank(s) 1 did not finish your function: no error message: "
                                     "it was still running when the job was ended"), problems[1]
    how["last_words"] = "RuntimeError: rank 1 gave up"
    done, problems = core._launch(candidates)
    assert problems[1][0].startswith("rank(s) 1 did not finish your function: its last words: "
                                     "RuntimeError: rank 1 gave up."), problems[1]
    # gloo aborted rank 1 in candidate 1: that is candidate 1's size mismatch, not 0's
    how["last_words"] = "terminate called: [enforce fail at pair.cc:446] op.preamble.length <= "\
                        "op.nbytes. 80 vs 8"
    done, problems = core._launch(candidates)
    assert problems[0][0].startswith("ranks waited for peers"), problems[0]
    assert problems[1][0].startswith("size mismatch on the wire: rank 1 received a message of 80 "
                                     "bytes into a buffer of 8 bytes"), problems[1]
    # the same abort before any rank recorded candidate 1 (seen in a suite run): the marks say
    # the launch began candidate 1, so the mismatch is still 1's and 0 keeps its own verdict
    how["unrecorded"] = True
    done, problems = core._launch(candidates)
    assert done == 2 and problems[0][0].startswith("ranks waited for peers"), problems[0]
    assert problems[1][0].startswith("size mismatch on the wire: rank 1 received a message of 80 "
                                     "bytes into a buffer of 8 bytes"), problems[1]
    how["unrecorded"] = False
    how["timed_out"] = True  # the wall clock ended the launch in candidate 1, not in 0
    done, problems = core._launch(candidates)
    assert done == 2 and problems[0][0].startswith("ranks waited for peers"), problems[0]
    assert problems[1][0].startswith("rank(s) 1 did not finish your function: still running."), (
        problems[1]
    )
