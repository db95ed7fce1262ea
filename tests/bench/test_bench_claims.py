"""Every claim the prose makes about the stored benchmarks, classified against benchmarks/*.csv.

A claim says "faster"/"slower" (or "less"/"more" for times) only where the two min..max
intervals over repeats do not overlap, and "within noise" where they do
(:func:`ddp_lesson.bench.claims.compare`). Re-measuring a benchmark so that a stated verdict no
longer holds fails here, naming the claim.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from ddp_lesson.bench.claims import (
    CLAIMS,
    NB04,
    NB05,
    NB06,
    Claim,
    Quantity,
    compare,
    load,
    word,
)

ROOT = Path(__file__).resolve().parents[2]
TABLES = load(ROOT)
#: Files whose text this project's benchmark owner keeps in step with the claims (notebook 06:
#: its learning-rate box); claims for notebooks 04 and 05 are checked against the CSVs here,
#: their sentences by those notebooks' own tests.
CHECKED_PROSE = ("notebooks/deep/03_collective_costs.ipynb", "README.md", "docs/benchmarks.md",
                 "notebooks/deep/01_loss_scaling_and_lr_rules.ipynb", "docs/cheatsheet.md",
                 "notebooks/06_training_the_seed_model.ipynb")


def _prose(path: str) -> str:
    p = ROOT / path
    if p.suffix == ".ipynb":
        text = "\n".join(c.source for c in nbformat.read(p, as_version=4).cells
                         if c.cell_type == "markdown")
    else:
        text = p.read_text()
    return re.sub(r"\s+", " ", text)


def test_compare_is_the_interval_rule():
    assert compare((2.0, 2.5, 3.0), (1.0, 1.5, 1.9)) == "higher"
    assert compare((1.0, 1.5, 1.9), (2.0, 2.5, 3.0)) == "lower"
    assert compare((1.0, 1.5, 2.0), (2.0, 2.5, 3.0)) == "within noise"    # touching: overlap
    assert compare((1.0, 3.0, 5.0), (2.0, 2.1, 2.2)) == "within noise"    # medians apart
    assert word("algbw_GBps", "higher") == "faster" and word("exposed_ms", "lower") == "less"
    assert word("steps_per_s", "within noise") == "within noise"


def test_a_paired_ratio_is_compared_with_one():
    rows = {"ddp": [{"variant": "naive", "link": False, "ratio_to_torch": 0.5,
                     "ratio_to_torch_min": 0.4, "ratio_to_torch_max": 0.9}]}
    q = Quantity("ddp", (("variant", "naive"), ("link", False)), "ratio_to_torch", "naive")
    claim = Claim("t", q, 1.0, "lower", "", "")
    assert claim.verdict(rows) == "lower" and claim.line(rows).endswith(": slower")
    rows["ddp"][0]["ratio_to_torch_max"] = 1.0
    assert claim.verdict(rows) == "within noise"


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.prose.split('/')[-1]}:{c.id}:{c.a.label}"
                                               for c in CLAIMS])
def test_each_claim_holds_in_the_stored_csv(claim):
    got = claim.verdict(TABLES)
    assert got == claim.says, f"{claim.line(TABLES)} — the prose says {claim.says!r}"
    assert word(claim.a.column, claim.says) in claim.sentence


@pytest.mark.parametrize("path", CHECKED_PROSE)
def test_each_claim_is_stated_where_it_says(path):
    text = _prose(path)
    mine = [c for c in CLAIMS if c.prose == path]
    assert mine, f"no claim for {path}"
    missing = {c.sentence for c in mine if re.sub(r"\s+", " ", c.sentence) not in text}
    assert not missing, f"{path} does not state: {missing}"


def test_claims_for_notebooks_04_and_05_exist():
    assert {c.prose for c in CLAIMS} >= {NB04, NB05, NB06}


def test_loss_words_and_the_recipes_seed_intervals():
    assert word("eval_loss", "lower") == "lower" and word("eval_loss", "higher") == "higher"
    rows = {"lr_recipe": [
        {"optimizer": "adam", "global_batch": 32, "rule": r, "lr_mult": 1, "warmup": True,
         "eval_loss": m, "eval_loss_min": m - 0.05, "eval_loss_max": m + 0.05}
        for r, m in (("sqrt", 2.2), ("linear", 2.4), ("none", 2.25))]}

    def q(rule):
        return Quantity("lr_recipe", (("optimizer", "adam"), ("global_batch", 32),
                                      ("rule", rule), ("lr_mult", 1), ("warmup", True)),
                        "eval_loss", rule)

    assert Claim("t", q("sqrt"), q("linear"), "lower", "", "").verdict(rows) == "lower"
    assert Claim("t", q("sqrt"), q("none"), "", "", "").verdict(rows) == "within noise"
    line = Claim("at 32", q("sqrt"), q("linear"), "lower", "", "").line(rows, ".3f",
                                                                      middle=False)
    assert line == "at 32: sqrt (2.150-2.250) vs linear (2.350-2.450): lower"


def test_every_lr_recipe_claim_compares_rows_that_exist_and_did_not_diverge():
    mine = [c for c in CLAIMS if c.a.csv == "lr_recipe"]
    assert len(mine) >= 40
    for c in mine:
        for q in (c.a, c.b):
            (row,) = [r for r in TABLES["lr_recipe"] if all(r[k] == v for k, v in q.row)]
            assert row["diverged"] == 0 and row["seeds"] >= 3, q.label


def _bench_numbers():
    """``tools/bench_numbers.py``, imported as the other tools' tests import theirs."""
    import sys

    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import bench_numbers

    return bench_numbers


def test_the_numbers_docs_benchmarks_quotes_are_the_csvs():
    """tools/bench_numbers.py writes them; this fails until it is run after a re-measurement."""
    tool = _bench_numbers()
    text = (ROOT / "docs/benchmarks.md").read_text()
    assert tool.differences(text, TABLES) == []
    assert {name for name, _ in tool.MARK.findall(text)} == set(tool.NUMBERS)


def test_the_loads_the_readme_quotes_are_the_csvs():
    """The README says under what load each stored benchmark ran (ddp.csv was re-measured)."""
    tool = _bench_numbers()
    text = (ROOT / "README.md").read_text()
    assert {"load_allreduce", "load_scaling", "load_ddp"} <= {n for n, _ in tool.MARK.findall(text)}
    assert tool.differences(text, TABLES) == []


def test_bench_numbers_computes_each_number_from_the_rows():
    tool = _bench_numbers()
    ddp = [{"variant": v, "link": True, "exposed_ms": e, "exposed_ms_min": lo,
            "exposed_ms_max": hi, "load_avg_1min": load}
           for v, e, lo, hi, load in (("bucketed", 6.4, 2.6, 38.2, 8.6),
                                      ("bucketed-no-overlap", 22.6, 15.4, 48.4, 9.4))]
    scaling = [{"mode": m, "nprocs": 1, "comm_exposed_s": s, "load_avg_1min": 11.4}
               for m, s in (("weak", 0.0151), ("strong", 0.0249))]
    tables = {"allreduce": [{"load_avg_1min": x} for x in (5.2, 7.6, 6.0)], "ddp": ddp,
              "scaling": scaling}
    text = " ".join(f"<!-- n:{n} -->?<!-- /n -->" for n in tool.NUMBERS)
    got = dict(tool.MARK.findall(tool.render(text, tables)))
    assert got == {"load_allreduce": "5 to 8", "load_ddp": "9", "load_scaling": "11",
                   "exposed_overlap": "6", "exposed_no_overlap": "23",
                   "range_overlap": "3 to 38", "range_no_overlap": "15 to 48",
                   "one_process_weak_ms": "15", "one_process_strong_ms": "25"}
    assert tool.differences(text, tables)[0] == (
        "load_allreduce: the text says '?', the CSVs '5 to 8'")
    with pytest.raises(KeyError, match="unknown number 'typo'"):
        tool.render("<!-- n:typo -->1<!-- /n -->", tables)
