"""Compatibility name for :mod:`ddp_lesson.bench.ddp` (notebook 04 imports ``read_results`` from
here). New code: ``from ddp_lesson.bench.ddp import ...``; run ``ddp-lesson bench ddp``."""
import sys

from .bench.ddp import FIELDS, main, ratios, read_results, summary_lines, write_results

__all__ = ["FIELDS", "main", "ratios", "read_results", "summary_lines", "write_results"]

if __name__ == "__main__":
    sys.exit(main())
