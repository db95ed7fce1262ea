"""The profiler trace of a DDP step (ddp_lesson.labs.ddp_profile, deep dive 04 · the profiler
trace): the lab's trace holds one gloo all-reduce per bucket, each launched during backward, and
exposed_comm's figures are consistent with the trace's own intervals."""
import json

import pytest
from notebook_cells import cell_with, stream_text

from ddp_lesson.labs.ddp_profile import exposed_comm, merge_spans, timeline

NB = "deep/04_profiler_trace.ipynb"
LINE = "{r}: 8 bucket all-reduces, 8 launched during backward"


def test_the_deep_dive_prints_the_buckets_and_the_first_attempt_is_refused():
    run = stream_text(NB, "%torchrun --nproc-per-node 2 -m ddp_lesson.labs.ddp_profile")
    for r in (0, 1):
        assert f"[rank {r}] rank " + LINE.format(r=r) in run
    assert "rank 0: {'backward': " in stream_text(NB, "t = timeline(traces[0])")
    assert "'all_reduce': 8, 'launch': 8}" in stream_text(NB, "t = timeline(traces[0])")
    outputs = cell_with(NB, 'check("04.9", exposed_share)').outputs
    verdict = " ".join("".join(o["data"]["text/plain"] for o in outputs
                               if o["output_type"] == "execute_result").split())
    assert verdict.startswith("NOT YET 04.9")
    assert "you counted all of the all-reduce time: backward hid part of it" in verdict


@pytest.mark.slow
def test_a_profiled_step_on_two_ranks(tmp_path):
    from ddp_lesson.launch import run_torchrun

    r = run_torchrun("ddp_lesson.labs.ddp_profile", ["--out", str(tmp_path)], module=True,
                     nproc_per_node=2, backend="gloo", timeout=120)
    for rank in (0, 1):
        assert r.rank_lines(rank) == ["rank " + LINE.format(r=rank)]
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        t = timeline(trace)
        e = exposed_comm(trace)
        assert len(t["all_reduce"]) == 8  # 8 layers of 1 MiB, bucket_cap_mb=1
        assert e["comm_us"] == sum(b - a for a, b in merge_spans(t["all_reduce"]))
        assert 0 <= e["exposed_us"] <= e["comm_us"] <= e["step_us"]
        assert e["exposed_share"] == e["exposed_us"] / e["step_us"]
        # every bucket's all-reduce is launched while backward still runs (DDP's hooks)
        assert max(a for a, _ in t["launch"]) < max(b for _, b in t["backward"])
