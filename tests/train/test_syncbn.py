"""SyncBatchNorm from scratch (ddp_lesson.syncbn) against plain BatchNorm on the concatenated batch.

One torchrun launch per world size (2 and 3, with unequal per-rank batches): every rank
checks its slice against nn.BatchNorm2d run on the whole batch in the same process (outputs,
running mean/var, input and weight gradients), and the 2-rank launch also checks the exact
numbers of docs/pitfalls.md B11 and one DDP training step of a converted model.
"""
import json
import math

import pytest
import torch
from torch import nn

from ddp_lesson.launch import run_torchrun
from ddp_lesson.models import build_model
from ddp_lesson.syncbn import SyncBatchNorm, convert_sync_batchnorm, count_batchnorm

pytestmark = pytest.mark.timeout(240)

# Runs on every rank; prints one JSON line of results.
CHECK = r"""
import copy, json, sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson.syncbn import SyncBatchNorm, convert_sync_batchnorm
from ddp_lesson.models import build_model

env = init_distributed(timeout=60, announce=False)
R, r = env.world_size, env.rank
out = {}

def err(a, b):
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0

# -- docs/pitfalls.md B11: 2 ranks, 1 channel, [1, 2] and [3, 4]
if R == 2:
    x = torch.tensor([[1.0], [2.0]]) if r == 0 else torch.tensor([[3.0], [4.0]])
    sbn = SyncBatchNorm(1, eps=1e-5, momentum=0.1).train()
    y = sbn(x)
    plain = nn.BatchNorm1d(1, eps=1e-5, momentum=0.1).train()
    yp = plain(x)
    out["b11"] = {"y": y.flatten().tolist(), "running_mean": sbn.running_mean.item(),
                  "running_var": sbn.running_var.item(),
                  "plain_y": yp.flatten().tolist(), "plain_running_mean": plain.running_mean.item(),
                  "plain_running_var": plain.running_var.item()}

# -- unequal per-rank batches vs nn.BatchNorm2d on the concatenated batch (same process)
sizes = [int(s) for s in sys.argv[1].split(",")]
g = torch.Generator().manual_seed(0)
full = torch.randn(sum(sizes), 4, 5, 3, generator=g) * 3 + 1.5
gy = torch.randn(full.shape, generator=g)
gy2 = torch.randn(full.shape, generator=g)
weight, bias = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
ref = nn.BatchNorm2d(4)
sbn = SyncBatchNorm(4)
with torch.no_grad():
    for m in (ref, sbn):
        m.weight.copy_(weight); m.bias.copy_(bias)
mine = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
res = {}
for step, grad in enumerate((gy, gy2)):  # two steps: running stats accumulate
    xr = full.clone().requires_grad_()
    yr = ref(xr)
    (yr * grad).sum().backward()
    xs = full[mine].clone().requires_grad_()
    ys = sbn(xs)
    (ys * grad[mine]).sum().backward()
    # weight/bias grads are local contributions; summed over ranks they are the whole grad
    gw, gb = sbn.weight.grad.clone(), sbn.bias.grad.clone()
    dist.all_reduce(gw); dist.all_reduce(gb)
    res[f"step{step}"] = {
        "y": err(ys, yr[mine]), "grad_x": err(xs.grad, xr.grad[mine]),
        "grad_weight": err(gw, ref.weight.grad), "grad_bias": err(gb, ref.bias.grad),
        "running_mean": err(sbn.running_mean, ref.running_mean),
        "running_var": err(sbn.running_var, ref.running_var),
        "tracked": [int(sbn.num_batches_tracked), int(ref.num_batches_tracked)],
        "scale": float(xr.grad.abs().max()),
    }
    for m in (ref, sbn):
        m.weight.grad = None; m.bias.grad = None
sbn.eval(); ref.eval()
res["eval_y"] = err(sbn(full[mine]), ref(full[mine]))  # running stats, no communication
out["unequal"] = res

# -- bf16: fp32 parameters with a bf16 input (what a bf16 conv feeds BN under autocast):
#    torch's dtype out, values within one bf16 step of nn.BatchNorm2d on the global batch
b16, ref16 = SyncBatchNorm(4), nn.BatchNorm2d(4)
with torch.no_grad():
    for m in (b16, ref16):
        m.weight.copy_(weight); m.bias.copy_(bias)
xb = full[mine].bfloat16().requires_grad_()
yb = b16(xb)
(yb.float() * gy[mine]).sum().backward()
yr16 = ref16(full.bfloat16())[mine]
with torch.autocast("cpu", dtype=torch.bfloat16):
    conv = nn.Conv2d(4, 4, 1)
    ya, yra = b16(conv(full[mine])), ref16(conv(full))[mine]
    yf, yrf = b16(full[mine]), ref16(full)[mine]  # a float32 input stays float32
out["bf16"] = {
    "dtype": [str(yb.dtype), str(yr16.dtype)], "autocast": [str(ya.dtype), str(yra.dtype)],
    "autocast_fp32_in": [str(yf.dtype), str(yrf.dtype)],
    "grads": [str(xb.grad.dtype), str(b16.weight.grad.dtype), str(b16.bias.grad.dtype)],
    "y": err(yb.float(), yr16.float()), "max_abs": float(yr16.float().abs().max()),
}

# -- a rank with an empty batch still takes part (3 ranks: sizes 0, 3, 2)
if R == 3:
    sizes0 = [0, 3, 2]
    part = slice(sum(sizes0[:r]), sum(sizes0[:r + 1]))
    x0 = full[:5].clone()
    ref0 = nn.BatchNorm2d(4)
    yr0 = ref0(x0)
    s0 = SyncBatchNorm(4)
    xs0 = x0[part].clone().requires_grad_()
    ys0 = s0(xs0)
    ys0.sum().backward()
    out["empty_rank"] = {"y": err(ys0, yr0[part]),
                         "running_mean": err(s0.running_mean, ref0.running_mean)}

# -- converter + DDP: one SGD step of a converted model on 2 images per rank equals one step
#    of the plain model on the concatenated batch (global mean loss over labelled pixels)
torch.manual_seed(1)
plain_model = build_model("tiny", num_classes=5, width=4)
model = convert_sync_batchnorm(copy.deepcopy(plain_model))
ddp = torch.nn.parallel.DistributedDataParallel(model)
g = torch.Generator().manual_seed(2)
images = torch.randn(2 * R, 3, 16, 24, generator=g)
target = torch.randint(0, 5, (2 * R, 16, 24), generator=g)
target[:, :3] = 255  # some void pixels
from ddp_lesson.train import train_step
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
train_step(ddp, opt, [(images[2 * r:2 * r + 2], target[2 * r:2 * r + 2])], R)
ref_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
loss = F.cross_entropy(plain_model(images), target, ignore_index=255)
loss.backward(); ref_opt.step()
ps = dict(model.named_parameters()); bs = dict(model.named_buffers())
out["ddp_step"] = {
    "params": max(err(ps[n], p) for n, p in plain_model.named_parameters()),
    "buffers": max(err(bs[n].float(), b.float()) for n, b in plain_model.named_buffers()),
}
# -- torch's rule for when to synchronise (nn.SyncBatchNorm.forward, need_sync): the four
#    combinations of train/eval x track_running_stats, momentum 0.1 and None; collectives
#    counted. torch's own SyncBatchNorm runs on CPU where it does not synchronise (eval).
calls = {"n": 0}
_all_reduce = dist.all_reduce
def counting_all_reduce(*a, **k):
    calls["n"] += 1
    return _all_reduce(*a, **k)
dist.all_reduce = counting_all_reduce
modes = {}
for training in (True, False):
    for track in (True, False):
        for momentum in (0.1, None):
            kw = dict(momentum=momentum, track_running_stats=track)
            ours, ref = SyncBatchNorm(4, **kw), nn.BatchNorm2d(4, **kw)
            theirs = nn.SyncBatchNorm(4, **kw)
            for m in (ours, ref, theirs):
                m.train(training)
                with torch.no_grad():
                    m.weight.copy_(weight); m.bias.copy_(bias)
                    if track:  # eval with running stats reads them: make them non-trivial
                        m.running_mean.copy_(bias); m.running_var.copy_(weight)
            res = {}
            for step in range(2):  # momentum=None: a cumulative average over two steps
                calls["n"] = 0
                y = ours(full[mine])
                res[f"collectives{step}"] = calls["n"]
                # training: the global batch is the concatenated one; eval: the local batch
                yr = ref(full)[mine] if training else ref(full[mine])
                res[f"y{step}"] = err(y, yr)
                if not training:
                    yt = theirs(full[mine])
                    res[f"torch{step}"] = err(y, yt)
                    res[f"torch_collectives{step}"] = calls["n"] - res[f"collectives{step}"]
            if track:
                res["running"] = max(err(ours.running_mean, ref.running_mean),
                                     err(ours.running_var, ref.running_var))
                res["tracked"] = [int(ours.num_batches_tracked), int(ref.num_batches_tracked)]
            if training:
                try:
                    theirs(full[mine]); res["torch_train"] = "ran"
                except ValueError as e:
                    res["torch_train"] = str(e)
            modes[f"training={training} track={track} momentum={momentum}"] = res
out["modes"] = modes
# one more eval batch on rank 0 than on the others: eval never communicates, so no rank waits
extra = SyncBatchNorm(4, track_running_stats=False).eval()
calls["n"] = 0
for _ in range(2 + (r == 0)):
    extra(full[mine])
out["uneven_eval"] = calls["n"]
dist.all_reduce = _all_reduce
print(json.dumps(out))
import gc
gc.collect()  # free DDP wrappers (reference cycles) before the process group goes
cleanup()
"""


def _launch(tmp_path, nproc, sizes):
    script = tmp_path / "syncbn_check.py"
    script.write_text(CHECK)
    result = run_torchrun(str(script), [",".join(map(str, sizes))], nproc_per_node=nproc,
                          timeout=120, live=False, backend="gloo", cwd=tmp_path)
    return {r: json.loads(result.rank_lines(r)[-1]) for r in range(nproc)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("sbn2"), 2, [2, 3])


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("sbn3"), 3, [1, 4, 2])


@pytest.mark.slow
def test_b11_exact_values(two_ranks):
    """docs/pitfalls.md B11: global mean 2.5, biased var 1.25; running stats 0.25 and 1.06667."""
    expected_y = {0: [-1.3416, -0.4472], 1: [0.4472, 1.3416]}
    for rank in (0, 1):
        b11 = two_ranks[rank]["b11"]
        assert b11["y"] == pytest.approx(expected_y[rank], abs=1e-4)
        assert b11["running_mean"] == pytest.approx(0.25, abs=1e-6)
        assert b11["running_var"] == pytest.approx(1.06667, abs=1e-5)
        # plain per-rank BatchNorm: about [-1, 1] on each rank, stats that differ by rank
        assert b11["plain_y"] == pytest.approx([-1.0, 1.0], abs=1e-4)
        assert b11["plain_running_mean"] == pytest.approx({0: 0.15, 1: 0.35}[rank], abs=1e-6)
        assert b11["plain_running_var"] == pytest.approx(0.95, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "three"])
def test_unequal_batches_match_batchnorm_on_the_concatenated_batch(world, two_ranks,
                                                                   three_ranks):
    results = two_ranks if world == "two" else three_ranks
    for rank, out in results.items():
        for step in ("step0", "step1"):
            res = out["unequal"][step]
            tol = 1e-5 * max(1.0, res["scale"])
            for key in ("y", "grad_x", "grad_weight", "grad_bias", "running_mean",
                        "running_var"):
                assert res[key] < 1e-4 if key.startswith("grad_w") else res[key] < tol, \
                    (world, rank, step, key, res[key])
        assert out["unequal"]["step1"]["tracked"] == [2, 2]
        assert out["unequal"]["eval_y"] < 1e-5


@pytest.mark.slow
def test_bf16_input_keeps_torchs_dtype(two_ranks):
    """fp32 parameters with a bf16 input, and under autocast (the ``--sync-bn --amp bf16``
    path): the output dtype is torch's BatchNorm's; values within one bf16 step (2^-7 of the
    largest output's power of two) of ``nn.BatchNorm2d`` on the global batch."""
    for rank, out in two_ranks.items():
        b = out["bf16"]
        assert b["dtype"] == ["torch.bfloat16", "torch.bfloat16"], rank
        assert b["autocast"] == ["torch.bfloat16", "torch.bfloat16"], rank
        assert b["autocast_fp32_in"] == ["torch.float32", "torch.float32"], rank
        assert b["grads"] == ["torch.bfloat16", "torch.float32", "torch.float32"], rank
        step = 2.0 ** (math.floor(math.log2(b["max_abs"])) - 7)
        assert b["y"] <= step, (rank, b["y"], step)


@pytest.mark.slow
def test_a_rank_with_an_empty_batch(three_ranks):
    for out in three_ranks.values():
        assert out["empty_rank"]["y"] < 1e-5 and out["empty_rank"]["running_mean"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "three"])
def test_converted_model_under_ddp_equals_one_process_on_the_global_batch(world, two_ranks,
                                                                          three_ranks):
    results = two_ranks if world == "two" else three_ranks
    for out in results.values():
        assert out["ddp_step"]["params"] < 1e-5
        assert out["ddp_step"]["buffers"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "three"])
def test_when_to_synchronise_is_torchs_rule(world, two_ranks, three_ranks):
    """docs/pitfalls.md B42. ``nn.SyncBatchNorm.forward`` (torch/nn/modules/batchnorm.py):
    ``need_sync`` only in
    training. Eval normalises the local batch, with the running stats when tracked and with
    the local batch's own statistics without them, and never communicates; training always
    uses the global batch (two steps: momentum=None is the cumulative average)."""
    results = two_ranks if world == "two" else three_ranks
    for rank, out in results.items():
        modes = out["modes"]
        assert len(modes) == 8
        for key, res in modes.items():
            training = key.startswith("training=True")
            for step in (0, 1):
                assert res[f"y{step}"] < 1e-5, (world, rank, key, step, res)
                # one all_reduce in forward when training (backward adds one), none in eval
                assert res[f"collectives{step}"] == (1 if training else 0), (rank, key, res)
                if not training:  # torch's own SyncBatchNorm, which runs on CPU in eval
                    assert res[f"torch{step}"] == 0.0, (rank, key, res)
                    assert res[f"torch_collectives{step}"] == 0, (rank, key, res)
            if "track=True" in key:
                assert res["running"] < 1e-6, (rank, key, res)
                assert res["tracked"] == ([2, 2] if training else [0, 0]), (rank, key, res)
            if training:  # torch's SyncBatchNorm refuses CPU input where it synchronises
                assert res["torch_train"].startswith(
                    "SyncBatchNorm expected input tensor to be on GPU"), res["torch_train"]


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "three"])
def test_eval_with_one_more_batch_on_one_rank_does_not_communicate(world, two_ranks,
                                                                    three_ranks):
    """track_running_stats=False in eval: rank 0 runs 3 batches, the others 2, and no rank
    issues a collective (the old code all-reduced, and rank 0 waited for a partner)."""
    results = two_ranks if world == "two" else three_ranks
    for out in results.values():
        assert out["uneven_eval"] == 0


# ---- converter (no process group) -------------------------------------------------------

class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn1 = nn.BatchNorm1d(3)
        self.block = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.BatchNorm2d(4)))
        self.deep = nn.ModuleDict({"bn3": nn.BatchNorm3d(2, momentum=None, affine=False)})


def test_converter_replaces_every_batchnorm_keeping_weights_and_stats():
    torch.manual_seed(0)
    model = _Nested()
    bn2 = model.block[1][0]
    with torch.no_grad():
        bn2.weight.uniform_()
        bn2.running_mean.uniform_()
        bn2.running_var.uniform_(1, 2)
        bn2.num_batches_tracked.fill_(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    x = torch.randn(2, 3, 5, 5)
    y_before = model.block(x)
    converted = convert_sync_batchnorm(model)
    assert converted is model
    assert count_batchnorm(model) == {"SyncBatchNorm": 3}
    assert isinstance(model.deep["bn3"], SyncBatchNorm) and model.deep["bn3"].momentum is None
    assert not model.deep["bn3"].affine
    after = model.state_dict()
    assert list(after) == list(before)  # same keys: checkpoints load either way
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not model.block[1][0].training  # mode kept
    assert torch.equal(model.block(x), y_before)  # eval: running stats, same numbers
    assert model.block[1][0].weight is bn2.weight  # parameters shared, as torch's converter


def test_converter_on_a_single_layer_and_the_deeplab_model():
    layer = convert_sync_batchnorm(nn.BatchNorm2d(6))
    assert isinstance(layer, SyncBatchNorm) and layer.num_features == 6
    model = build_model("deeplab", width=16)
    # backbone 8 + ASPP 1x1, three atrous 3x3 and the projection = 13 (notebook 06 prints it)
    assert count_batchnorm(model) == {"BatchNorm2d": 13}
    convert_sync_batchnorm(model)
    assert count_batchnorm(model) == {"SyncBatchNorm": 13}
    already = SyncBatchNorm(3)
    assert convert_sync_batchnorm(already) is already


def test_single_process_is_plain_batchnorm_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    ref, sbn = nn.BatchNorm2d(3), SyncBatchNorm(3)
    y_ref, y = ref(x), sbn(x)
    assert torch.equal(y_ref, y)
    assert torch.equal(ref.running_var, sbn.running_var)


def test_bad_input_names_the_shape():
    with pytest.raises(ValueError, match=r"expected 3 channels, got input of shape \(2, 4, 5\)"):
        SyncBatchNorm(3)(torch.zeros(2, 4, 5))
