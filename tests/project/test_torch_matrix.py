"""tools/torch_matrix.py: pytest's JUnit counts read as pytest wrote them, results merged by
version, tier and commit (CONTRIBUTING.md, "Other versions of torch"). The installs and runs
themselves start processes and are not run here."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import torch_matrix  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
failures="2" skipped="3" tests="10" time="1.0"><testcase classname="tests.a" name="test_ok"/>
<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>
<testcase classname="tests.b" name="test_worse"><failure message="y"/></testcase>
<testcase classname="tests.b" name="test_setup"><error message="z"/></testcase>
<testcase classname="tests.c" name="test_skip"><skipped message="s"/></testcase>
</testsuite></testsuites>"""


def _row(version, tier, commit, failed=0, ids=()):
    return {"version": version, "build": "2.x cpu", "tier": tier, "passed": 5, "failed": failed,
            "errors": 0, "skipped": 1, "seconds": 1.5, "commit": commit, "date": "2026-12-06",
            "selection": "all", "failed_ids": list(ids)}


def test_junit_counts_are_pytests(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    counts = torch_matrix.junit_counts(xml)
    assert counts == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3,
                      "failed_ids": ["tests.a::test_bad", "tests.b::test_worse",
                                     "tests.b::test_setup"]}


def test_results_replace_the_same_version_tier_and_commit(tmp_path):
    out, js = tmp_path / "m.csv", tmp_path / "m.json"
    torch_matrix.write_results([_row("2.13.0", "quick", "aaa", 1, ["t::x"]),
                                _row("2.15.0", "quick", "aaa")], out, js)
    merged = torch_matrix.write_results([_row("2.13.0", "quick", "aaa"),
                                         _row("2.13.0", "quick", "bbb")], out, js)
    rows = list(csv.DictReader(open(out)))
    assert rows == merged
    assert [(r["version"], r["commit"], r["failed"]) for r in rows] == [
        ("2.15.0", "aaa", "0"), ("2.13.0", "aaa", "0"), ("2.13.0", "bbb", "0")]
    assert list(rows[0]) == torch_matrix.FIELDS
    assert json.loads(js.read_text())["2.13.0 quick aaa"] == []
    table = torch_matrix.markdown(rows).splitlines()
    assert table[0].startswith("| torch | build | tier |") and len(table) == 2 + 3
    assert table[2] == "| 2.15.0 | 2.x cpu | quick | 5 | 0 | 0 | 1 | 1.5 | aaa |"
