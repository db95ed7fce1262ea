"""Notebook 04, section 9: torch's own DDP read from inside (ddp_lesson.labs.torch_reducer).

One launch of the lab on 2 gloo processes; every number it prints is checked here against a
value computed independently in this process (torch's own bucket assignment, PowerSGD's
matrix sizes, float16's range) or against the JSON it wrote.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ddp_lesson.core.bucketed_ddp import MB, assign_buckets, bucket_size_limits
from ddp_lesson.labs import torch_reducer as tr

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, json_lab):
    out = tmp_path_factory.mktemp("reducer") / "reducer.json"
    return json_lab("ddp_lesson.labs.torch_reducer", out, timeout=120)


def _expected_buckets():
    model = tr.make_stack()
    params = list(model.parameters())
    nbytes = [p.numel() * p.element_size() for p in params]
    cap = int(tr.CAP_MB * MB)
    theirs, _ = dist._compute_bucket_assignment_by_size(params[::-1], [cap])
    theirs = [[len(params) - 1 - j for j in b] for b in theirs]
    return nbytes, theirs


@pytest.mark.slow
def test_real_buckets_one_then_four_in_reverse_order(lab):
    lines, lines1, data = lab
    nbytes, theirs = _expected_buckets()
    assert len(nbytes) == 16 and sum(nbytes) == 2_105_344
    assert theirs == [[15, 14, 13, 12], [11, 10, 9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]
    its = data["buckets"]["iterations"]
    assert its[0]["bucket_sizes"] == [sum(nbytes)]          # one bucket in the first iteration
    assert its[0]["rebuilt_bucket_sizes"] is None
    assert its[-1]["rebuilt_per_bucket_param_indices"] == theirs
    sizes = [sum(nbytes[i] for i in b) for b in theirs]
    assert its[-1]["rebuilt_bucket_sizes"] == sizes == [526_336] * 4
    assert its[-1]["grad_ready_order"] == list(range(15, -1, -1))
    # torch's rebuild: its rule walked in the order the gradients became ready
    ready = its[-1]["grad_ready_order"]
    assert data["buckets"]["ours"] == assign_buckets(nbytes, bucket_size_limits(tr.CAP_MB),
                                                     order=ready) == theirs
    assert lines[:7] == [
        "buckets: 16 parameter tensors, bucket_cap_mb = 0.5 (524,288 bytes)",
        "  iteration 1: bucket_sizes = [2,105,344] (1 bucket)",
        "  iteration 3: rebuilt_bucket_sizes = [526,336, 526,336, 526,336, 526,336]",
        "  rebuilt_per_bucket_param_indices = [[15,14,13,12],[11,10,9,8],[7,6,5,4],[3,2,1,0]]",
        "  our assign_buckets:               [[15,14,13,12],[11,10,9,8],[7,6,5,4],[3,2,1,0]]",
        "  same buckets: True, same sizes: True",
        "float16 gradient 40,000 on each of 2 ranks (float16 max 65,504):",
    ]
    assert lines1 == []  # rank 0 speaks for both


@pytest.mark.slow
def test_fp16_sum_overflows_where_pre_division_stays_finite(lab):
    lines, _, data = lab
    d = data["division"]
    big = torch.tensor(tr.BIG_FP16, dtype=torch.float16)
    assert torch.finfo(torch.float16).max == 65504.0
    assert math.isinf((big + big).item())                   # the SUM of 2 ranks
    assert d == {"world_size": 2, "value": 40000.0, "sum": math.inf, "post_divided": math.inf,
                 "pre_divided": 40000.0, "torch_ddp": 40000.0}
    assert lines[7:10] == ["  SUM all-reduce = inf, then / 2 = inf",
                           "  / 2 first, then SUM = 40,000",
                           "  torch's DDP on a float16 weight: grad = 40,000"]


@pytest.mark.slow
def test_static_graph_and_gradient_as_bucket_view(lab):
    lines, _, data = lab
    s = data["static_graph"]
    assert s["default_error"] == "Expected to mark a variable ready only once."
    assert s["static_ok"] == 2 and s["static_max_diff"] < 1e-6 and s["unused_grad_is_none"]
    v = data["bucket_view"]
    total = 2_105_344
    off, on = v["false"], v["true"]                          # JSON writes the bool keys so
    assert (off["grads_in_buckets"], off["num_grads"], off["grad_bytes"], off["bucket_bytes"]) \
        == (0, 16, total, total)
    assert (on["grads_in_buckets"], on["grad_bytes"], on["bucket_bytes"]) == (16, 0, total)
    assert on["max_diff_vs_copy"] < 1e-6
    assert lines[10:17] == [
        "static_graph: one layer twice under reentrant checkpointing, one layer unused",
        "  default:           Expected to mark a variable ready only once.",
        "  static_graph=True: 2 iterations; l.weight.grad = exact average (|Δ| < 1e-06): True",
        "                     unused.weight.grad is None: True",
        "gradient_as_bucket_view=False:  0 of 16 .grad inside a bucket, .grad memory 2,105,344 B",
        "gradient_as_bucket_view=True : 16 of 16 .grad inside a bucket, .grad memory 0 B",
        "  buckets 2,105,344 B either way: True; bytes saved: 2,105,344; same gradients: True",
    ]


def _powersgd_bytes(model, rank: int, min_rate: float = 2.0) -> int:
    """PowerSGD's bytes per step, from torch's rule: a matrix n x m is sent as P (n x r) and
    Q (m x r) when (n + m) * r * min_rate < n * m; everything else goes uncompressed."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += p.numel() * 4
            continue
        n, m = p.shape[0], p[0].numel()
        if (n + m) * rank * min_rate < n * m:
            total += (n + m) * rank * 4
        else:
            total += p.numel() * 4
    return total


@pytest.mark.slow
def test_comm_hooks_bytes_error_and_loss(lab):
    lines, _, data = lab
    model = tr._hook_model()
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    rows = {r["hook"]: r for r in data["hooks"]}
    assert list(rows) == list(tr.HOOKS)
    want_bytes = {"allreduce_hook": fp32, "fp16_compress_hook": fp32 // 2,
                  "PowerSGD rank 1": _powersgd_bytes(model, 1),
                  "PowerSGD rank 4": _powersgd_bytes(model, 4)}
    assert want_bytes == {"allreduce_hook": 25_348, "fp16_compress_hook": 12_674,
                          "PowerSGD rank 1": 1_668, "PowerSGD rank 4": 4_356}
    for name, r in rows.items():
        assert r["bytes_last"] == want_bytes[name], name
        assert r["grad_bytes"] == fp32
    # PowerSGD starts with plain all-reduces (start_powerSGD_iter = 2)
    assert rows["PowerSGD rank 1"]["bytes_first"] == rows["PowerSGD rank 4"]["bytes_first"] == fp32
    assert rows["allreduce_hook"]["rel_error_last"] == 0.0
    assert 0 < rows["fp16_compress_hook"]["rel_error_last"] < 1e-3
    assert rows["PowerSGD rank 1"]["rel_error_last"] > 0.1
    assert rows["PowerSGD rank 4"]["rel_error_last"] > 0.1
    firsts = {r["loss_first"] for r in rows.values()}
    assert len(firsts) == 1                                   # the same start for every hook
    exact = rows["allreduce_hook"]["loss_last"]
    assert exact < rows["allreduce_hook"]["loss_first"]       # it trains
    assert abs(rows["fp16_compress_hook"]["loss_last"] - exact) < 1e-3
    for name in ("PowerSGD rank 1", "PowerSGD rank 4"):
        assert abs(rows[name]["loss_last"] - exact) < 1e-2
    table = [f"{r['hook']:<19} {r['bytes_last']:>10,} {r['bytes_last'] / fp32:>7.3f} "
             f"{tr.error_order(r['rel_error_last']):>10} {r['loss_first']:>8.4f} "
             f"{r['loss_last']:>9.4f}"
             for r in rows.values()]
    start = lines.index("hook                bytes/step vs fp32 grad error loss @ 1 loss @ 20")
    assert lines[start + 1:start + 5] == table
    assert lines[start + 5] == ("(PowerSGD sent plain all-reduces for its first 2 steps: "
                                "25,348 bytes in step 1)")


@pytest.mark.slow
def test_bf16_compress_hook_refused_by_the_build(lab):
    """Refused on a CPU build, accepted on a CUDA build with NCCL (on gloo too): the lab prints
    the fact that holds on both, and the build's own answer is read from torch here."""
    lines, _, data = lab
    refusal = data["bf16"]
    build = (torch.version.cuda is not None or torch.version.hip is not None) and (
        dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10))
    assert data["bf16_build"] == tr.bf16_build_supports() == build
    if build:
        assert refusal is None
    else:
        assert refusal.startswith("TypeError: ") and "CUDA" in refusal and "NCCL" in refusal
    assert lines[-2:] == ["bf16_compress_hook on gloo/CPU:", "  refused exactly where the build "
                          "lacks CUDA+NCCL and XPU+XCCL: True"]


def test_reducer_map_figure_is_readable_and_names_both_sides():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    from ddp_lesson.viz.ddp import REDUCER_MAP, reducer_map_figure

    fig = reducer_map_figure()
    try:
        width_px = fig.get_size_inches()[0] * fig.dpi
        assert width_px >= 700
        ax = fig.axes[0]
        texts = {t.get_gid(): t for t in ax.texts if t.get_gid()}
        assert sorted(texts) == sorted(f"{side}{k}" for side in ("stage", "ours", "torch")
                                       for k in range(1, 5))
        assert all(t.get_fontsize() >= 9 for t in ax.texts)
        assert "register_post_accumulate_grad_hook" in texts["ours1"].get_text()
        assert "autograd_hook" in texts["torch1"].get_text()
        assert "run_comm_hook" in texts["torch3"].get_text()
        assert "finalize_backward" in texts["torch4"].get_text()
        assert [row[0] for row in REDUCER_MAP] == [
            texts[f"stage{k}"].get_text() for k in range(1, 5)
        ]
        # every text fits inside its box (no overflow into the neighbour)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, FancyBboxPatch)]
        assert len(boxes) == 12
        for gid, t in texts.items():
            bb = t.get_window_extent(renderer)
            assert any(b.x0 <= bb.x0 and bb.x1 <= b.x1 and b.y0 <= bb.y0 and bb.y1 <= b.y1
                       for b in boxes), gid
    finally:
        plt.close(fig)


def test_the_hook_table_prints_each_error_by_its_order_of_magnitude():
    assert [tr.error_order(x) for x in (0.0, 3.5e-4, 3.6e-4, 1.1, 0.92, 1e-3)] == \
        ["0", "~1e-04", "~1e-04", "~1e+00", "~1e-01", "~1e-03"]
