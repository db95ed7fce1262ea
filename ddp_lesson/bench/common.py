"""What the three benchmarks share: the flags, the one CSV writer/reader, spreads, figures.

Every benchmark (``ddp-lesson bench allreduce|ddp|scaling``) takes :func:`add_common_flags`;
every row keeps min, median and max over its repeats (:func:`spread`), so a difference can be
told from noise (:func:`ddp_lesson.bench.claims.compare`). Imports nothing else from the
package at import time: the benchmark modules import it, never the other way round.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

#: ``--figure none`` (any case) skips the figure, for every benchmark.
NO_FIGURE = "none"


def parse_counts(values) -> list[int]:
    """``["2,4"]`` or ``["2", "4"]`` -> ``[2, 4]``. Raises ValueError on a count below 1."""
    out = []
    for v in values if isinstance(values, (list, tuple)) else [values]:
        try:
            out += [int(s) for s in str(v).split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--nprocs needs whole counts >= 1, got {values!r}") from None
    bad = [n for n in out if n < 1]
    if bad or not out:
        raise ValueError(f"--nprocs needs counts >= 1, got {values!r}")
    return out


def add_common_flags(p: argparse.ArgumentParser, *, nprocs: str, repeats: int, out: str,
                     backend: str | None = "gloo", timeout_s: float = 900.0) -> None:
    """Add the launcher flags every benchmark shares, with this benchmark's defaults."""
    p.add_argument("--nprocs", nargs="+", default=[nprocs],
                   help=f"process counts, one torchrun job each: '2,4' or '2 4' (default {nprocs})")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"repeats of every measurement; min, median and max are kept "
                        f"(default {repeats})")
    p.add_argument("--out", "--csv", dest="out", default=out, help=f"CSV to write (default {out})")
    p.add_argument("--figure", default=None,
                   help="PNG to write (default: the CSV's name with .png; 'none' skips it)")
    p.add_argument("--backend", default=backend,
                   help=f"gloo, nccl or auto (default {backend or 'auto'})")
    p.add_argument("--timeout", type=float, default=timeout_s,
                   help=f"seconds per torchrun job (default {timeout_s:g})")


def check_common(opts) -> None:
    """Refuse bad values of :func:`add_common_flags`' flags before any process starts.

    Raises:
        ValueError: a message naming the flag and the value (``--repeats must be >= 1, got 0``).
    """
    parse_counts(opts.nprocs)
    at_least(opts, repeats=1)
    if not opts.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {opts.timeout:g}")
    if opts.backend not in (None, "auto", "gloo", "nccl"):
        raise ValueError(f"--backend must be gloo, nccl or auto, got {opts.backend!r}")


def at_least(opts, **lowest) -> None:
    """Raise ValueError ``--flag must be >= low, got value`` for the first flag below its low."""
    for name, low in lowest.items():
        value = getattr(opts, name)
        if value is not None and not value >= low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low:g}, got {value:g}")


def figure_target(opts) -> str | None:
    """The PNG path ``opts.figure`` asks for: None for ``none``, the CSV's ``.png`` by default."""
    if opts.figure is None:
        return str(Path(opts.out).with_suffix(".png"))
    return None if opts.figure.lower() == NO_FIGURE else opts.figure


def save_figure(make, rows, path: str | None) -> str | None:
    """Draw ``make(rows)`` into ``path`` (folder created) with a non-interactive backend."""
    if path is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = make(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_figure(make, rows, opts) -> str | None:
    """Save ``make(rows)`` where ``opts.figure`` asks (:func:`figure_target`) and print
    ``wrote PATH``; nothing for ``--figure none``. Returns the path or None."""
    path = save_figure(make, rows, figure_target(opts))
    if path:
        print(f"wrote {path}")
    return path


def main_or_worker(argv, worker, prog: str, description: str, add_arguments, run,
                   check=None) -> int:
    """A benchmark module's ``main``: ``worker ARGS`` runs one rank's part under torchrun;
    else parse ``add_arguments``' flags, ``check(opts)`` (ValueError: ``prog: error: ...``,
    status 2), ``run(opts)``. ``argv`` None: ``sys.argv[1:]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    opts = p.parse_args(argv)
    try:
        if check is not None:
            check(opts)
    except ValueError as exc:
        p.error(str(exc))
    return run(opts)


def spread(values) -> tuple[float, float, float]:
    """``(min, median, max)`` of repeated measurements. Raises ValueError when empty."""
    values = list(values)
    if not values:
        raise ValueError("no measurements to summarise")
    return min(values), statistics.median(values), max(values)


def load_avg() -> float:
    """The machine's 1-minute load average (NaN where the OS has none): the noise's main source."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def write_rows(rows: list[dict], path, fields, float_digits: int | None = 4) -> None:
    """The benchmarks' one CSV writer: ``rows`` with the columns ``fields`` (missing and None:
    empty cells), floats to ``float_digits`` significant digits (None: as they are)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        for row in rows:
            w.writerow({k: _cell(row.get(k), float_digits) for k in fields})


def _cell(v, float_digits):
    if v is None:
        return ""
    if float_digits is not None and isinstance(v, float):
        return f"{v:.{float_digits}g}"
    return v


def read_rows(path, text=(), bools=()) -> list[dict]:
    """Rows of a benchmark CSV: columns in ``text`` stay strings, ``bools`` become bool,
    empty cells None, whole numbers int, the rest float."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            rows.append({k: _parse(k, v, text, bools) for k, v in raw.items()})
    return rows


def _parse(key, v, text, bools):
    if key in text:
        return v
    if key in bools:
        return v == "True"
    if v == "":
        return None
    try:
        return int(v)
    except ValueError:
        return float(v)
