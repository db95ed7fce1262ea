"""docs/pitfalls.md B1, B2, B4, B5, B7, B8, B12 on 2 real processes, for the cores (NaiveDDP,
BucketedDDP of ddp_lesson/core/) and torch's DDP.

One torchrun launch (gloo, 2 ranks). Every rank runs every scenario and prints one JSON
line; the tests compare with the literal values stated in docs/pitfalls.md, with
torch's own DistributedDataParallel, or with a plain single-process computation.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from ddp_lesson.launch import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

WRAPPERS = ("NaiveDDP", "BucketedDDP", "torch")

WORKER = textwrap.dedent("""
    import json, warnings, torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from ddp_lesson.env import init_distributed, cleanup
    from ddp_lesson.core.bucketed_ddp import BucketedDDP
    from ddp_lesson.core.naive_ddp import NaiveDDP
    from ddp_lesson.labs.ddp_toys import TwoLayer, IN_FEATURES
    from ddp_lesson.labs import ddp_pitfalls as lab

    env = init_distributed(timeout=30)
    rank = env.rank
    classes = {"NaiveDDP": NaiveDDP, "BucketedDDP": BucketedDDP, "torch": DistributedDataParallel}

    def listify(kind, value):
        if kind == "error":
            return [kind, value]
        return [kind, {n: None if g is None else g.tolist() for n, g in value.items()}]

    res = {}
    for name, cls in classes.items():
        r = res[name] = {}
        for order in ("correct", "buggy", "backward-only"):
            r["B4 " + order] = lab.no_sync_accumulation(cls, order)
        if name != "torch":  # torch's DDP hangs or fails an iteration later here
            r["B1 off, unused everywhere"] = listify(*lab.unused_parameters(cls, False, ()))
            r["B1 off, b on rank 0"] = listify(*lab.unused_parameters(cls, False, (0,)))
        r["B1 on, b on rank 0"] = listify(*lab.unused_parameters(cls, True, (0,)))
        r["B1 on, unused everywhere"] = listify(*lab.unused_parameters(cls, True, ()))
        # B2: nothing unused; flag on vs off, one step each from the same start
        grads, warned = {}, {}
        for flag in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kind, g = lab.unused_parameters(cls, flag, (0, 1), iterations=2)
            grads[flag] = g
            warned[flag] = sum("find_unused_parameters" in str(w.message) for w in caught)
        r["B2 identical"] = all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False])
        r["B2 warnings"] = [warned[False], warned[True]]
        r["B5"] = lab.loss_reduction(cls)
        r["B8"] = lab.broadcast_at_construction(cls)
        r["B12 keys"] = list(cls(nn.Linear(2, 1)).state_dict().keys())
        # B7: R=2 ranks x B=2 samples, one SGD step == one process on the B=4 global batch
        torch.manual_seed(0)
        model = nn.Linear(IN_FEATURES, 3)
        single = nn.Linear(IN_FEATURES, 3)
        single.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(42)
        x, y = torch.randn(4, IN_FEATURES, generator=g), torch.randn(4, 3, generator=g)
        ddp = cls(model)
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        nn.functional.mse_loss(ddp(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        opt.step()
        opt1 = torch.optim.SGD(single.parameters(), lr=0.1)
        nn.functional.mse_loss(single(x), y).backward()
        opt1.step()
        r["B7 max diff"] = max(float((a - b).abs().max())
                               for a, b in zip(model.parameters(), single.parameters()))
        # the plain local gradient of b on this rank (for B1's g/2), no wrapper involved
        torch.manual_seed(0)
        plain = TwoLayer()
        plain(torch.full((2, IN_FEATURES), float(rank + 1)), use_b=True).sum().backward()
        r["local b grad"] = [plain.b.weight.grad.tolist(), plain.b.bias.grad.tolist()]
    # an explicit process group (a new group of both ranks) instead of the default one
    group = dist.new_group([0, 1])
    for name in ("NaiveDDP", "BucketedDDP"):
        m = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            m.weight.fill_(1.0)
        w = classes[name](m, process_group=group)
        (w((torch.tensor([1.0, 2.0]) + 2.0 * rank)[:, None]) ** 2).mean().backward()
        res[name]["B5 mean, explicit group"] = float(m.weight.grad)
    print(json.dumps(res))
    del ddp
    import gc; gc.collect()  # free torch DDP (and its process group) before exit
    cleanup()
""")


@pytest.fixture(scope="module")
def results():
    out = run_torchrun(code=WORKER, nproc_per_node=2, timeout=120, live=False, backend="gloo")
    return [json.loads(out.rank_lines(r)[-1]) for r in range(2)]


def test_b4_no_sync_syncs_on_the_last_micro_batch(results):
    for name in WRAPPERS:
        correct = [results[r][name]["B4 correct"] for r in range(2)]
        buggy = [results[r][name]["B4 buggy"] for r in range(2)]
        assert [g for g, _ in correct] == [5.5, 5.5], name
        assert [g for g, _ in buggy] == [4.0, 7.0], name
        if name != "torch":
            assert [s for _, s in correct] == [1, 1], name


def test_b4_no_sync_around_backward_only_still_syncs_like_torch(results):
    # The forward decides (torch's rule). The accumulated sum is still right (averaging is
    # linear), but micro-batch 0 was all-reduced for nothing: 2 synchronised backwards.
    for name in WRAPPERS:
        got = [results[r][name]["B4 backward-only"] for r in range(2)]
        assert [g for g, _ in got] == [5.5, 5.5], name
        if name != "torch":
            assert [s for _, s in got] == [2, 2], name


def test_b1_the_cores_need_no_flag_a_missing_gradient_is_sent_as_zeros(results):
    # the cores send zeros for a gradient that did not come: with or without the flag, the
    # same numbers as torch's DDP with it; unused everywhere, .grad is zeros (torch: None)
    for name in ("NaiveDDP", "BucketedDDP"):
        for r in range(2):
            assert results[r][name]["B1 off, b on rank 0"] == \
                results[r][name]["B1 on, b on rank 0"] == \
                results[r]["torch"]["B1 on, b on rank 0"], (name, r)
            kind, grads = results[r][name]["B1 off, unused everywhere"]
            assert kind == "grads", (name, r)
            assert grads["b.weight"] == [[0.0] * 4] * 4 and grads["b.bias"] == [0.0] * 4


def test_b1_with_the_flag_a_grad_from_one_rank_is_halved_on_both(results):
    g0_weight, g0_bias = results[0]["torch"]["local b grad"]  # rank 0's plain local grad
    # x = ones(2, 4) on rank 0: d sum(b(x)) / d b.weight = 2 per entry; averaged with 0 -> 1.0
    assert g0_weight[0][0] == 2.0
    assert results[1]["BucketedDDP"]["B1 on, b on rank 0"][1]["b.weight"][0][0] == 1.0
    for name in WRAPPERS:
        for r in range(2):
            kind, grads = results[r][name]["B1 on, b on rank 0"]
            assert kind == "grads", (name, r)
            assert grads["b.weight"] == [[v / 2 for v in row] for row in g0_weight], (name, r)
            assert grads["b.bias"] == [v / 2 for v in g0_bias], (name, r)
            assert grads["a.weight"] == results[r]["torch"]["B1 on, b on rank 0"][1]["a.weight"]


def test_b1_with_the_flag_a_parameter_unused_everywhere_keeps_grad_none(results):
    for name in WRAPPERS:
        for r in range(2):
            kind, grads = results[r][name]["B1 on, unused everywhere"]
            assert kind == "grads"
            if name == "torch":
                assert grads["b.weight"] is None and grads["b.bias"] is None, r
            else:  # the cores: zeros from every rank, averaged
                assert grads["b.bias"] == [0.0] * 4, (name, r)
            assert (
                grads["a.weight"] == results[r]["torch"]["B1 on, unused everywhere"][1]["a.weight"]
            )


def test_b2_flag_on_with_nothing_unused_same_numbers(results):
    # the cores ignore the flag (no walk, no warning); torch's DDP gives the same numbers
    for name in ("NaiveDDP", "BucketedDDP"):
        for r in range(2):
            assert results[r][name]["B2 identical"] is True, (name, r)
            assert results[r][name]["B2 warnings"] == [0, 0], (name, r)
    for r in range(2):
        assert results[r]["torch"]["B2 identical"] is True


def test_b5_mean_matches_one_process_sum_is_off_by_r(results):
    # one process on x=[1,2,3,4]: mean-loss grad 2*mean(x^2) = 15, sum-loss grad 60
    for name in WRAPPERS:
        for r in range(2):
            assert results[r][name]["B5"] == {"mean": 15.0, "sum": 30.0, "mean*R": 30.0}


def test_an_explicit_process_group_works_like_the_default_one(results):
    for name in ("NaiveDDP", "BucketedDDP"):
        assert [results[r][name]["B5 mean, explicit group"] for r in range(2)] == [15.0, 15.0]


def test_b7_two_ranks_of_two_equal_one_process_of_four(results):
    for name in WRAPPERS:
        for r in range(2):
            assert results[r][name]["B7 max diff"] < 1e-6, (name, r)


def test_b8_different_initial_weights_become_rank0s(results):
    for name in WRAPPERS:
        for r in range(2):
            assert results[r][name]["B8"] == [0.0, True], (name, r)


def test_b12_state_dict_keys_carry_the_module_prefix(results):
    for name in WRAPPERS:
        assert results[0][name]["B12 keys"] == ["module.weight", "module.bias"], name
