"""The numbers notebook 04 prints in the kernel, recomputed independently (no process group).

Parameter sizes from the model itself, link costs from the α-β formula written out, buckets
from torch's own ``_compute_bucket_assignment_by_size``, the bucket-sweep prediction from a
schedule re-derived here, the graph walk against which parameters actually get a gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lesson.ddp import MB, SimulatedLink, predict_bucket_sweep, walk_autograd_graph
from ddp_lesson.labs.ddp_overlap import SWEEP_CAPS_MB
from ddp_lesson.labs.ddp_toys import UnusedToy
from ddp_lesson.models import build_model

ALPHA, BANDWIDTH, R, BACKWARD_S = 0.5e-3, 100e6, 2, 0.020


@pytest.fixture(scope="module")
def deeplab():
    torch.manual_seed(0)
    model = build_model("deeplab", width=16)
    names = [n for n, _ in model.named_parameters()]
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    return model, names, nbytes


def _torch_buckets(model, cap_mb):
    params = list(model.parameters())[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [int(cap_mb * MB)])
    return [[len(params) - 1 - j for j in b] for b in buckets]


def test_gradient_sizes(deeplab):
    model, _, nbytes = deeplab
    assert len(nbytes) == 43
    assert sum(p.numel() for p in model.parameters()) == 287_491
    assert sum(nbytes) == 1_149_964
    assert (min(nbytes), sorted(nbytes)[len(nbytes) // 2], max(nbytes)) == (64, 256, 147_456)


def test_cost_of_one_message_per_parameter(deeplab):
    _, _, nbytes = deeplab
    # ring on 2 ranks: 2(R-1)α + 2(R-1)/R · n / bandwidth = 1 ms + n / 100 MB/s
    per_param = sum(2 * ALPHA + n / BANDWIDTH for n in nbytes)
    one = 2 * ALPHA + sum(nbytes) / BANDWIDTH
    assert f"{per_param * 1e3:.1f}" == "54.5" and f"{43 * 2 * ALPHA * 1e3:.1f}" == "43.0"
    assert f"{one * 1e3:.1f}" == "12.5"
    link = SimulatedLink(ALPHA, BANDWIDTH)
    assert sum(link.cost_s(n, R) for n in nbytes) == pytest.approx(per_param)
    assert link.cost_s(sum(nbytes), R) == pytest.approx(one)


def test_bucket_table_at_a_quarter_megabyte(deeplab):
    model, names, nbytes = deeplab
    buckets = _torch_buckets(model, 0.25)
    table = [(len(b), f"{sum(nbytes[i] for i in b) / MB:.3f}", names[b[0]], names[b[-1]])
             for b in buckets]
    assert table == [
        (13, "0.381", "classifier.bias", "aspp.branches.2.0.weight"),
        (9, "0.298", "aspp.branches.1.1.bias", "backbone.7.0.weight"),
        (6, "0.282", "backbone.6.1.bias", "backbone.5.0.weight"),
        (15, "0.135", "backbone.4.1.bias", "backbone.0.0.weight"),
    ]


def _schedule(bucket_bytes, bucket_ready, backward_s):
    """A serial α-β link: each bucket starts when ready and when the link is free."""
    free = 0.0
    for n, ready in zip(bucket_bytes, bucket_ready):
        free = max(free, ready) + 2 * (R - 1) * ALPHA + 2 * (R - 1) / R * n / BANDWIDTH
    return max(0.0, free - backward_s)


def test_bucket_sweep_prediction(deeplab):
    model, _, nbytes = deeplab
    total = sum(nbytes)
    # steady backward: parameter i is ready once the bytes of parameters i..P-1 are produced
    ready = [BACKWARD_S * sum(nbytes[i:]) / total for i in range(len(nbytes))]
    ours = predict_bucket_sweep(nbytes, SWEEP_CAPS_MB, BACKWARD_S, R, ALPHA, BANDWIDTH)
    expected = []
    for cap, row in zip(SWEEP_CAPS_MB, ours):
        buckets = _torch_buckets(model, cap)
        exposed = _schedule([sum(nbytes[i] for i in b) for b in buckets],
                            [max(ready[i] for i in b) for b in buckets], BACKWARD_S)
        assert row["buckets"] == len(buckets)
        assert row["exposed_s"] == pytest.approx(exposed, abs=1e-12)
        expected.append(exposed)
    naive = _schedule(nbytes, [BACKWARD_S] * len(nbytes), BACKWARD_S)
    assert ours[-1]["exposed_s"] == pytest.approx(naive, abs=1e-12)
    # the rounded values notebook 04 prints
    assert [r["buckets"] for r in ours] == [43, 13, 10, 8, 4, 3, 2, 1, 43]
    assert [f"{e * 1e3:.1f}" for e in expected + [naive]] == [
        "34.5", "6.0", "4.4", "3.9", "3.9", "6.9", "12.3", "12.5", "54.5"]
    assert SWEEP_CAPS_MB[min(range(len(expected)), key=expected.__getitem__)] == 0.1


def test_graph_walk_finds_exactly_the_parameters_that_get_gradients(deeplab):
    model, _, nbytes = deeplab
    for net, x in ((UnusedToy(), torch.randn(2, 4)), (model, torch.randn(1, 3, 64, 128))):
        net.zero_grad(set_to_none=True)
        out = net(x)
        _, reached = walk_autograd_graph(out)
        out.sum().backward()
        got_grad = {n for n, p in net.named_parameters() if p.grad is not None}
        assert {n for n, p in net.named_parameters() if id(p) in reached} == got_grad
    toy = UnusedToy()
    _, reached = walk_autograd_graph(toy(torch.randn(2, 4)))
    assert [n for n, p in toy.named_parameters() if id(p) not in reached] == ["aux.weight", "aux.bias"]
    _, reached = walk_autograd_graph(model(torch.randn(1, 3, 64, 128)))
    assert sum(id(p) in reached for p in model.parameters()) == len(nbytes) == 43


def test_ddp_benchmark_ratios_printed_in_notebook_04():
    """Section 6 of notebook 04 prints ratios from the committed ``benchmarks/ddp.csv``; read
    here with the csv module alone (not the package's reader) and checked against the prose."""
    import csv
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ddp.csv"
    with open(path, newline="") as f:
        rows = {(r["variant"], r["link"]): r for r in csv.DictReader(f)}
    torch_ddp, bucketed, naive = (rows[v, "False"] for v in ("torch", "bucketed", "naive"))
    # ratio_to_torch is the paired ratio; the medians' ratio agrees with it to a few percent
    for r in (bucketed, naive):
        assert float(r["ratio_to_torch"]) == pytest.approx(
            float(r["steps_per_s"]) / float(torch_ddp["steps_per_s"]), rel=0.05)
    assert f"{float(bucketed['ratio_to_torch']):.2f}" == "1.05"  # "runs at torch's speed"
    assert f"{float(naive['ratio_to_torch']):.2f}" == "0.54"     # "much slower"
    over, no_over = rows["bucketed", "True"], rows["bucketed-no-overlap", "True"]
    exp_over, exp_no = float(over["exposed_ms"]), float(no_over["exposed_ms"])
    assert (f"{exp_no:.1f}", f"{exp_over:.1f}", f"{exp_over / exp_no:.2f}") == ("16.4", "7.9", "0.48")
    assert 0.4 < exp_over / exp_no < 0.6                         # "to about half"
    share_over, share_no = float(over["exposed_share"]), float(no_over["exposed_share"])
    assert (f"{share_no:.2f}", f"{share_over:.2f}") == ("1.00", "0.36")
    assert 0.25 < share_over < 0.4                               # "to about a third"
    gain = float(over["steps_per_s"]) / float(no_over["steps_per_s"])
    assert f"{gain:.2f}" == "1.01" and gain < exp_no / exp_over  # the step gains far less
