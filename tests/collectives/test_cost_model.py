"""The α-β cost model's closed forms, algbw/busbw, the benchmark's files and its CLI.

Expected values are worked out by hand from the formulas in Thakur, Rabenseifner & Gropp (2005)
and nccl-tests' PERFORMANCE.md, not taken from the code's output.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from notebook_cells import stream_text

from ddp_lesson.bench import allreduce as bench
from ddp_lesson.cost_model import (
    algbw,
    bus_factor,
    busbw,
    fit_alpha_beta,
    naive_allreduce_time,
    ring_allreduce_time,
    ring_bytes_sent_per_rank,
    tree_allreduce_time,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ALPHA, BETA = 5e-6, 1e-10          # 5 µs, 10 GB/s
DEEP03 = "deep/03_collective_costs.ipynb"   # notebook 03's deep dive on costs
N = 1e8                            # 100 MB


def test_closed_forms_by_hand():
    # R = 4: naive 2·3·(α + nβ) = 6·(5e-6 + 0.01); tree 2·2·(α + nβ); ring 6α + 1.5·nβ
    assert naive_allreduce_time(N, 4, ALPHA, BETA) == pytest.approx(0.06003)
    assert tree_allreduce_time(N, 4, ALPHA, BETA) == pytest.approx(0.04002)
    assert ring_allreduce_time(N, 4, ALPHA, BETA) == pytest.approx(0.01503)
    # R = 5: ceil(log2 5) = 3 tree rounds each way; ring 8α + 1.6·nβ
    assert tree_allreduce_time(N, 5, ALPHA, BETA) == pytest.approx(6 * 0.010005)
    assert ring_allreduce_time(N, 5, ALPHA, BETA) == pytest.approx(8 * 5e-6 + 0.016)
    # R = 2: all three send one message each way
    assert naive_allreduce_time(N, 2, ALPHA, BETA) == pytest.approx(2 * 0.010005)
    assert tree_allreduce_time(N, 2, ALPHA, BETA) == pytest.approx(2 * 0.010005)
    assert ring_allreduce_time(N, 2, ALPHA, BETA) == pytest.approx(2 * 5e-6 + 0.01)


def test_one_rank_costs_nothing():
    for fn in (naive_allreduce_time, tree_allreduce_time, ring_allreduce_time):
        assert fn(N, 1, ALPHA, BETA) == 0.0
    assert bus_factor(1) == 0.0


@pytest.mark.parametrize("R", [2, 3, 4, 8, 16, 64, 1024])
def test_ring_bandwidth_term_is_below_twice_the_message(R):
    t = ring_allreduce_time(N, R, 0.0, BETA)
    assert t == pytest.approx(2 * (R - 1) / R * N * BETA)
    assert t < 2 * N * BETA
    assert ring_bytes_sent_per_rank(N, R) == pytest.approx(2 * (R - 1) / R * N)
    # and never worse than naive or tree for large messages
    assert t <= naive_allreduce_time(N, R, 0.0, BETA)
    assert t <= tree_allreduce_time(N, R, 0.0, BETA) + 1e-15


@pytest.mark.parametrize("R", [2, 3, 4, 8, 16])
def test_busbw_of_an_ideal_ring_is_the_link_bandwidth(R):
    # α = 0: algbw = n / (2(R-1)/R · nβ); busbw = algbw · 2(R-1)/R = 1/β for every R
    a = algbw(N, ring_allreduce_time(N, R, 0.0, BETA))
    assert a == pytest.approx(R / (2 * (R - 1)) / BETA)
    assert busbw(a, R) == pytest.approx(1 / BETA)


def test_bus_factor_values():
    assert bus_factor(2) == 1.0
    assert bus_factor(4) == 1.5
    assert bus_factor(8) == 1.75
    assert busbw(2.0, 4) == 3.0


def test_tree_wins_small_messages_ring_wins_large():
    assert tree_allreduce_time(1e3, 16, ALPHA, BETA) < ring_allreduce_time(1e3, 16, ALPHA, BETA)
    assert ring_allreduce_time(1e8, 16, ALPHA, BETA) < tree_allreduce_time(1e8, 16, ALPHA, BETA)


def test_bad_arguments_name_the_numbers():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        ring_allreduce_time(N, 0, ALPHA, BETA)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        naive_allreduce_time(-1, 2, ALPHA, BETA)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        algbw(N, 0.0)


def test_fit_recovers_alpha_and_beta():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + s * 4e-10 for s in sizes])
    assert alpha == pytest.approx(2e-5, rel=1e-6)
    assert beta == pytest.approx(4e-10, rel=1e-6)
    # latency cannot come out negative: clipped to 0, slope refitted
    alpha, beta = fit_alpha_beta([1e6, 2e6], [0.9e-3, 2e-3])
    assert alpha == 0.0 and beta > 0
    with pytest.raises(ValueError):
        fit_alpha_beta([1e3, 1e3], [1.0, 1.0])


# ----------------------------------------------------------------------------- notebook 03's tables




def test_notebook_03_cost_table_matches_hand_formulas():
    text = stream_text(DEEP03, "for nbytes, label in")
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("R=")]
    expected = []
    for n in (100e6, 4):
        for R in (2, 4, 8, 16):
            naive = 2 * (R - 1) * (ALPHA + n * BETA) * 1e3
            tree = 2 * math.ceil(math.log2(R)) * (ALPHA + n * BETA) * 1e3
            ring = (2 * (R - 1) * ALPHA + 2 * (R - 1) / R * n * BETA) * 1e3
            shown = {"naive": f"{naive:8.3f}", "tree": f"{tree:8.3f}", "ring": f"{ring:8.3f}"}
            low = min(float(v) for v in shown.values())
            best = [k for k, v in shown.items() if float(v) == low]   # ties as printed
            verdict = f"fastest: {best[0]}" if len(best) == 1 else "tie: " + ", ".join(best)
            expected.append(f"  R={R:2d}: naive {shown['naive']} ms  tree {shown['tree']} ms  "
                            f"ring {shown['ring']} ms   {verdict}")
    assert lines == expected
    # a loss value is one float32: 4 bytes; at R = 2 all three print 0.010 ms, a tie
    assert "100 MB (gradients)" in text and "4 bytes (one float32 loss value)" in text
    assert (
        "  R= 2: naive    0.010 ms  tree    0.010 ms  ring    0.010 ms   tie: naive, tree, ring"
        in text.splitlines()
    )
    assert lines[3].endswith("fastest: ring") and lines[5].endswith("fastest: tree")


def test_notebook_03_busbw_table_is_the_link_speed():
    text = stream_text(DEEP03, "for R in (2, 4, 8, 16):\n    a = algbw")
    got = [ln for ln in text.splitlines() if ln.startswith("R=")]
    expected = [f"R={R:2d}: algbw {R / (2 * (R - 1)) * 10:5.2f} GB/s, busbw {10:5.2f} GB/s"
                for R in (2, 4, 8, 16)]
    assert got == expected


def test_notebook_03_prints_each_claim_with_its_interval_and_verdict():
    """The deep dive's measured section prints, from ``ddp_lesson.bench.claims``, every
    comparison its prose makes; tests/bench/test_bench_claims.py checks the verdicts and finds
    the sentences."""
    from ddp_lesson.bench.claims import CLAIMS, NB03, load

    tables = load(ROOT)
    expected = [c.line(tables) for c in CLAIMS if c.prose == NB03]
    got = stream_text(DEEP03, "claim.line(tables)").splitlines()
    assert got == expected and len(got) == 14
    assert all(len(line) <= 100 for line in got)
    assert sum(line.endswith(": within noise") for line in got) == 13


def test_notebook_03_sweep_cell_is_off_by_default():
    text = stream_text(DEEP03, "RUN_SWEEP = False")
    assert text.strip() == "sweep skipped: set RUN_SWEEP = True to re-measure"


# ----------------------------------------------------------------------------- benchmark files


def _row(R, method, size, seconds):
    return bench.summarise(R, method, size, [seconds], 1)


def test_summarise_keeps_min_median_and_max():
    # 3 rounds of 1 MiB on 4 ranks: 2, 1 and 4 ms per call
    row = bench.summarise(4, "gloo", 2**20, [0.002, 0.001, 0.004], 10)
    assert (row["seconds_min"], row["seconds"], row["seconds_max"]) == (0.001, 0.002, 0.004)
    assert row["repeats"] == 3 and row["iters"] == 10
    # bandwidth from time: the slowest round gives the least bandwidth
    assert row["algbw_GBps"] == pytest.approx(2**20 / 0.002 / 1e9)
    assert row["algbw_GBps_min"] == pytest.approx(2**20 / 0.004 / 1e9)
    assert row["algbw_GBps_max"] == pytest.approx(2**20 / 0.001 / 1e9)
    assert row["busbw_GBps_max"] == pytest.approx(row["algbw_GBps_max"] * 1.5)   # 2(R-1)/R
    link = bench.summarise(4, "sendrecv", 2**20, [0.002], 1)
    assert link["busbw_GBps"] == link["algbw_GBps"]                           # per direction


def test_results_round_trip_and_ratios(tmp_path):
    mib = 2**20
    rows = [_row(2, "gloo", 16 * mib, 0.010), _row(2, "pipelined", 16 * mib, 0.008),
            _row(2, "ring", 16 * mib, 0.020), _row(2, "sendrecv", 16 * mib, 0.005),
            _row(2, "gloo", 64 * mib, 0.040), _row(2, "pipelined", 64 * mib, 0.050),
            _row(2, "gloo", 1 * mib, 0.001), _row(2, "pipelined", 1 * mib, 0.010)]
    path = tmp_path / "sub" / "r.csv"
    bench.write_results(rows, path)
    back = bench.read_results(path)
    assert [r["method"] for r in back] == [r["method"] for r in rows]
    assert back[0]["size_bytes"] == 16 * mib and back[0]["nprocs"] == 2
    res = bench.ratios(back)[2]
    # 16 MiB: 0.010/0.008 = 1.25; 64 MiB: 0.040/0.050 = 0.8; 1 MiB is outside 16-64 MiB
    assert res["pipelined_vs_gloo"] == pytest.approx(0.8, rel=1e-3)
    assert res["ring_vs_gloo"] == pytest.approx(0.5, rel=1e-3)
    # busbw(pipelined, R=2) = algbw = 16 MiB / 8 ms; sendrecv bw = 16 MiB / 5 ms -> 0.625
    assert res["busbw_vs_sendrecv"] == pytest.approx(0.625, rel=1e-3)


def test_parse_rows_reads_only_row_lines():
    row = bench.summarise(4, "gloo", 65536, [1e-3], 50)
    import json

    lines = ["hello", "BENCH_ROW " + json.dumps(row), "[rank 0] noise"]
    assert bench.parse_rows(lines) == [row]


def test_stored_benchmark_covers_the_sweep():
    path = ROOT / "benchmarks" / "allreduce.csv"
    assert (ROOT / "benchmarks" / "allreduce.png").stat().st_size > 1000
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == bench.FIELDS
    rows = bench.read_results(path)
    assert {r["nprocs"] for r in rows} == {2, 4}
    for R in (2, 4):
        for method in ("gloo", "ring", "pipelined", "sendrecv"):
            sizes = {r["size_bytes"] for r in rows if r["nprocs"] == R and r["method"] == method}
            assert {64 * 2**10, 64 * 2**20} <= sizes, (R, method)
    for r in rows:
        assert r["seconds"] > 0 and r["algbw_GBps"] > 0 and r["repeats"] >= 3
        assert r["seconds_min"] <= r["seconds"] <= r["seconds_max"]
        assert r["algbw_GBps_min"] <= r["algbw_GBps"] <= r["algbw_GBps_max"]
        assert r["algbw_GBps"] == pytest.approx(
            r["size_bytes"] / r["seconds"] / 1e9, rel=1e-3, abs=1e-4
        )
        factor = 1.0 if r["method"] in bench.LINK_METHODS else 2 * (r["nprocs"] - 1) / r["nprocs"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor, rel=1e-3, abs=1e-4)
    assert set(bench.ratios(rows)[2]) >= {"pipelined_vs_gloo", "busbw_vs_sendrecv"}


def test_figures_from_rows():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_lesson.viz.collectives import allreduce_bandwidth_figure, cost_model_figure

    rows = bench.read_results(ROOT / "benchmarks" / "allreduce.csv")
    fig = allreduce_bandwidth_figure(rows)
    assert len(fig.axes) == 2
    plt.close(fig)
    fig = cost_model_figure(rows)
    alpha, beta = fig.alpha_beta
    assert alpha >= 0 and beta > 0
    plt.close(fig)
    with pytest.raises(ValueError):
        cost_model_figure([r for r in rows if r["method"] != "sendrecv"])


@pytest.mark.slow
def test_bench_cli_runs_a_tiny_sweep(tmp_path):
    from ddp_lesson.cli import main

    out = tmp_path / "a.csv"
    rc = main(["bench", "allreduce", "--nprocs", "2", "--sizes-kib", "64",
               "--methods", "gloo,ring,pipelined,naive,sendrecv", "--repeats", "2",
               "--budget-mib", "0.0625", "--out", str(out), "--timeout", "90"])
    assert rc == 0
    rows = bench.read_results(out)
    got = {(r["method"], r["size_bytes"]) for r in rows}
    assert {("gloo", 65536), ("ring", 65536), ("pipelined", 65536), ("naive", 65536),
            ("sendrecv", 65536), ("sendrecv", 1024)} <= got
    for r in rows:
        assert r["repeats"] == 2 and r["seconds_min"] <= r["seconds"] <= r["seconds_max"]
    assert out.with_suffix(".png").exists()
