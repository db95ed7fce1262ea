"""Write the README's core-path table and deep-dive list from the notebooks themselves.

    python tools/readme_tables.py            # rewrite the two blocks in README.md
    python tools/readme_tables.py --check    # exit 1 if README.md differs from what they say

It also writes the number of exercises with a checker ("the ones you can code (N of them"),
counted in ``ddp_lesson.exercises.REGISTRY``. Each core notebook's first cell states its reading
and run time ("Reading time: about N
minutes ... Run time: about S s"); its title is the first cell's heading. A deep dive's title is
its first heading, and it branches from the core notebook with the same two-digit number.
``tests/notebooks/test_readme_tables.py`` fails when the README's blocks drift from the notebooks.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: What each core notebook shows, in a line (the README's last column).
SHOWS = {
    "00_setup": "torchrun, ranks and world size, the backend rule, a first all_reduce, what the "
                "launcher does for you, failures",
    "01_data_parallelism": "why averaging shard gradients equals the global-batch gradient; sum vs "
                           "mean loss; unequal shards",
    "02_sampler_sharding": "how a DistributedSampler splits a dataset (the core printed whole); "
                           "`set_epoch`; padding duplicates and exact evaluation",
    "03_collectives": "send/recv and the collectives; the ring all-reduce from scratch (printed "
                      "whole) with a stepper widget",
    "04_ddp_from_scratch": "NaiveDDP and BucketedDDP (printed whole) equal to torch's DDP; "
                           "buckets, overlap with backward; `no_sync`",
    "05_your_script_data_parallel": "a complete single-process script converted to DDP: the diff, "
                                    "each change explained, both run, equal weights",
    "06_training_the_seed_model": "the seed program part by part, now correct: SyncBatchNorm, "
                                  "accumulation, checkpoint and exact resume",
    "07_failures_and_multinode": "kill a worker, torchrun restarts it, bit-identical recovery; two "
                                 "agents as two nodes; the hang clinic",
    "08_beyond_ddp_zero_fsdp": "memory per rank under DDP and ZeRO; when to shard, by arithmetic "
                               "with activations; ZeRO-1 from scratch on a tiny GPT",
    "09_how_fast_a_step_can_go": "FLOPs counted by torch, published GPUs and links: the "
                                 "compute-bound batch, efficiency at 2/8/64 GPUs; a calculator",
}
TIMES = re.compile(r"Reading time:\s+about\s+(\d+)\s+minutes?.*?Run time:\s+about\s+(\d+)\s*s\b",
                   re.S)


def _first_heading(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "?"


def core_table() -> str:
    rows = ["| notebook | reading | run | what it shows |", "|---|---|---|---|"]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        m = TIMES.search(nb.cells[0].source)
        reading, run = (f"{m.group(1)} min", f"{m.group(2)} s") if m else ("?", "?")
        title = _first_heading(nb).split(":")[0]
        rows.append(f"| [{title}](notebooks/{path.name}) | {reading} | {run} | "
                    f"{SHOWS.get(path.stem, '')} |")
    return "\n".join(rows)


def deep_list() -> str:
    items = []
    for path in sorted((ROOT / "notebooks" / "deep").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        m = TIMES.search(nb.cells[0].source)
        reading = f", {m.group(1)} min" if m else ""
        items.append(f"- [{_first_heading(nb)}](notebooks/deep/{path.name}) "
                     f"(from {path.name[:2]}{reading})")
    return "\n".join(items) or "- (none yet)"


CHECKERS = re.compile(r"(the ones you can code \()\d+( of them)")


def checker_count() -> int:
    """How many exercises have a checker: the registry filled by ``exercises.catalog``."""
    import ddp_lesson.exercises.catalog  # noqa: F401  (registers them)
    from ddp_lesson.exercises import registry

    return len(registry.REGISTRY)


def render(readme: str) -> str:
    if not CHECKERS.search(readme):
        raise SystemExit("README.md no longer says 'the ones you can code (N of them'")
    readme = CHECKERS.sub(lambda m: f"{m.group(1)}{checker_count()}{m.group(2)}", readme)
    for name, block in (("core-path", core_table()), ("deep-dives", deep_list())):
        start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no {start} ... {end} block")
        readme = pattern.sub(lambda _m, b=block, s=start, e=end: f"{s}\n{b}\n{e}", readme)
    return readme


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    opts = p.parse_args(argv)
    old = README.read_text()
    new = render(old)
    if opts.check:
        return 0 if new == old else 1
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
