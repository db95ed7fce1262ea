"""The DDP benchmark's bookkeeping (no timing): CSV round trip, ratios, argument split, figure."""
from __future__ import annotations

import pytest

from ddp_lesson.bench.ddp import FIELDS, ratios, read_results, worker_argv, write_results


def _row(variant, link, sps, ratio, **extra):
    row = {k: "" for k in FIELDS}
    row.update(variant=variant, link=link, steps_per_s=sps, steps_per_s_min=sps * 0.9,
               steps_per_s_max=sps * 1.1, ratio_to_torch=ratio, rounds=3, steps=2)
    row.update(extra)
    return row


ROWS = [
    _row("torch", False, 20.0, 1.0), _row("bucketed", False, 19.8, 0.99),
    _row("naive", False, 10.0, 0.5), _row("torch", True, 10.0, 1.0),
    _row("bucketed", True, 12.0, 1.2, exposed_ms=4.0, exposed_share=0.25, latency_ms=0.5,
         bandwidth_MBps=100.0),
    _row("naive", True, 3.0, 0.3, exposed_ms=60.0, exposed_share=1.0),
]


def test_csv_round_trip_and_ratios(tmp_path):
    path = tmp_path / "ddp.csv"
    write_results(ROWS, path)
    back = read_results(path)
    assert [(r["variant"], r["link"]) for r in back] == [(r["variant"], r["link"]) for r in ROWS]
    assert back[1]["steps_per_s"] == pytest.approx(19.8) and back[0]["exposed_ms"] is None
    got = ratios(back)
    assert got["bucketed/torch"] == pytest.approx(0.99)
    assert got["naive/torch"] == pytest.approx(0.5)
    assert got["link naive/bucketed"] == pytest.approx(0.3 / 1.2)
    assert got["link exposed share bucketed"] == pytest.approx(0.25)
    assert got["link exposed ms naive"] == pytest.approx(60.0)


def test_launcher_options_are_not_passed_to_the_worker():
    from ddp_lesson.bench.ddp import _worker_parser
    from ddp_lesson.cli import _parser

    argv = ["bench", "ddp", "--nprocs", "2", "--batch", "2", "--out=x.csv", "--figure", "f.png",
            "--steps", "3", "--size", "8", "16", "--repeats", "5"]
    args = worker_argv(_parser().parse_args(argv))
    assert args == ["worker", "--repeats", "5", "--width", "16", "--batch", "2", "--size", "8",
                    "16", "--steps", "3", "--warmup", "2",
                    "--link-bucket-cap-mb", "0.25", "--latency-ms", "0.5",
                    "--bandwidth-mbps", "100.0"]
    back = _worker_parser().parse_args(args[1:])
    assert (back.batch, back.steps, back.size, back.repeats) == (2, 3, [8, 16], 5)
    # unset --bucket-cap-mb: BucketedDDP gets torch's default buckets, as torch's DDP does
    assert back.bucket_cap_mb is None
    args = worker_argv(_parser().parse_args(argv + ["--bucket-cap-mb", "25"]))
    assert args[args.index("--bucket-cap-mb") + 1] == "25.0"


def test_benchmark_figure_has_both_panels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_lesson.viz.ddp import ddp_benchmark_figure

    fig = ddp_benchmark_figure(ROWS)
    assert len(fig.axes) == 2
    assert [len(ax.patches) for ax in fig.axes] == [3, 3]
    plt.close(fig)


def test_timeline_and_sweep_figures():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_lesson.commsim import CommEvent, StepRecord
    from ddp_lesson.cost_model import predict_bucket_sweep
    from ddp_lesson.viz.ddp import bucket_sweep_figure, ddp_timeline_figure

    def rec(rank, t0):
        return StepRecord(rank=rank, step=0, t0_s=t0, backward_end_s=0.010, sync_end_s=0.014,
                          grad_ready_s={"a": 0.004, "b": 0.009},
                          comm=[CommEvent(0, 8, ["a"], 0.004, 0.004, 0.008),
                                CommEvent(1, 8, ["b"], 0.009, 0.009, 0.014)])

    panels = [("one", [rec(0, 1.0), rec(1, 1.001)]),
              ("two", [rec(0, 2.0).to_dict(), rec(1, 2.0).to_dict()])]
    fig = ddp_timeline_figure(panels)
    assert len(fig.axes) == 2
    comm = [c for c in fig.axes[0].collections if c.get_gid() == "comm"]
    assert len(comm) == 4                       # 2 ranks x 2 all-reduces
    assert "4 ms of communication exposed" in fig.axes[1].get_title()
    plt.close(fig)
    rows = predict_bucket_sweep([4000] * 10, [0, 0.01, 1], 0.01, 2, 1e-4, 1e8)
    fig = bucket_sweep_figure(rows, [(0, 0.001), (1, 0.002), (None, 0.01)])
    # the caps, with their bucket counts on a second line (not inside the axes, behind points)
    assert [t.get_text().split("\n")[0] for t in fig.axes[0].get_xticklabels()] == [
        "0",
        "0.01",
        "1",
    ]
    assert any(c.get_gid() == "measured" for c in fig.axes[0].collections)
    plt.close(fig)


@pytest.mark.slow
def test_the_benchmark_times_the_cores(world_of_one):
    """Each variant is the class notebook 04 prints, with the link, recorder and overlap asked."""
    import types

    import torch

    from ddp_lesson.bench.ddp import VARIANTS, _make_variant, _worker_parser
    from ddp_lesson.commsim import Recorder, SimulatedLink
    from ddp_lesson.core.bucketed_ddp import BucketedDDP
    from ddp_lesson.core.naive_ddp import NaiveDDP, sum_all_reduce

    opts = _worker_parser().parse_args(["--width", "4", "--link-bucket-cap-mb", "0.01"])
    env = types.SimpleNamespace(local_rank=0)
    got = {}
    for variant, link in VARIANTS:
        run = _make_variant(variant, link, opts, env, torch.device("cpu"))
        ddp = run["ddp"]
        got[variant, link] = (type(ddp).__name__, getattr(ddp, "overlap", None),
                              type(run["rec"]).__name__, run["cap"])
        if variant != "torch":
            assert type(ddp) in (NaiveDDP, BucketedDDP)
            assert (ddp.comm_hook is sum_all_reduce) == (not link)
            assert isinstance(ddp.comm_hook, SimulatedLink) == link
            assert isinstance(run["rec"], Recorder) == link and ddp.recorder is run["rec"]
    assert got == {
        ("torch", False): ("DistributedDataParallel", None, "NoneType", None),
        ("bucketed", False): ("BucketedDDP", True, "NoneType", None),
        ("naive", False): ("NaiveDDP", None, "NoneType", None),
        ("torch", True): ("DistributedDataParallel", None, "NoneType", None),
        ("bucketed", True): ("BucketedDDP", True, "Recorder", 0.01),
        ("bucketed-no-overlap", True): ("BucketedDDP", False, "Recorder", 0.01),
        ("naive", True): ("NaiveDDP", None, "Recorder", None),
    }
