"""The learning-rate recipe's experiment (ddp_lesson.bench.lr_recipe) and its stored results.

The experiment's design (same samples at both batches, the scaled rates, the warm-up counted in
samples), a tiny run in this process, the stored CSV checked against the design and against its
own per-seed values, one stored run replayed, and what notebook 01's deep dive and the
cheatsheet print and say about it. The comparisons themselves (lower / higher / within noise
over the seeds' min..max) are classified in test_bench_claims.py.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402

from ddp_lesson.bench import lr_recipe as lr  # noqa: E402
from ddp_lesson.bench.claims import CLAIMS, NB01, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "benchmarks" / "lr_recipe.csv"
ROWS = lr.read_csv(CSV)
NOTEBOOK = ROOT / NB01


def _key(row):
    return (row["optimizer"], row["global_batch"], row["rule"], row["lr_mult"], row["warmup"])


def _vkey(v):
    return (v.optimizer, v.global_batch, v.rule, v.lr_mult, v.warmup)


def test_the_plan_sees_the_same_samples_at_both_batches():
    plan = lr.plan()
    assert len(plan) == 14 and {v.optimizer for v in plan} == {"adam", "sgd"}
    for v in plan:
        steps, warm = v.schedule(lr.SAMPLES)
        assert steps * v.global_batch == 4800
        assert warm == (steps // 10 if v.warmup else 0)      # a tenth of the samples
    small = lr.Variant("adam", 8).schedule(4800)
    big = lr.Variant("adam", 32).schedule(4800)
    assert small == (600, 60) and big == (150, 15)           # 4x the batch: 1/4 of the steps
    base = lr.BASE_LR["adam"]
    assert lr.Variant("adam", 32, "none").lr() == base
    assert lr.Variant("adam", 32, "sqrt").lr() == pytest.approx(2 * base)
    assert lr.Variant("adam", 32, "linear").lr() == pytest.approx(4 * base)
    assert lr.Variant("sgd", 8, "none", 0.5).lr() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="samples 100 must be a multiple of the global batch 32"):
        lr.Variant("sgd", 32).schedule(100)
    with pytest.raises(ValueError, match="optimizer 'lamb' is not one of adam, sgd"):
        lr._optimizer("lamb", [], 0.1)


def test_a_tiny_run_in_this_process(tmp_path):
    split = lr.corpus_split()
    v = lr.Variant("sgd", 32, "linear")
    a = lr.train_once(v, 0, samples=64, split=split)
    assert math.isfinite(a) and 3.0 < a < 5.0                 # ln(103) = 4.63 at the start
    assert lr.train_once(v, 0, samples=64, split=split) == a  # a seed is a seed
    assert lr.train_once(v, 1, samples=64, split=split) != a
    lines = []
    rows = lr.run(seeds=(0, 1), samples=64, optimizers=("sgd",), out=tmp_path / "lr.csv",
                  echo=lines.append)
    assert [_key(r) for r in rows] == [_vkey(v) for v in lr.plan(("sgd",))]
    assert rows[5]["eval_loss_per_seed"].split()[0] == f"{a:.4f}"   # sgd 32 linear, seed 0
    back = lr.read_csv(tmp_path / "lr.csv")
    assert list(back[0]) == list(lr.CSV_COLUMNS) and back[5]["warmup"] is True
    assert lines[0].startswith("sgd, batch 8, lr x0.5, warm-up, lr 0.05: ")


def test_a_diverged_seed_is_counted_not_averaged():
    row = lr.summarise(lr.Variant("sgd", 32, "linear"), [2.5, float("nan"), 2.7], 4800)
    assert row["diverged"] == 1 and row["eval_loss"] == pytest.approx(2.6)
    assert (row["eval_loss_min"], row["eval_loss_max"]) == (2.5, 2.7)
    assert lr.line(row).endswith(", 1 of 3 diverged")
    none = lr.summarise(lr.Variant("sgd", 32), [float("nan")] * 2, 4800)
    assert "eval_loss" not in none and lr.line(none).endswith("diverged, 2 of 2 diverged")


def test_bad_seeds_are_refused(capsys):
    with pytest.raises(SystemExit):
        lr.main(["--seeds", "0"])
    assert "--seeds needs at least 2 seeds for a spread, got 1" in capsys.readouterr().err


def test_the_stored_csv_is_the_plan_with_its_own_statistics():
    assert [_key(r) for r in ROWS] == [_vkey(v) for v in lr.plan()]
    for r, v in zip(ROWS, lr.plan()):
        seeds = [float(x) for x in r["eval_loss_per_seed"].split()]
        assert r["seeds"] == len(seeds) == 3 and r["diverged"] == 0
        assert r["samples"] == 4800 and (r["steps"], r["warmup_steps"]) == v.schedule(4800)
        assert r["lr"] == pytest.approx(v.lr(), rel=1e-3)
        assert r["eval_loss"] == pytest.approx(statistics.fmean(seeds), abs=1e-3)
        assert r["eval_loss_std"] == pytest.approx(statistics.stdev(seeds), rel=2e-3, abs=1e-4)
        assert (r["eval_loss_min"], r["eval_loss_max"]) == pytest.approx(
            (min(seeds), max(seeds)), abs=1e-3)


def test_one_stored_run_replays():
    """The stored file is what this code writes: SGD at batch 32 without scaling, seed 0, run
    again (150 steps). One thread and a fixed seed give the same number on one machine; the
    tolerance leaves room for another CPU's rounding, far below the gaps the prose claims."""
    row = next(r for r in ROWS if _key(r) == ("sgd", 32, "none", 1, True))
    got = lr.train_once(lr.Variant("sgd", 32, "none"), 0)
    assert got == pytest.approx(float(row["eval_loss_per_seed"].split()[0]), abs=0.01)


def _notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


def _prose(text):
    return re.sub(r"\s+", " ", text)


def test_the_notebook_draws_the_stored_file_and_prints_what_it_holds():
    nb = _notebook()
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and "lr_recipe" in c.source]
    assert 'read_csv("../../benchmarks/lr_recipe.csv")' in cell.source
    assert "train_once" not in cell.source and "run(" not in cell.source  # reads, never reruns
    out = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    tables = load(ROOT)
    expected = ["final eval loss, mean ± std (min-max) over 3 seeds:"]
    expected += [lr.line(r) for r in ROWS]
    expected += list(dict.fromkeys(c.line(tables, ".3f", middle=False) for c in CLAIMS
                                   if c.prose == NB01))
    assert out.splitlines() == expected
    assert max(len(x) for x in expected) < 100
    assert any("image/png" in o.get("data", {}) for o in cell.outputs)


def test_the_setup_the_prose_states_is_the_scripts():
    text = _prose("\n".join(c.source for c in _notebook().cells if c.cell_type == "markdown"))
    steps = {r["global_batch"]: r["steps"] for r in ROWS}
    assert (lr.BASE_BATCH, lr.FACTOR * lr.BASE_BATCH, lr.SAMPLES) == (8, 32, 4800)
    assert steps == {8: 600, 32: 150}
    assert ("at a base global batch of 8 sequences and at 4 times it, 32, on the same 4,800 "
            "training sequences: batch 32 takes a quarter of the steps (150 against 600)") in text
    assert lr.MODEL == {"block_size": 32, "n_embd": 32, "n_head": 2, "n_layer": 2}
    assert "TinyGPT (2 layers, width 32, 32-token windows" in text
    assert lr.BASE_LR == {"adam": 0.004, "sgd": 0.1}
    assert "Adam (base learning rate 0.004)" in text and "(base 0.1)" in text
    assert (lr.WARMUP_FRACTION, lr.FLOOR, lr.SWEEP) == (0.1, 0.1, (0.5, 1.0, 2.0))
    assert "a warm-up over the first tenth of the samples" in text
    assert "decays to a tenth of its peak (cosine)" in text
    assert "Three seeds each" in text and lr.SEEDS == (0, 1, 2)
    assert all(r["diverged"] == 0 for r in ROWS) and "no run diverged" in text


def test_the_recipe_box_names_the_packages_functions():
    text = _prose("\n".join(c.source for c in _notebook().cells if c.cell_type == "markdown"))
    for needle in ("`global = micro × accumulation × world_size`",
                   "`accumulation_steps(global, micro, world_size)`",
                   "`scale_lr(η, base, global, rule)`", "warmup_cosine(s, steps, warmup_steps)",
                   "the trainer's `--lr-scaling`", "arXiv:2205.10287"):
        assert needle in text, needle
    cheat = _prose((ROOT / "docs" / "cheatsheet.md").read_text())
    assert "`global = micro × accumulation × world_size`" in cheat
    assert "`ddp_lesson.gradients.accumulation_steps`" in cheat and "`warmup_cosine`" in cheat
    from ddp_lesson import gradients

    assert {"accumulation_steps", "scale_lr", "warmup_cosine"} <= set(gradients.__all__)


def test_the_figure_draws_every_row():
    from ddp_lesson.viz.training import lr_recipe_figure

    fig = lr_recipe_figure(ROWS)
    try:
        assert [ax.get_title() for ax in fig.axes] == ["Adam", "SGD, momentum 0.9"]
        for ax in fig.axes:
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            assert ticks == ["8\nlr x0.5", "8\nlr x1", "8\nlr x2", "32\nnone", "32\nsqrt",
                             "32\nlinear", "32\nlinear\nno warm-up"]
            assert len(ax.containers) == 7                   # one error bar per configuration
        for ax, opt in zip(fig.axes, ("adam", "sgd")):       # the band: batch 8, base lr
            base = next(r for r in ROWS if _key(r) == (opt, 8, "none", 1, True))
            band = ax.patches[0]
            assert (band.get_y(), band.get_y() + band.get_height()) == pytest.approx(
                (base["eval_loss_min"], base["eval_loss_max"]))
    finally:
        plt.close(fig)
