"""Notebook 09: every number it prints is the package's, read from the stored outputs, and
the numbers its prose states follow from them."""
from __future__ import annotations

import re

import pytest
import torch
from notebook_cells import cell_with, lab_cell, stored_run, stream_text

from ddp_lesson.cost_model import (
    HARDWARE,
    compute_bound_batch,
    fit_alpha_beta,
    flops_per_sample,
    predict_step,
    ring_allreduce_time,
    roofline_report,
)
from ddp_lesson.gpt import TinyGPT
from ddp_lesson.models import build_model

NB = "09_how_fast_a_step_can_go.ipynb"
LAB = "ddp_lesson.labs.roofline_step"


def _prose():
    import nbformat
    from notebook_cells import NOTEBOOKS

    nb = nbformat.read(NOTEBOOKS / NB, as_version=4)
    return " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")


@pytest.fixture(scope="module")
def tiny():
    model, x = TinyGPT(vocab_size=103), torch.randint(0, 103, (4, 32))
    fwd, bwd = flops_per_sample(model, (x,))
    return model, x, fwd, bwd, 4 * sum(p.numel() for p in model.parameters())


def test_flops_and_gradient_bytes(tiny):
    _, _, fwd, bwd, grad = tiny
    deeplab = build_model("deeplab", width=16)
    dfwd, dbwd = flops_per_sample(deeplab, (torch.randn(2, 3, 64, 128),))
    dgrad = 4 * sum(p.numel() for p in deeplab.parameters())
    assert stream_text(NB, "flops_per_sample(model, (x,))") == (
        f"TinyGPT, 32 tokens: FLOPs per sample forward {fwd:.3g}, backward {bwd:.3g}\n"
        f"TinyGPT, 32 tokens: {grad:,} gradient bytes\n"
        f"DeepLab, 64x128 px: FLOPs per sample forward {dfwd:.3g}, backward {dbwd:.3g}\n"
        f"DeepLab, 64x128 px: {dgrad:,} gradient bytes\n")


def test_compute_bound_batches(tiny):
    _, _, _, bwd, grad = tiny
    want = ""
    for key, R in (("h100", 8), ("h100-200g", 16)):
        hw = HARDWARE[key]
        want += (f"{key:9s} {R:2d} GPUs: all-reduce {hw.allreduce_s(grad, R) * 1e6:6.2f} us, "
                 f"compute-bound above {compute_bound_batch(bwd, grad, hw, R):7.1f} sequences "
                 "per GPU\n")
    assert stream_text(NB, 'for key, R in (("h100", 8)') == want
    P = 1e9
    lines = stream_text(NB, "the book: 990e12").splitlines()
    assert lines[0] == "the book: 990e12 / 450e9 = 2200 tokens per GPU"
    for line, R in zip(lines[1:4], (8, 16, 64)):
        b = compute_bound_batch(4 * P, 2 * P, HARDWARE["h100"], R)
        assert line == f"H100 nodes, {R:2d} GPUs: {b:6.0f} tokens per GPU"
    slow = compute_bound_batch(4 * P, 2 * P, HARDWARE["h100-200g"], 16)
    assert lines[4] == f"two nodes, one 200 Gb/s NIC each: {slow:6.0f} tokens per GPU"
    prose = _prose()
    assert "about 1,900 on 8 H100s (the book's 2,200)" in prose
    assert round(compute_bound_batch(4 * P, 2 * P, HARDWARE["h100"], 8), -2) == 1900
    assert "about 20,000 on one 200 Gb/s NIC" in prose and round(slow, -3) == 20000


def test_efficiency_reports_and_the_prose_on_them():
    text = stream_text(NB, "from ddp_lesson.cost_model import roofline_report")
    want = "".join(roofline_report(1.3e9, key, batch_per_gpu=2, tokens_per_sample=2048,
                                   grad_bytes_per_param=2).split("\n", 2)[2] + " \n\n"
                   for key in ("h100", "h100-200g"))
    assert text == want
    flops = (2 * 1.3e9 * 2048, 4 * 1.3e9 * 2048)
    h8 = predict_step(flops, 2.6e9, 2, HARDWARE["h100"], 8, overlap=False)
    slow = predict_step(flops, 2.6e9, 2, HARDWARE["h100-200g"], 64)
    prose = _prose()
    assert "without it a quarter of the step is lost" in prose
    assert h8["efficiency"] == pytest.approx(0.75, abs=0.02)
    assert "take 0.18 s on 64 GPUs: efficiency falls to 17 %" in prose
    assert round(slow["allreduce_s"], 2) == 0.18 and round(100 * slow["efficiency"]) == 17


def _lab_lines(notebook, batch):
    """Rank 0's stored lines of the roofline lab run with ``batch`` sequences: the counted
    lines are the package's; the measured ones agree with each other. Returns
    ``(compute-bound batch, GFLOP/s)`` as printed."""
    ranks, _ = stored_run(notebook, f"from {LAB} import main", indent=0)
    lines = ranks[0]
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=103)
    fwd, bwd = flops_per_sample(model, (torch.randint(0, 103, (batch, 32)),))
    n = sum(p.numel() for p in model.parameters())
    assert lines[:3] == [
        f"TinyGPT: {batch} sequences of 32 tokens per rank, world_size=2",
        f"FLOPs per sequence (FlopCounterMode): forward {fwd:.3g}, backward {bwd:.3g}",
        f"gradients all-reduced: {n:,} floats = {4 * n:,} bytes"]
    m = re.fullmatch(r"measured backward: ([\d.]+) ms = ([\d.]+) GFLOP/s", lines[3])
    backward_ms, gflops = float(m[1]), float(m[2])
    assert gflops == pytest.approx(bwd * batch / backward_ms / 1e6, rel=0.01)
    allreduce_ms = float(re.fullmatch(r"measured all-reduce: ([\d.]+) ms", lines[4])[1])
    b = float(re.fullmatch(r"measured compute-bound batch: ([\d.]+) sequences per rank",
                           lines[5])[1])
    assert b == pytest.approx(allreduce_ms / (backward_ms / batch), abs=0.06)
    return b, gflops


def test_the_deep_dives_lab_run():
    assert cell_with("deep/09_roofline_in_depth.ipynb", LAB).source.endswith(
        'main(["--batch", "32"])')
    _lab_lines("deep/09_roofline_in_depth.ipynb", 32)


def test_the_lab_prints_the_package_numbers_and_consistent_timings():
    lab_cell(NB, LAB)
    b, gflops = _lab_lines(NB, 8)
    # the prose: "a few sequences"; a GPU computes 1e4 to 1e5 times faster, NVLink ~1e3 times
    # (measured lines: they vary with the CPU and its load, so the prose says a range)
    assert 0.5 <= b <= 10
    assert 10**4 < HARDWARE["h100"].flops_per_s / (gflops * 1e9) < 10**5.5
    prose = _prose()
    assert "backward of a few sequences already outlasts" in prose
    assert "A GPU computes 10⁴ to 10⁵ times faster" in prose


def test_alpha_beta_prediction_and_the_widget(tiny):
    from notebook_cells import ROOT

    from ddp_lesson.bench.allreduce import read_results

    model, x, _, _, grad = tiny
    link = [r for r in read_results(ROOT / "benchmarks" / "allreduce.csv")
            if r["method"] == "sendrecv" and r["nprocs"] == 2]
    alpha, beta = fit_alpha_beta([r["size_bytes"] for r in link], [r["seconds"] for r in link])
    assert stream_text(NB, "fit_alpha_beta(") == (
        f"fit: alpha {alpha * 1e3:.2f} ms, bandwidth {1 / beta / 1e6:.0f} MB/s\n"
        f"predicted all-reduce of {grad:,} bytes on 2 ranks: "
        f"{ring_allreduce_time(grad, 2, alpha, beta) * 1e3:.2f} ms\n")
    assert 10**2.5 < HARDWARE["h100"].gpu_bytes_per_s * beta < 10**3.5  # "about 10³ times"
    out = cell_with(NB, "roofline_calculator(model").outputs[0]["data"]["text/plain"]
    assert out == ("roofline calculator (run the notebook to change it)\n"
                   + roofline_report(model, "t4x2", batch_per_gpu=64, inputs=(x,)))
    _, _, _, bwd, _ = tiny
    expected = compute_bound_batch(bwd, grad, HARDWARE["h100"], 8)
    assert f"{expected:7.1f} sequences per GPU" in stream_text(NB, 'for key, R in (("h100", 8)')
    assert "the same model needs about a hundred sequences" in _prose()


def test_deep_dive_numbers_and_prose():
    import nbformat
    from notebook_cells import NOTEBOOKS

    deep = "deep/09_roofline_in_depth.ipynb"
    assert stream_text(deep, "published {what:12s}").splitlines() == [
        "predicted busbw, ring on 8 H100: 450 GB/s",
        "published ring        : 370 GB/s = 0.82 x predicted",
        "published NVLink SHARP: 480 GB/s = 1.07 x predicted"]
    eff = stream_text(deep, "for precision, one, eight")
    assert "predicted 1.00, published 0.97" in eff and "predicted 1.00, published 0.84" in eff
    ratios = stream_text(deep, "measured / predicted")
    assert "2 ranks, 64 MiB: measured / predicted = 1.18" in ratios
    assert "4 ranks, 64 MiB: measured / predicted = 2.34" in ratios
    ratio = {(int(r), int(mib)): float(v) for r, mib, v in re.findall(
        r"(\d) ranks, +(\d+) MiB: measured / predicted = ([\d.]+)", ratios)}
    # prose: "On 2 ranks, 64 MiB is within 20 % and 1 MiB is not"; 4 ranks "over twice"
    assert 0.8 <= ratio[2, 64] <= 1.2 and not 0.8 <= ratio[2, 1] <= 1.2 and ratio[4, 64] > 2
    step = stream_text(deep, "exposed communication: predicted").splitlines()
    step_pred, step_meas = (float(x) for x in re.findall(r"[\d.]+", step[0]))
    assert 0.8 <= step_meas / step_pred <= 1.2  # prose: "The step is within 20 %"
    pred, meas = (float(x) for x in re.findall(r"[\d.]+", step[1]))
    assert meas > 10 * pred  # prose: "over ten times the all-reduce"
    sweep = stream_text(deep, "predict_bucket_sweep(sizes")
    assert re.search(r"25 MB:  74 messages, exposed  0\.97 ms", sweep)  # "about a millisecond"
    assert "4096 MB:   1 messages, exposed 11.17 ms" in sweep  # "the whole 11 ms"
    hidden = [float(ms) for mb, ms in re.findall(r"(\d+) MB: +\d+ messages, exposed +([\d.]+)",
                                                   sweep) if 25 <= int(mb) <= 400]
    assert hidden and all(0.5 <= ms <= 1.5 for ms in hidden)  # "25 to 400 MB ... a millisecond"
    assert "h100-200g 64 GPUs: efficiency 17% at peak, 39% at mfu 0.4" in stream_text(
        deep, 'for key in ("h100", "a100", "h100-200g")')
    nb = nbformat.read(NOTEBOOKS / deep, as_version=4)
    prose = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    for claim in ("0.6 ms of all-reduce against 70 ms of backward", "(0.82 of the line rate)",
                  "0.97 TF32, 0.84 mixed precision", "over ten times the all-reduce",
                  "64 MiB is within 20 % and 1 MiB is not", "The step is within 20 %",
                  "25 to 400 MB hide all but about a millisecond",
                  "64 MiB takes over twice the model's time"):
        assert claim in prose, claim


def test_what_flop_counter_mode_counts_is_torchs_registry():
    # Notebook 09: "`FlopCounterMode` (`torch/utils/flop_counter.py`) counts matrix products
    # and convolutions, not element-wise work" -- its flop_registry, torch 2.13.
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    registry = FlopCounterMode(display=False).flop_registry
    assert {aten.mm, aten.addmm, aten.bmm, aten.convolution} <= set(registry)
    assert not {aten.add, aten.mul, aten.relu, aten.gelu} & set(registry)
    assert ("counts matrix products and convolutions, not element-wise work" in _prose())
