"""The notebook-04 lab programs on 2 real processes: exact printed facts and recorded structure."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from notebook_cells import lab_cell, stream_text

from ddp_lesson.core.buckets import MB
from ddp_lesson.labs.ddp_overlap import SWEEP_CAPS_MB
from ddp_lesson.labs.ddp_toys import TOYS
from ddp_lesson.launch import format_rank_outputs, run_torchrun
from ddp_lesson.models import build_model

pytestmark = pytest.mark.timeout(150)
NB04 = "04_ddp_from_scratch.ipynb"


def _torch_bucket_count(model, cap_mb: float) -> int:
    """Buckets torch's own assignment makes from the trainable parameters walked in the order
    their gradients become ready on these models (the last first), as its rebuild does."""
    params = [p for p in model.parameters() if p.requires_grad]
    ready = list(range(len(params)))[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready], [int(cap_mb * MB)], [], ready)
    return len(buckets)


def test_three_ways_lab_prints_equal_weights_and_what_is_synchronised():
    # The run is notebook 04's cell (``main([])`` on 2 gloo processes), read from its stored
    # output: the suite's nbval replay runs that cell and fails unless it prints exactly this.
    lab_cell(NB04, "ddp_lesson.labs.ddp_three_ways")
    stored = stream_text(NB04, "from ddp_lesson.labs.ddp_three_ways import main")
    torch.manual_seed(0)
    models = {"deeplab": (build_model("deeplab", width=8), 0.05)}
    models.update({name: (TOYS[name][0](), 0.0) for name in ("frozen", "tied", "unused")})
    expected = []
    for name, (model, cap) in models.items():
        synced = sum(p.requires_grad for p in model.parameters())
        registered = len(list(model.named_parameters(remove_duplicate=False)))
        expected += [
            f"{name}: {synced} of {registered} tensors synchronised, "
            f"{_torch_bucket_count(model, cap)} buckets",
            f"{name}: Naive, Bucketed = torch's DDP within 1e-06: True, True; "
            "same on all ranks: True",
        ]
    # rank 0 prints exactly these lines (wrapped at 100 characters as every stored output is),
    # rank 1 nothing
    assert stored.splitlines() == (["[torchrun] 2 processes and no GPU: using gloo on CPU"]
                                   + format_rank_outputs({0: "\n".join(expected)}).splitlines())
    # what the notebook says about the toys: frozen 4 of 6, tied 7 for 8 registrations
    assert expected[2] == "frozen: 4 of 6 tensors synchronised, 4 buckets"
    assert expected[4] == "tied: 7 of 8 tensors synchronised, 7 buckets"
    assert all(len(line) <= 100 for line in expected)


@pytest.mark.slow
def test_overlap_lab_records_timelines_and_sweep(tmp_path):
    out = tmp_path / "overlap.json"
    result = run_torchrun("ddp_lesson.labs.ddp_overlap", ["--out", str(out), "--steps", "2"],
                          module=True, nproc_per_node=2, timeout=120, live=False, backend="gloo")
    torch.manual_seed(0)
    model = build_model("deeplab", width=16)
    counts = [_torch_bucket_count(model, cap) for cap in SWEEP_CAPS_MB]
    assert counts == [43, 13, 10, 8, 4, 3, 2, 1]   # 0.01 MB: 14 filled from the first layer
    assert result.rank_lines(0) == [
        "link: alpha = 0.5 ms, bandwidth = 100 MB/s",
        "buckets per cap (MB):",
        "  " + ", ".join(f"{c:g} -> {n}" for c, n in zip(SWEEP_CAPS_MB[:4], counts[:4])),
        "  " + ", ".join(f"{c:g} -> {n}" for c, n in zip(SWEEP_CAPS_MB[4:], counts[4:])),
        f"recorded 3 timelines and a sweep of {len(SWEEP_CAPS_MB)} caps on 2 ranks",
    ]
    data = json.loads(out.read_text())
    assert [title for title, _ in data["timeline"]] == [
        "NaiveDDP", "buckets of 0.25 MB, no overlap", "buckets of 0.25 MB, overlapped"]
    for title, records in data["timeline"]:
        assert [r["rank"] for r in records] == [0, 1]
        for r in records:
            assert len(r["grad_ready_s"]) == 43          # every parameter's gradient
            assert r["sync_end_s"] >= r["backward_end_s"] >= 0
            assert all(e["end_s"] >= e["start_s"] for e in r["comm"])
            issued = [e["issued_s"] for e in r["comm"]]
            if title == "NaiveDDP":
                assert len(r["comm"]) == 43
                assert min(issued) >= r["backward_end_s"]   # nothing before backward ends
            elif "no overlap" in title:
                assert len(r["comm"]) == 4
                assert min(issued) >= r["backward_end_s"]
            else:
                # overlap: every bucket but the last is issued inside backward, by a hook
                assert len(r["comm"]) == 4
                assert all(t < r["backward_end_s"] for t in issued[:-1])
    assert sorted({c for c, _ in data["sweep"]}) == sorted(SWEEP_CAPS_MB)
    assert len(data["sweep"]) == 2 * len(SWEEP_CAPS_MB) and len(data["naive"]) == 2
    assert all(e >= 0 for _, e in data["sweep"])
    assert data["param_nbytes"] == [p.numel() * 4 for p in model.parameters()]
