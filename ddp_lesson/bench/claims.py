"""What the prose says about the stored benchmarks, each claim checked against the CSVs.

A benchmark row keeps the minimum, median and maximum over its repeats. Two measurements are
told apart only when their min..max intervals do not overlap; otherwise the difference is
**within noise**, whatever the medians say. :func:`compare` is that rule, and :data:`CLAIMS`
lists every comparison that the README, notebook 03's deep dive
(``notebooks/deep/03_collective_costs.ipynb``) and ``docs/benchmarks.md`` state (and the ones
notebooks 04 and 06 should state), with the verdict the prose uses. ``tests/
test_bench_claims.py`` classifies each claim against ``benchmarks/*.csv`` and finds its sentence
in the file that makes it, so re-measuring a benchmark makes any claim that no longer holds fail.

Words: for rates (bandwidth, steps/s, samples/s, a ratio of rates) ``faster``/``slower``; for
times (exposed communication) ``less``/``more``; ``within noise`` when the intervals overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .common import read_rows

#: Columns where less is better (times); every other measured column is a rate.
TIME_COLUMNS = ("seconds", "exposed_ms", "step_s", "comm_exposed_s")
_TEXT = {"allreduce": ("method",), "ddp": ("variant",), "scaling": ("mode",)}
_BOOLS = {"ddp": ("link",)}
MIB = 2**20


@dataclass(frozen=True)
class Quantity:
    """One measured column of one CSV row, with its min..max over repeats.

    ``row`` selects the row: ``(("nprocs", 2), ("method", "gloo"), ...)``; the row must also
    have ``<column>_min`` and ``<column>_max``.
    """

    csv: str
    row: tuple
    column: str
    label: str

    def interval(self, tables: dict) -> tuple[float, float, float]:
        """``(min, median, max)`` from ``tables[self.csv]``.

        Raises:
            KeyError: no single row matches.
        """
        hits = [r for r in tables[self.csv] if all(r.get(k) == v for k, v in self.row)]
        if len(hits) != 1:
            raise KeyError(f"{self.csv}.csv: {len(hits)} rows match {dict(self.row)}")
        r = hits[0]
        return (float(r[f"{self.column}_min"]), float(r[self.column]),
                float(r[f"{self.column}_max"]))


def compare(a: tuple, b: tuple) -> str:
    """``"higher"`` when a's min is above b's max, ``"lower"`` when a's max is below b's min,
    else ``"within noise"``. ``a`` and ``b``: ``(min, median, max)``."""
    if a[0] > b[2]:
        return "higher"
    if a[2] < b[0]:
        return "lower"
    return "within noise"


def word(column: str, verdict: str) -> str:
    """The prose's word for ``verdict`` on ``column``: faster/slower, less/more, within noise."""
    if verdict == "within noise":
        return verdict
    if column in TIME_COLUMNS:
        return {"higher": "more", "lower": "less"}[verdict]
    return {"higher": "faster", "lower": "slower"}[verdict]


@dataclass(frozen=True)
class Claim:
    """``a`` compared with ``b`` (another quantity, or a number such as 1.0 for a ratio), the
    verdict the prose states (``says``: higher, lower, within noise), the sentence carrying it
    and the file that holds the sentence."""

    id: str
    a: Quantity
    b: Quantity | float
    says: str
    sentence: str
    prose: str

    def measured(self, tables: dict) -> tuple[tuple, tuple]:
        b = self.b.interval(tables) if isinstance(self.b, Quantity) else (self.b,) * 3
        return self.a.interval(tables), b

    def verdict(self, tables: dict) -> str:
        """What the CSVs say: :func:`compare` of the two intervals."""
        return compare(*self.measured(tables))

    def line(self, tables: dict) -> str:
        """``id: a median (min-max) vs b median (min-max): word`` for printing (< 100 chars)."""
        a, b = self.measured(tables)
        other = (f"{self.b.label} {b[1]:.3g} ({b[0]:.3g}-{b[2]:.3g})"
                 if isinstance(self.b, Quantity) else f"{self.b:g}")
        return (f"{self.id}: {self.a.label} {a[1]:.3g} ({a[0]:.3g}-{a[2]:.3g}) vs {other}: "
                f"{word(self.a.column, self.verdict(tables))}")


def load(root=".") -> dict:
    """Every stored benchmark CSV under ``root/benchmarks`` as rows:
    ``{"allreduce": [...], ...}``."""
    folder = Path(root) / "benchmarks"
    return {name: read_rows(folder / f"{name}.csv", text=_TEXT[name], bools=_BOOLS.get(name, ()))
            for name in ("allreduce", "ddp", "scaling")}


def _ar(R, method, size_mib, column="algbw_GBps"):
    return Quantity("allreduce", (("nprocs", R), ("method", method),
                                  ("size_bytes", size_mib * MIB)), column, method)


def _ddp(variant, link, column):
    return Quantity("ddp", (("variant", variant), ("link", link)), column, variant)


def _sc(mode, R):
    return Quantity("scaling", (("mode", mode), ("nprocs", R)), "samples_per_s", f"R={R}")


NB03 = "notebooks/deep/03_collective_costs.ipynb"
NB04 = "notebooks/deep/04_bucket_size_and_benchmarks.ipynb"  # branches from notebook 04
#: notebook 06's deep dive, which states the scaling study's claims
NB05 = "notebooks/deep/06_scaling_and_mixed_precision.ipynb"
DOC = "docs/benchmarks.md"

_NOISE_03 = ("the pipelined ring, the simple ring and gloo's `all_reduce` are within noise of "
             "one another at 16 and 64 MiB, with 2 and with 4 processes")
_LINK_03 = "with 4 processes the two-rank send/recv is faster than gloo's bus bandwidth at 64 MiB"
_LINK2_03 = "with 2 processes the two are within noise"


def _ar_claims() -> list[Claim]:
    out = []
    for R in (2, 4):
        for size in (16, 64):
            for a, b in (("pipelined", "ring"), ("gloo", "ring"), ("gloo", "pipelined")):
                out.append(Claim(f"R={R}, {size} MiB, algbw GB/s", _ar(R, a, size),
                                 _ar(R, b, size), "within noise", _NOISE_03, NB03))
    out.append(Claim("R=4, 64 MiB, busbw GB/s", _ar(4, "sendrecv", 64, "busbw_GBps"),
                     _ar(4, "gloo", 64, "busbw_GBps"), "higher", _LINK_03, NB03))
    out.append(Claim("R=2, 64 MiB, busbw GB/s", _ar(2, "sendrecv", 64, "busbw_GBps"),
                     _ar(2, "gloo", 64, "busbw_GBps"), "within noise", _LINK2_03, NB03))
    return out


def _ddp_claims(prose: str, sentences: dict) -> list[Claim]:
    return [
        Claim("no link, steps/s over torch's (paired)", _ddp("bucketed", False, "ratio_to_torch"),
              1.0, "within noise", sentences["bucketed"], prose),
        Claim("no link, steps/s over torch's (paired)", _ddp("naive", False, "ratio_to_torch"),
              1.0, "lower", sentences["naive"], prose),
        Claim("link, exposed ms per step", _ddp("bucketed", True, "exposed_ms"),
              _ddp("bucketed-no-overlap", True, "exposed_ms"), "within noise",
              sentences["overlap"], prose),
        Claim("link, steps/s", _ddp("bucketed", True, "steps_per_s"),
              _ddp("bucketed-no-overlap", True, "steps_per_s"), "within noise",
              sentences["overlap steps"], prose),
        Claim("link, exposed ms per step", _ddp("naive", True, "exposed_ms"),
              _ddp("bucketed-no-overlap", True, "exposed_ms"), "higher",
              sentences["naive exposed"], prose),
    ]


def _scaling_claims(prose: str, sentences: dict) -> list[Claim]:
    return [
        Claim("weak scaling", _sc("weak", 2), _sc("weak", 1), "within noise",
              sentences["weak 2"], prose),
        Claim("strong scaling", _sc("strong", 2), _sc("strong", 1), "higher",
              sentences["strong 2"], prose),
        Claim("weak scaling", _sc("weak", 4), _sc("weak", 1), "higher", sentences["weak 4"], prose),
    ]


_DDP_DOC = {
    "bucketed": "without a link, BucketedDDP and torch's DDP are within noise of each other",
    "naive": "NaiveDDP is slower than torch's DDP even on loopback, in every round",
    "overlap": ("the exposed communication per step of BucketedDDP with overlap and without "
                "is within noise"),
    "overlap steps": "and their steps/s are within noise too",
    "naive exposed": "NaiveDDP's exposed communication is more than BucketedDDP's without overlap",
}
_SCALING_DOC = {
    "weak 2": "weak scaling with 2 processes is within noise of 1 process",
    "strong 2": "strong scaling with 2 processes is faster than 1 process",
    "weak 4": "weak scaling with 4 processes is faster than 1 process",
}
#: Sentences proposed for notebooks 04 and 06 (their owners write them; checked against the
#: CSVs here, and against those notebooks' text by nobody yet).
_DDP_NB04 = {
    "bucketed": "without a link, `BucketedDDP` runs within noise of torch's DDP",
    "naive": "`NaiveDDP` is slower than torch's DDP even on loopback",
    "overlap": "under the link the exposed communication with and without overlap is within noise",
    "overlap steps": "the steps/s are within noise too",
    "naive exposed": "NaiveDDP exposes more communication than buckets without overlap",
}
_SCALING_NB05 = {
    "weak 2": "2 processes are within noise of 1 (weak scaling)",
    "strong 2": "with a global batch of 16, 2 processes are faster than 1",
    "weak 4": "4 processes are faster than 1 (weak scaling) on this loaded machine",
}

README = "README.md"
_README_AR = ("gloo's `all_reduce` and the rings built here are within noise of one another at "
              "64 MiB")
_README_DDP = "NaiveDDP is slower than torch's DDP"
_README_SCALING = "2 processes are within noise of 1 in weak scaling"


def _readme_claims() -> list[Claim]:
    out = [Claim(f"R={R}, 64 MiB, algbw GB/s", _ar(R, a, 64), _ar(R, "ring", 64),
                 "within noise", _README_AR, README)
           for R in (2, 4) for a in ("gloo", "pipelined")]
    out.append(Claim("no link, steps/s over torch's (paired)",
                     _ddp("naive", False, "ratio_to_torch"), 1.0, "lower", _README_DDP, README))
    out.append(Claim("weak scaling", _sc("weak", 2), _sc("weak", 1), "within noise",
                     _README_SCALING, README))
    return out


#: Every claim about the stored benchmarks, in the order the lessons make them.
CLAIMS: list[Claim] = (_ar_claims() + _readme_claims() + _ddp_claims(DOC, _DDP_DOC)
                       + _scaling_claims(DOC, _SCALING_DOC) + _ddp_claims(NB04, _DDP_NB04)
                       + _scaling_claims(NB05, _SCALING_NB05))
