"""Write the numbers docs/benchmarks.md and README.md quote from the stored CSVs
(``benchmarks/*.csv``).

    python tools/bench_numbers.py            # rewrite every marked number in the text
    python tools/bench_numbers.py --check    # exit 1, naming each number that differs

A quoted number is marked with its name, ``<!-- n:NAME -->6<!-- /n -->`` (an HTML comment shows
as nothing), and :data:`NUMBERS` says how each is computed from the CSVs. Re-measuring a
benchmark and running this tool updates the text; ``tests/bench/test_bench_claims.py`` fails
while the text and the CSVs disagree, and for a marked name this tool does not know.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
#: every file whose marked numbers this tool writes (README: the loads the runs were measured at)
DOCS = (DOC, ROOT / "README.md")
MARK = re.compile(r"<!-- n:(\w+) -->(.*?)<!-- /n -->")


def _loads(tables, name):
    return [r["load_avg_1min"] for r in tables[name]]


def _ddp(tables, variant, column):
    (row,) = [r for r in tables["ddp"] if r["variant"] == variant and r["link"]]
    return row[column]


def _one_process_ms(tables, mode):
    (row,) = [r for r in tables["scaling"] if r["nprocs"] == 1 and r["mode"] == mode]
    return f"{row['comm_exposed_s'] * 1e3:.0f}"


#: name -> the text computed from the tables (``ddp_lesson.bench.claims.load``)
NUMBERS = {
    "load_allreduce": lambda t: f"{min(_loads(t, 'allreduce')):.0f} to "
                                f"{max(_loads(t, 'allreduce')):.0f}",
    "load_ddp": lambda t: f"{statistics.median(_loads(t, 'ddp')):.0f}",
    "load_scaling": lambda t: f"{statistics.mean(_loads(t, 'scaling')):.0f}",
    "exposed_overlap": lambda t: f"{_ddp(t, 'bucketed', 'exposed_ms'):.0f}",
    "exposed_no_overlap": lambda t: f"{_ddp(t, 'bucketed-no-overlap', 'exposed_ms'):.0f}",
    "range_overlap": lambda t: f"{_ddp(t, 'bucketed', 'exposed_ms_min'):.0f} to "
                               f"{_ddp(t, 'bucketed', 'exposed_ms_max'):.0f}",
    "range_no_overlap": lambda t: f"{_ddp(t, 'bucketed-no-overlap', 'exposed_ms_min'):.0f} to "
                                  f"{_ddp(t, 'bucketed-no-overlap', 'exposed_ms_max'):.0f}",
    "one_process_weak_ms": lambda t: _one_process_ms(t, "weak"),
    "one_process_strong_ms": lambda t: _one_process_ms(t, "strong"),
}


def render(text: str, tables: dict) -> str:
    """``text`` with every marked number computed again from ``tables``.

    Raises:
        KeyError: a marked name that :data:`NUMBERS` does not know.
    """
    def fill(m):
        if m.group(1) not in NUMBERS:
            raise KeyError(f"docs/benchmarks.md marks an unknown number {m.group(1)!r}")
        return f"<!-- n:{m.group(1)} -->{NUMBERS[m.group(1)](tables)}<!-- /n -->"

    return MARK.sub(fill, text)


def differences(text: str, tables: dict) -> list[str]:
    """``name: text says X, the CSVs Y`` for each marked number that differs."""
    want = dict(MARK.findall(render(text, tables)))
    return [f"{name}: the text says {said!r}, the CSVs {want[name]!r}"
            for name, said in MARK.findall(text) if said != want[name]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from ddp_lesson.bench.claims import load

    tables = load(ROOT)
    if args.check:
        diff = [f"{doc.relative_to(ROOT)}: {d}" for doc in DOCS
                for d in differences(doc.read_text(), tables)]
        print("\n".join(diff) or "docs/benchmarks.md and README.md quote the CSVs")
        return 1 if diff else 0
    for doc in DOCS:
        doc.write_text(render(doc.read_text(), tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
