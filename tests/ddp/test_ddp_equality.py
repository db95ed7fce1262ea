"""NaiveDDP and BucketedDDP train exactly like torch's DDP and like one process on the global batch.

One torchrun launch per world size (2 and 3, gloo). In it every rank trains, from the same seed
and data, with torch's ``DistributedDataParallel``, and with both the teaching cores
(``ddp_lesson.core.naive_ddp.NaiveDDP``, ``ddp_lesson.core.bucketed_ddp.BucketedDDP``), the
bucketed one with caps that force 1, 2 and one-bucket-per-parameter, on four toy models (a
frozen layer, a tied weight, an unused branch with ``find_unused_parameters=True`` for torch,
zeros sent by the cores, a BatchNorm buffer) for 10 SGD-with-momentum steps, and on the DeepLab-
style model for 3 steps; plus gradient accumulation over 4 micro-batches with ``no_sync``. Each
rank saves its final parameters and its bucket counts, next to torch's bucket counts for the
same caps; this process recomputes everything on one process and compares.

The single-process baseline: mean cross-entropy over the global batch. With BatchNorm, a
data-parallel forward normalises each rank's slice with that slice's statistics, and the
running statistics are rank 0's (broadcast before each forward), so the baseline runs one
forward per slice and keeps the running statistics of slice 0: the same computation, done
by one process.
"""
from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import torch.nn.functional as F

from ddp_lesson.labs.ddp_toys import TOYS, shard, toy_batch
from ddp_lesson.launch import run_torchrun
from ddp_lesson.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

STEPS, PER_RANK, LR, MOMENTUM = 10, 2, 0.1, 0.9
DEEPLAB_STEPS, DEEPLAB_SIZE, DEEPLAB_WIDTH = 3, (32, 48), 8
ACC_STEPS, ACC_MICRO = 3, 4
RTOL, ATOL = 1e-5, 1e-6
CORES = ("core-naive", "core-bucketed-1", "core-bucketed-2", "core-bucketed-many")
VARIANTS = ("torch", *CORES)
NO_SYNC_VARIANTS = ("torch", "core-naive", "core-bucketed-2")
CAPS = ("bucketed-1", "bucketed-2", "bucketed-many")

WORKER = textwrap.dedent(f"""
    import sys, torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_lesson.env import init_distributed, cleanup
    from ddp_lesson.core import naive_ddp, bucketed_ddp
    from ddp_lesson.core.buckets import MB
    from ddp_lesson.labs.ddp_toys import TOYS, toy_batch, shard
    from ddp_lesson.models import build_model

    env = init_distributed(timeout=60)
    R, rank = env.world_size, env.rank

    def cap_of(variant, model):
        sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
        return {{"bucketed-1": 25, "bucketed-many": 0,
                # every parameter but the first-registered one fills bucket 0 exactly
                "bucketed-2": (sum(sizes) - sizes[0]) / MB}}[variant]

    def wrap(variant, model, unused):
        if variant == "torch":
            return DDP(model, find_unused_parameters=unused)
        if variant == "core-naive":  # the cores have no find_unused_parameters: zeros instead
            return naive_ddp.NaiveDDP(model)
        return bucketed_ddp.BucketedDDP(model, bucket_cap_mb=cap_of(variant[5:], model))

    def torch_buckets(make, batch, variant):
        # torch's Reducer rebuilds its buckets with the cap after the first iteration (not
        # with find_unused_parameters); its logger reports them from the third iteration on
        torch.manual_seed(0)
        model = make()
        ddp = DDP(model, bucket_cap_mb=cap_of(variant, model))
        for step in range(3):
            x, y = batch(step)
            F.cross_entropy(ddp(shard(x, rank, R)), shard(y, rank, R)).backward()
        sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes")
        del ddp
        if sizes is None:
            raise RuntimeError("torch reported no rebuilt buckets after 3 iterations")
        return len(str(sizes).split(","))

    def train(make, batch, steps, variant, unused, micro=1):
        torch.manual_seed(0)
        model = make()
        ddp = wrap(variant, model, unused)
        opt = torch.optim.SGD(model.parameters(), lr={LR}, momentum={MOMENTUM})
        for step in range(steps):
            opt.zero_grad()
            for m in range(micro):
                x, y = batch(step * micro + m)
                x, y = shard(x, rank, R), shard(y, rank, R)
                last = m == micro - 1
                ctx = ddp.no_sync() if not last else torch.enable_grad()
                with ctx:
                    loss = F.cross_entropy(ddp(x), y) / micro
                    loss.backward()
            opt.step()
        buckets = len(ddp.bucket_indices) if hasattr(ddp, "bucket_indices") else None
        return {{"params": {{n: p.detach().clone() for n, p in model.named_parameters()}},
                "buffers": {{n: b.clone() for n, b in model.named_buffers()}},
                "buckets": buckets}}

    out = {{}}
    for name, (cls, unused) in TOYS.items():
        for v in {VARIANTS!r}:
            out[(name, v)] = train(cls, lambda s: toy_batch(s, {PER_RANK} * R), {STEPS}, v, unused)
        if not unused:
            for v in {CAPS!r}:
                out[(name, "torch-buckets", v)] = torch_buckets(
                    cls, lambda s: toy_batch(s, {PER_RANK} * R), v)
    H, W = {DEEPLAB_SIZE!r}
    def seg_batch(step):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(R, 3, H, W, generator=g), torch.randint(0, 19, (R, H, W), generator=g)
    for v in {VARIANTS!r}:
        out[("deeplab", v)] = train(lambda: build_model("deeplab", width={DEEPLAB_WIDTH}),
                                    seg_batch, {DEEPLAB_STEPS}, v, False)
    for v in {NO_SYNC_VARIANTS!r}:
        out[("no_sync", v)] = train(TOYS["tied"][0], lambda s: toy_batch(s, {PER_RANK} * R, seed=7),
                                    {ACC_STEPS}, v, False, micro={ACC_MICRO})
    torch.save(out, f"{{sys.argv[1]}}/rank{{rank}}.pt")
    print("saved", len(out), "runs")
    import gc; gc.collect()  # free torch DDP (and its process group) before exit
    cleanup()
""")


def _single_process(make, batch, steps, world_size, micro=1):
    """One process, global batch; BatchNorm per rank slice with rank 0's running stats."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = dict(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for m in range(micro):
            x, y = batch(step * micro + m)
            buffers = dict(model.named_buffers())
            if not buffers:
                losses.append(F.cross_entropy(model(x), y))
                continue
            rank0 = None
            for r in range(world_size):
                # each slice is normalised with its own statistics, from the same running stats
                mine = {n: b.clone() for n, b in buffers.items()}
                out = functional_call(model, {**params, **mine}, (shard(x, r, world_size),))
                losses.append(F.cross_entropy(out, shard(y, r, world_size)) / world_size)
                rank0 = mine if r == 0 else rank0
            with torch.no_grad():
                for n, b in buffers.items():
                    b.copy_(rank0[n])
        (sum(losses) / micro).backward()
        opt.step()
    return {"params": {n: p.detach() for n, p in model.named_parameters()},
            "buffers": {n: b for n, b in model.named_buffers()}}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(request, tmp_path_factory):
    world_size = request.param
    out = tmp_path_factory.mktemp(f"ddp_eq{world_size}")
    result = run_torchrun(code=WORKER, args=[str(out)], nproc_per_node=world_size,
                          timeout=120, live=False, backend="gloo")
    assert result.rank_lines(0)[-1].startswith("saved")
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    return world_size, per_rank


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{what}, {n}: {m}")


def _cases(world_size):
    for name, (cls, _) in TOYS.items():
        yield name, cls, (lambda s, R=world_size: toy_batch(s, PER_RANK * R)), STEPS

    H, W = DEEPLAB_SIZE

    def seg_batch(step, R=world_size):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(R, 3, H, W, generator=g), torch.randint(0, 19, (R, H, W), generator=g)

    yield "deeplab", (lambda: build_model("deeplab", width=DEEPLAB_WIDTH)), seg_batch, DEEPLAB_STEPS


def test_every_wrapper_matches_torch_ddp_and_one_process(runs):
    world_size, per_rank = runs
    for name, make, batch, steps in _cases(world_size):
        ref = _single_process(make, batch, steps, world_size)
        for v in VARIANTS:
            run0 = per_rank[0][(name, v)]
            _close(run0["params"], ref["params"], f"{name}/{v} vs one process (R={world_size})")
            _close(run0["params"], per_rank[0][(name, "torch")]["params"],
                   f"{name}/{v} vs torch DDP (R={world_size})")
            # rank 0's running statistics are the ones every forward starts from
            _close(run0["buffers"], ref["buffers"], f"{name}/{v} buffers (R={world_size})")
            for r in range(1, world_size):  # every rank holds the very same weights
                for pname, p in per_rank[r][(name, v)]["params"].items():
                    assert torch.equal(p, run0["params"][pname]), (name, v, r, pname)


def test_bucket_caps_force_one_two_and_many_buckets(runs):
    _, per_rank = runs
    for name, (cls, _) in TOYS.items():
        trainable = sum(p.requires_grad for p in cls().parameters())
        got = {v: per_rank[0][(name, v)]["buckets"] for v in VARIANTS}
        assert got == {"torch": None, "core-naive": None, "core-bucketed-1": 1,
                       "core-bucketed-2": 2, "core-bucketed-many": trainable}, name


def test_core_bucket_counts_equal_torch_for_the_same_cap(runs):
    _, per_rank = runs
    for name, (_, unused) in TOYS.items():
        if unused:  # torch does not rebuild its buckets with find_unused_parameters
            continue
        for v in CAPS:
            theirs = per_rank[0][(name, "torch-buckets", v)]
            assert per_rank[0][(name, f"core-{v}")]["buckets"] == theirs, (name, v)


def test_frozen_param_untouched_and_unused_branch_keeps_its_init(runs):
    _, per_rank = runs
    torch.manual_seed(0)
    frozen_init = copy.deepcopy(TOYS["frozen"][0]().frozen.state_dict())
    torch.manual_seed(0)
    aux_init = copy.deepcopy(TOYS["unused"][0]().aux.state_dict())
    for v in VARIANTS:
        p = per_rank[0][("frozen", v)]["params"]
        assert torch.equal(p["frozen.weight"], frozen_init["weight"]), v
        p = per_rank[0][("unused", v)]["params"]
        assert torch.equal(p["aux.weight"], aux_init["weight"]), v


def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch(runs):
    world_size, per_rank = runs
    ref = _single_process(TOYS["tied"][0],
                          lambda s: toy_batch(s, PER_RANK * world_size, seed=7),
                          ACC_STEPS, world_size, micro=ACC_MICRO)
    for v in NO_SYNC_VARIANTS:
        _close(per_rank[0][("no_sync", v)]["params"], ref["params"], f"no_sync/{v}")
        for r in range(1, world_size):
            for pname, p in per_rank[r][("no_sync", v)]["params"].items():
                assert torch.equal(p, per_rank[0][("no_sync", v)]["params"][pname]), (v, r)
