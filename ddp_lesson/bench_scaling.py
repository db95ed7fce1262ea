"""Compatibility name for :mod:`ddp_lesson.bench.scaling` (notebook 05 imports ``read_csv`` from
here and names ``python -m ddp_lesson.bench_scaling``). New code: ``from
ddp_lesson.bench.scaling import ...``; run ``ddp-lesson bench scaling``."""
import sys

from .bench.scaling import CSV_COLUMNS, PHASES, aggregate, efficiency, main, read_csv, write_csv

__all__ = ["CSV_COLUMNS", "PHASES", "aggregate", "efficiency", "main", "read_csv", "write_csv"]

if __name__ == "__main__":
    sys.exit(main())
