"""The scaling study (ddp_lesson.bench.scaling) and the training figures (ddp_lesson.viz.training).

No timing is asserted: the arithmetic (efficiency, medians, spread), the CSV round trip, the
stored benchmark's consistency, one tiny timed run in this process, and the figures' data.
"""
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from ddp_lesson.bench import scaling as bs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _run(mode, nprocs, sps, b=8, step_s=None):
    phases = {p: 0.001 * (i + 1) for i, p in enumerate(bs.PHASES)}
    return {"mode": mode, "nprocs": nprocs, "batch_per_rank": b, "global_batch": b * nprocs,
            "steps": 10, "samples_per_s": sps, "step_s": step_s or b * nprocs / sps,
            "phases": phases, "load_avg_1min": 1.0}


def test_efficiency_definition():
    assert bs.efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    assert bs.efficiency(100.0, 1, 100.0) == 1.0
    with pytest.raises(ValueError, match="nprocs=0"):
        bs.efficiency(1.0, 0, 1.0)


def test_aggregate_medians_spread_and_efficiency():
    runs = [_run("weak", 1, s) for s in (90.0, 100.0, 120.0)]
    runs += [_run("weak", 2, s) for s in (170.0, 180.0, 175.0)]
    runs += [_run("strong", 1, s, b=16) for s in (95.0, 100.0, 105.0)]
    runs += [_run("strong", 2, s) for s in (170.0, 180.0, 175.0)]
    rows = bs.aggregate(runs)
    assert [(r["mode"], r["nprocs"]) for r in rows] == [("weak", 1), ("weak", 2), ("strong", 1),
                                                         ("strong", 2)]
    w1, w2, s1, s2 = rows
    assert (w1["samples_per_s"], w1["samples_per_s_min"], w1["samples_per_s_max"]) == \
        (100.0, 90.0, 120.0)
    assert w1["spread_pct"] == pytest.approx(30.0)
    assert w1["efficiency"] == 1.0
    assert w2["efficiency"] == pytest.approx(175.0 / (2 * 100.0))
    assert w2["efficiency_best"] == pytest.approx(180.0 / (2 * 120.0))
    assert s2["efficiency"] == pytest.approx(175.0 / (2 * 100.0))
    assert w2["global_batch"] == 16 and w2["repeats"] == 3
    assert w1["data_s"] == pytest.approx(0.001) and w1["other_s"] == pytest.approx(0.006)


def test_csv_round_trip(tmp_path):
    rows = bs.aggregate([_run("weak", 1, 100.0), _run("weak", 2, 150.0)])
    path = tmp_path / "b" / "scaling.csv"
    bs.write_csv(rows, str(path))
    back = bs.read_csv(str(path))
    assert list(back[0]) == list(bs.CSV_COLUMNS)
    assert back[1]["nprocs"] == 2 and back[1]["efficiency"] == pytest.approx(0.75)


def test_plan_refuses_a_global_batch_that_does_not_split(capsys):
    args = bs._parser().parse_args(["--nprocs", "1", "3", "--global-batch", "16"])
    with pytest.raises(SystemExit, match="--global-batch 16 is not divisible by 3 processes"):
        bs.plan(args)
    args = bs._parser().parse_args([])
    assert bs.plan(args) == [("weak", 1, 8), ("weak", 2, 8), ("weak", 4, 8), ("strong", 1, 16),
                             ("strong", 2, 8), ("strong", 4, 4)]


def test_stored_benchmark_is_consistent():
    rows = bs.read_csv(str(REPO / "benchmarks" / "scaling.csv"))
    assert {(r["mode"], r["nprocs"]) for r in rows} == {(m, n) for m in ("weak", "strong")
                                                        for n in (1, 2, 4)}
    one = {r["mode"]: r["samples_per_s"] for r in rows if r["nprocs"] == 1}
    best = {r["mode"]: r["samples_per_s_max"] for r in rows if r["nprocs"] == 1}
    for r in rows:
        expected = r["samples_per_s"] / (r["nprocs"] * one[r["mode"]])
        assert r["efficiency"] == pytest.approx(expected, rel=2e-3)
        expected = r["samples_per_s_max"] / (r["nprocs"] * best[r["mode"]])
        assert r["efficiency_best"] == pytest.approx(expected, rel=2e-3)
        assert r["samples_per_s_min"] <= r["samples_per_s"] <= r["samples_per_s_max"]
        assert r["global_batch"] == r["batch_per_rank"] * r["nprocs"]
        assert r["global_batch"] == (16 if r["mode"] == "strong" else 8 * r["nprocs"])
        assert r["repeats"] >= 3
    assert (REPO / "benchmarks" / "scaling.png").stat().st_size > 1000


def test_stored_benchmark_spread_printed_in_notebook_05():
    """Notebook 06's deep dive prints each configuration's spread over repeats; recomputed from the
    CSV's min, max and median with the csv module alone."""
    import csv

    with open(REPO / "benchmarks" / "scaling.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    spread = {f"{r['mode'][0]}{r['nprocs']}": 100 * (float(r["samples_per_s_max"])
                                                  - float(r["samples_per_s_min"]))
              / float(r["samples_per_s"]) for r in rows}
    assert {k: f"{v:.0f}%" for k, v in spread.items()} == {
        "w1": "63%", "w2": "68%", "w4": "32%", "s1": "25%", "s2": "68%", "s4": "41%"}
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / "deep" / "06_scaling_and_mixed_precision.ipynb",
                       as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "spread_pct" in c.source)
    printed = "".join(o.get("text", "") for o in cell.outputs)
    assert ", ".join(f"{k} {v:.0f}%" for k, v in spread.items()) in printed
    for r in rows:
        assert float(r["spread_pct"]) == pytest.approx(spread[f"{r['mode'][0]}{r['nprocs']}"],
                                                       rel=1e-2)


def test_one_timed_run_in_this_process(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    spec = {"batch_per_rank": 2, "steps": 2, "warmup": 1, "model": "tiny", "width": 4,
            "size": [16, 32], "ddp": "torch"}
    before = torch.get_num_threads()
    try:
        assert bs.main(["worker", json.dumps(spec)]) == 0
    finally:
        torch.set_num_threads(before)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("BENCH_RESULT ")
    res = json.loads(line[len("BENCH_RESULT "):])
    assert (res["nprocs"], res["batch_per_rank"], res["global_batch"], res["steps"]) == \
        (1, 2, 2, 2)
    assert set(res["phases"]) == set(bs.PHASES)
    assert all(v >= 0 for v in res["phases"].values())
    assert math.isclose(res["samples_per_s"], 2 / res["step_s"])


# ---- figures -------------------------------------------------------------------------------

def test_loss_curves_figure_draws_the_curves_and_differences():
    from ddp_lesson.viz.training import loss_curves_figure

    curves = {"one": [3.0, 2.0, 1.0], "two": [3.0, 2.0001, 1.001]}
    fig = loss_curves_figure(curves, reference="one")
    left, right = fig.axes[:2]
    assert [list(l.get_ydata()) for l in left.get_lines()] == [curves["one"], curves["two"]]
    (delta,) = right.get_lines()
    assert list(delta.get_ydata()) == pytest.approx([1e-9, 1e-4, 1e-3], rel=1e-3)
    plt.close(fig)


def test_scaling_figure_draws_every_row():
    from ddp_lesson.viz.training import scaling_figure

    rows = bs.aggregate([_run("weak", 1, 100.0), _run("weak", 2, 150.0),
                         _run("strong", 1, 90.0, b=16), _run("strong", 2, 150.0)])
    fig = scaling_figure(rows)
    ax, bx = fig.axes[:2]
    assert len(bx.patches) == 4 * len(bs.PHASES)  # one stacked bar per (mode, R)
    assert [t.get_text() for t in bx.get_xticklabels()] == ["w1", "w2", "s1", "s2"]
    plt.close(fig)
