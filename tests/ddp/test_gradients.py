"""Gradient averaging (notebook 01): helpers, cases B5 and B7, and the notebook's printed values.

Expected values come from pitfalls.md (B5: 15 / 60 / 30; B7: 0.2), from hand arithmetic
(d/dw (w x)² = 2 w x²) or from plain autograd on the whole batch — never from the helpers
under test. One 2-process torchrun job checks the real all-reduce and torch's DDP.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch
from notebook_cells import NOTEBOOKS, stream_text

from ddp_lesson.gradients import (
    accumulation_steps,
    average,
    batch_gradient,
    make_toy_batch,
    make_toy_model,
    max_abs_diff,
    scalar_squared_error_grad,
    scale_lr,
    sgd_step,
    shard_gradients,
    split_batch,
    warmup_cosine,
    weighted_average,
)
from ddp_lesson.launch import run_torchrun

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]


def _plain_grad(model, x, y, reduction="mean"):
    """Autograd on the whole batch, written out without the helpers."""
    params = list(model.parameters())
    loss = ((model(x) - y) ** 2).mean() if reduction == "mean" else ((model(x) - y) ** 2).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_b5_scalar_values_by_hand():
    x = [1, 2, 3, 4]
    assert scalar_squared_error_grad(1.0, x, "mean") == pytest.approx(
        2 * sum(v * v for v in x) / 4
    )  # 15
    assert scalar_squared_error_grad(1.0, x, "mean") == pytest.approx(15.0)
    assert scalar_squared_error_grad(1.0, x, "sum") == pytest.approx(60.0)
    assert scalar_squared_error_grad(1.0, [1, 2]) == pytest.approx(5.0)
    assert scalar_squared_error_grad(1.0, [3, 4]) == pytest.approx(25.0)
    assert scalar_squared_error_grad(1.0, [1, 2], "sum") == pytest.approx(10.0)
    assert scalar_squared_error_grad(1.0, [3, 4], "sum") == pytest.approx(50.0)
    # averaged like DDP: mean -> 15 (= single process), sum -> 30 (= 60 / R)
    assert (5.0 + 25.0) / 2 == 15.0 and (10.0 + 50.0) / 2 == 30.0


def test_equal_shards_average_to_the_full_batch_gradient():
    model = make_toy_model(seed=0)
    x, y = make_toy_batch(8, seed=1)
    full = _plain_grad(model, x, y)
    assert full.numel() == 4 * 3 + 3 + 3 * 1 + 1 == 19
    assert torch.allclose(batch_gradient(model, x, y), full, atol=1e-7)
    for R in (1, 2, 4, 8):
        grads = shard_gradients(model, x, y, R)
        assert len(grads) == R
        assert max_abs_diff(average(grads), full) < 1e-6
    grads = shard_gradients(model, x, y, 4)
    assert max_abs_diff(grads[0], grads[1]) > 1e-3          # shards really differ
    # a sum loss: the average of shard sums is the global sum / R
    sums = shard_gradients(model, x, y, 4, reduction="sum")
    assert max_abs_diff(average(sums) * 4, _plain_grad(model, x, y, "sum")) < 1e-5


def test_unequal_shards_need_the_weighted_average():
    # x = [1..5], shards [1,2,3] and [4,5]: by hand 2·mean(x²) = 2·55/5 = 22,
    # shard grads 2·14/3 = 28/3 and 2·41/2 = 41, plain average 28/6 + 20.5 = 25.1667
    g = [scalar_squared_error_grad(1.0, [1, 2, 3]), scalar_squared_error_grad(1.0, [4, 5])]
    assert g == pytest.approx([28 / 3, 41.0])
    assert scalar_squared_error_grad(1.0, [1, 2, 3, 4, 5]) == pytest.approx(22.0)
    assert sum(g) / 2 == pytest.approx(25.1667, abs=1e-4)
    assert weighted_average(g, [3, 2]) == pytest.approx(22.0)
    model = make_toy_model(seed=0)
    x, y = make_toy_batch(8, seed=1)
    full = _plain_grad(model, x, y)
    grads = shard_gradients(model, x, y, 3, sizes=[4, 2, 2])
    assert max_abs_diff(average(grads), full) > 1e-3
    assert max_abs_diff(weighted_average(grads, [4, 2, 2]), full) < 1e-6


def test_split_batch_errors_name_the_numbers():
    x, y = make_toy_batch(6)
    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal shards"):
        split_batch(x, y, 4)
    with pytest.raises(ValueError, match=r"shard sizes \[3, 2\] add up to 5, the batch has 6"):
        split_batch(x, y, 2, sizes=[3, 2])
    with pytest.raises(ValueError, match="2 gradients but 3 counts"):
        weighted_average([torch.ones(1)] * 2, [1, 2, 3])


def test_scale_lr_rules():
    assert scale_lr(0.1, 256, 4 * 128) == pytest.approx(0.2)               # B7
    assert scale_lr(0.1, 256, 4 * 128, "sqrt") == pytest.approx(0.1 * math.sqrt(2))
    assert scale_lr(0.1, 256, 8 * 32) == pytest.approx(0.1)
    assert scale_lr(0.1, 256, 1024, "none") == 0.1
    with pytest.raises(ValueError, match="rule 'cubic' is not one of"):
        scale_lr(0.1, 256, 512, "cubic")
    with pytest.raises(ValueError, match="must be > 0"):
        scale_lr(0.1, 0, 512)


def test_accumulation_reaches_the_global_batch():
    """global = micro x accumulation x world_size (the recipe's step 2)."""
    assert accumulation_steps(256, 16, 4) == 4
    assert accumulation_steps(32, 8, 4) == 1
    assert accumulation_steps(96, 3, 2) == 16
    with pytest.raises(ValueError, match=r"global batch 100 is not a multiple of micro_batch 16 "
                                         r"x world_size 4 = 64; use a global batch of 64 or 128"):
        accumulation_steps(100, 16, 4)
    with pytest.raises(ValueError, match="global batch 8 .* = 32; use a global batch of 32,"):
        accumulation_steps(8, 16, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        accumulation_steps(8, 4, 0)


def test_warmup_then_cosine_to_the_floor():
    total, warm = 10, 4
    f = [warmup_cosine(s, total, warm, floor=0.1) for s in range(total)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])        # linear warm-up, peak at 4
    assert f[4] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    # step 6 is 2 of the decay's 5 intervals in (steps 4..9)
    assert f[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 5)))
    assert all(a >= b for a, b in zip(f[4:], f[5:]))             # decays monotonically
    assert warmup_cosine(0, 5, 0) == 1.0                          # no warm-up: peak at step 0
    assert warmup_cosine(0, 1, 0) == 1.0                          # one step: the peak
    for bad in ((0, 0), (5, 5), (5, -1)):
        with pytest.raises(ValueError, match="0 <= warmup_steps < total_steps"):
            warmup_cosine(0, *bad)
    with pytest.raises(ValueError, match="floor in"):
        warmup_cosine(0, 5, 1, floor=1.5)


def test_sgd_step_is_plain_sgd():
    model = make_toy_model(seed=0)
    x, y = make_toy_batch(4, seed=1)
    ref = make_toy_model(seed=0)
    g = _plain_grad(ref, x, y)
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in ref.parameters()]) - 0.1 * g
    sgd_step(model, x, y, 0.1)
    got = torch.cat([p.reshape(-1) for p in model.parameters()]).detach()
    assert torch.allclose(got, flat, atol=1e-7)


def test_per_rank_gradients_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_lesson.viz.gradients import per_rank_gradients_figure

    model = make_toy_model(seed=0)
    x, y = make_toy_batch(8, seed=1)
    grads, full = shard_gradients(model, x, y, 4), batch_gradient(model, x, y)
    fig = per_rank_gradients_figure(grads, full)
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    bars = ax.containers[:4]   # one container per rank, then the average's
    heights = torch.tensor([[b.get_height() for b in c] for c in bars], dtype=torch.float64)
    # every one of the 19 entries is legible: its tallest shard bar is 1 in size, none flat
    assert heights.shape == (4, 19)
    assert torch.allclose(heights.abs().max(dim=0).values, torch.ones(19, dtype=torch.float64))
    scale = torch.stack(grads).double().abs().max(dim=0).values
    assert torch.allclose(heights, torch.stack(grads).double() / scale)   # scaled, signs kept
    crosses = torch.tensor(ax.collections[0].get_offsets()[:, 1])
    average = torch.tensor([b.get_height() for b in ax.containers[4]])
    assert torch.allclose(crosses, full.double() / scale, atol=1e-6)
    assert torch.allclose(average, crosses, atol=1e-6)   # the average lands on the full batch
    plt.close(fig)
    with pytest.raises(ValueError):
        per_rank_gradients_figure([torch.ones(3), torch.ones(2)], torch.ones(3))


# ----------------------------------------------------------------------------- multi-process


DDP_CHECKS = textwrap.dedent(r"""
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_lesson.env import init_distributed, cleanup
    from ddp_lesson.gradients import (make_toy_model, make_toy_batch, split_batch,
                                      batch_gradient, all_reduce_average, weighted_average)
    env = init_distributed(timeout=60)
    R, rank = env.world_size, env.rank
    # 1. shard gradient + all_reduce_average == full-batch gradient (plain autograd)
    model = make_toy_model(seed=0)
    x, y = make_toy_batch(8, seed=1)
    xs, ys = split_batch(x, y, R)[rank]
    g = all_reduce_average(batch_gradient(model, xs, ys))
    full = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        ((model(x) - y) ** 2).mean(), list(model.parameters()))])
    print("average equals full batch:", float((g - full).abs().max()) < 1e-6)
    try:
        all_reduce_average(torch.ones(2, dtype=torch.int64))
    except TypeError:
        print("int average refused: True")
    h = torch.full((1,), 40000.0, dtype=torch.float16)  # a float16 SUM of 2 would be inf
    print("float16 average finite:", all_reduce_average(h).item() == 40000.0)
    try:   # torch's own gloo: ReduceOp.AVG, where it exists, averages floating tensors only
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
        print("gloo AVG of an int tensor refused: False")
    except (RuntimeError, ValueError):
        print("gloo AVG of an int tensor refused: True")
    # 2. B5 with torch DDP: shards [1,2] and [3,4], w = 1, target 0
    xb = torch.tensor([[1.0], [2.0]]) if rank == 0 else torch.tensor([[3.0], [4.0]])
    def b5(red, scale):
        m = nn.Linear(1, 1, bias=False); nn.init.ones_(m.weight)
        d = DDP(m)
        (nn.functional.mse_loss(d(xb), torch.zeros_like(xb), reduction=red) * scale).backward()
        return m.weight.grad.item()
    for label, red, scale in (("mean", "mean", 1), ("sum", "sum", 1), ("meanxR", "mean", R)):
        print(f"B5 {label}: {b5(red, scale):g}")
    # 3. B7: DDP step on R x 2 equals one process on 2R, same lr
    x4, y4 = make_toy_batch(2 * R, seed=1)
    xs4, ys4 = split_batch(x4, y4, R)[rank]
    def b7():
        m = make_toy_model(seed=0); d = DDP(m)
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        nn.functional.mse_loss(d(xs4), ys4).backward(); opt.step()
        return [p.detach().clone() for p in m.parameters()]
    stepped = b7()
    ref = make_toy_model(seed=0)
    gr = torch.autograd.grad(((ref(x4) - y4) ** 2).mean(), list(ref.parameters()))
    with torch.no_grad():
        diff = max(float((p - (q - 0.1 * gq)).abs().max())
                   for p, q, gq in zip(stepped, ref.parameters(), gr))
    print("B7 one step equal:", diff < 1e-6)
    # 4. unequal shards: the weighted fix with two all-reduces
    sizes = [5, 3]
    xu, yu = split_batch(x, y, R, sizes=sizes)[rank]
    gu = batch_gradient(model, xu, yu) * sizes[rank]
    n = torch.tensor([float(sizes[rank])])
    dist.all_reduce(gu); dist.all_reduce(n)
    print("weighted fix equals full batch:", float((gu / n - full).abs().max()) < 1e-6)
    plain = all_reduce_average(batch_gradient(model, xu, yu))
    print("plain average is off:", float((plain - full).abs().max()) > 1e-3)
    cleanup()
    # torch 2.13 + gloo: DDP keeps the process group alive past destroy_process_group, and
    # its worker threads can abort the interpreter's finalization ("terminate called without
    # an active exception", about 1 run in 10 here). Skip finalization once all is printed.
    import atexit, os, sys
    atexit._run_exitfuncs(); sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")


@pytest.mark.slow
def test_real_all_reduce_and_ddp_on_two_processes():
    result = run_torchrun(code=DDP_CHECKS, nproc_per_node=2, timeout=120, live=False)
    for rank in range(2):
        lines = result.rank_lines(rank)
        assert lines == [
            "average equals full batch: True",
            "int average refused: True",
            "float16 average finite: True",   # divided by R before the SUM, as torch
            "gloo AVG of an int tensor refused: True",
            "B5 mean: 15", "B5 sum: 30", "B5 meanxR: 30",   # pitfalls.md B5
            "B7 one step equal: True",
            "weighted fix equals full batch: True",
            "plain average is off: True",
        ], (rank, lines)


# ---------------------------------------------------------------------------- notebook 01's outputs


def _text(marker: str) -> str:
    return stream_text("01_data_parallelism.ipynb", marker)


def test_notebook_01_single_process_outputs():
    assert _text("grads = shard_gradients(model, x, y, R)").splitlines() == [
        "parameters: 19", "shard sizes: [2, 2, 2, 2]",
        "shard gradients differ from each other: True", "max |Δ| below 1e-6: True"]
    # 3a's numbers by hand, in its prose: 2·mean(x²) = 15, 2·sum(x²) = 60; shards [1,2] -> 5 / 10
    # and [3,4] -> 25 / 50, averages 15 and 30
    g = scalar_squared_error_grad
    x, shards = [1, 2, 3, 4], ([1, 2], [3, 4])
    mean, total = g(1.0, x, "mean"), g(1.0, x, "sum")
    (m0, s0), (m1, s1) = ((g(1.0, sh, "mean"), g(1.0, sh, "sum")) for sh in shards)
    prose = " ".join(" ".join(c.source.split()) for c in nbformat.read(
        NOTEBOOKS / "01_data_parallelism.ipynb", as_version=4).cells if c.cell_type == "markdown")
    assert (f"one process gets {mean:g} with the mean loss and {total:g} with the sum loss; the "
            f"ranks' mean-loss gradients {m0:g} and {m1:g} average to {(m0 + m1) / 2:g}, their "
            f"sum-loss gradients {s0:g} and {s1:g} to {(s0 + s1) / 2:g}: off by R") in prose
    lr = _text("from ddp_lesson.gradients import scale_lr").splitlines()
    assert lr == ["linear rule: 0.2", f"sqrt rule:   {round(0.1 * math.sqrt(2), 4)}",
                  "8 ranks × 32 = 256, the tuned batch: 0.1"]
    unequal = _text("shards = [[1, 2, 3], [4, 5]]").splitlines()
    assert unequal == ["global mean-loss gradient: 22.0",
                       f"shard gradients: [{round(28 / 3, 4)}, 41.0]",
                       f"plain average: {round((28 / 3 + 41) / 2, 4)}",
                       "weighted by shard size: 22.0"]


def test_notebook_01_torchrun_outputs():
    avg = _text("dist.all_reduce(g, op=dist.ReduceOp.SUM)").splitlines()
    for r in range(2):
        assert f"[rank {r}] shard of 4 samples; differs from the full-batch gradient: True" in avg
        assert f"[rank {r}] after all_reduce and ÷ world_size, max |Δ| below 1e-6: True" in avg
    # ReduceOp.AVG moved to the deep dive's %%ranks cells: tests/launch/test_cluster.py
    b5 = _text("DDP gradient").splitlines()
    for r in range(2):   # pitfalls.md B5: mean 15, sum 30, mean × R 30
        for label, value in (("mean    ", 15), ("sum     ", 30), ("mean × R", 30)):
            assert f"[rank {r}] {label} loss: DDP gradient {value}" in b5
    b7 = stream_text("deep/01_loss_scaling_and_lr_rules.ipynb",
                     "sgd_step(make_toy_model(seed=0), x, y, lr)").splitlines()
    for r in range(2):
        assert (f"[rank {r}] B=2 per rank, global batch 4, lr 0.1: "
                f"max |Δ| below 1e-6 vs one process on B=4: True") in b7
