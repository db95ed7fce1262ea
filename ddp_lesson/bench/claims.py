"""What the prose says about the stored benchmarks, each claim checked against the CSVs.

Two measurements (min, median, max over repeats) are told apart only when their min..max
intervals do not overlap, else the difference is **within noise** (:func:`compare`).
:data:`CLAIMS` lists every comparison the README, the deep dives of notebooks 01 and 03,
``docs/benchmarks.md`` and ``docs/cheatsheet.md`` state (and notebooks 04 and 06 should), with
the prose's verdict; ``tests/bench/test_bench_claims.py`` checks each against
``benchmarks/*.csv`` and finds its sentence, so a re-measured benchmark fails a claim that no
longer holds. Words: rates ``faster``/``slower``, times ``less``/``more``, losses
``lower``/``higher``. ``benchmarks/lr_recipe.csv`` has seeds for repeats (its middle value the
mean).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .common import read_rows
from .lr_recipe import BASE_BATCH, BOOL_COLUMNS, FACTOR, TEXT_COLUMNS

#: Columns where less is better (times); every other measured column is a rate, except ...
TIME_COLUMNS = ("seconds", "exposed_ms", "step_s", "comm_exposed_s")
#: ... losses, where lower is better and the words are lower/higher.
LOSS_COLUMNS = ("eval_loss",)
_TEXT = {"allreduce": ("method",), "ddp": ("variant",), "scaling": ("mode",),
         "lr_recipe": TEXT_COLUMNS}
_BOOLS = {"ddp": ("link",), "lr_recipe": BOOL_COLUMNS}
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
    """The prose's word for ``verdict`` on ``column``: faster/slower, less/more, lower/higher,
    within noise."""
    if verdict == "within noise":
        return verdict
    if column in LOSS_COLUMNS:
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

    def line(self, tables: dict, fmt: str = ".3g", middle: bool = True) -> str:
        """``id: a median (min-max) vs b median (min-max): word`` for printing (< 100 chars);
        ``fmt`` formats the numbers (``.3f`` for losses that differ in the third decimal),
        ``middle=False`` leaves the median out (``a (min-max) vs b (min-max)``)."""
        a, b = self.measured(tables)

        def show(q, v):
            mid = f"{v[1]:{fmt}} " if middle else ""
            return f"{q.label} {mid}({v[0]:{fmt}}-{v[2]:{fmt}})"

        other = show(self.b, b) if isinstance(self.b, Quantity) else f"{self.b:g}"
        return (f"{self.id}: {show(self.a, a)} vs {other}: "
                f"{word(self.a.column, self.verdict(tables))}")


def load(root=".") -> dict:
    """Every stored benchmark CSV under ``root/benchmarks`` as rows:
    ``{"allreduce": [...], ..., "lr_recipe": [...]}``."""
    folder = Path(root) / "benchmarks"
    return {name: read_rows(folder / f"{name}.csv", text=_TEXT[name], bools=_BOOLS.get(name, ()))
            for name in ("allreduce", "ddp", "scaling", "lr_recipe")}


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
              1.0, "higher", sentences["bucketed"], prose),
        Claim("no link, steps/s over torch's (paired)", _ddp("naive", False, "ratio_to_torch"),
              1.0, "lower", sentences["naive"], prose),
        Claim("link, exposed ms per step", _ddp("bucketed", True, "exposed_ms"),
              _ddp("bucketed-no-overlap", True, "exposed_ms"), "lower",
              sentences["overlap"], prose),
        Claim("link, steps/s", _ddp("bucketed", True, "steps_per_s"),
              _ddp("bucketed-no-overlap", True, "steps_per_s"), "higher",
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
    "bucketed": "without a link, BucketedDDP (one 25 MiB bucket) is faster than torch's DDP",
    "naive": "NaiveDDP is slower than torch's DDP even on loopback, in every round",
    "overlap": "BucketedDDP with overlap exposes less communication per step than without",
    "overlap steps": "and with overlap it is faster",
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
    "bucketed": "without a link, `BucketedDDP` is faster than torch's DDP",
    "naive": "`NaiveDDP` is slower than torch's DDP even on loopback",
    "overlap": "under the link, overlap exposes less communication than buckets without it",
    "overlap steps": "and the steps with overlap are faster",
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


# --------------------------------------------------------------- the learning-rate recipe

NB01 = "notebooks/deep/01_loss_scaling_and_lr_rules.ipynb"
CHEATSHEET = "docs/cheatsheet.md"
#: notebook 06, whose short recipe box states three of the claims
NB06 = "notebooks/06_training_the_seed_model.ipynb"


def _lr(opt, batch, rule="none", mult=1, warmup=True):
    what = rule if batch != BASE_BATCH else f"lr x{mult:g}"
    label = f"{opt} {batch} {what}" + ("" if warmup else " no warm-up")
    return Quantity("lr_recipe", (("optimizer", opt), ("global_batch", batch), ("rule", rule),
                                  ("lr_mult", mult), ("warmup", warmup)), "eval_loss", label)


_BIG, _BASE = FACTOR * BASE_BATCH, BASE_BATCH
_WARM_4X = (("none", True), ("sqrt", True), ("linear", True), ("linear", False))
#: The recipe's comparisons, by the key a prose's sentences are listed under:
#: ``key -> [(id, a, b, verdict), ...]``.
_LR_SPECS = {
    "adam sqrt": [("at 32", _lr("adam", _BIG, "sqrt"), _lr("adam", _BIG, "linear"),
                   "lower")],
    "adam none": [("at 32", _lr("adam", _BIG), _lr("adam", _BIG, "linear"), "lower")],
    "adam sqrt~none": [("at 32", _lr("adam", _BIG, "sqrt"), _lr("adam", _BIG),
                        "within noise")],
    "sgd sqrt": [("at 32", _lr("sgd", _BIG, "sqrt"), _lr("sgd", _BIG), "lower")],
    "sgd linear~sqrt": [("at 32", _lr("sgd", _BIG, "linear"), _lr("sgd", _BIG, "sqrt"),
                         "within noise")],
    "sgd linear~none": [("at 32", _lr("sgd", _BIG, "linear"), _lr("sgd", _BIG),
                         "within noise")],
    "warm-up": [("warm-up", _lr(o, _BIG, "linear", warmup=False), _lr(o, _BIG, "linear"),
                 "within noise") for o in ("adam", "sgd")],
    "32 vs 8": [("32 vs 8", _lr(o, _BIG, rule, warmup=w), _lr(o, _BASE), "higher")
                for o in ("adam", "sgd") for rule, w in _WARM_4X],
    "sweep x2": [("at 8", _lr(o, _BASE, mult=2), _lr(o, _BASE), "within noise")
                 for o in ("adam", "sgd")],
    "sweep sgd x0.5": [("at 8", _lr("sgd", _BASE, mult=0.5), _lr("sgd", _BASE), "within noise")],
    "sweep adam x0.5": [("at 8", _lr("adam", _BASE, mult=0.5), _lr("adam", _BASE, mult=2),
                         "higher")],
}
#: square root against every other rule at 32, both optimizers (one sentence says it all;
#: a within-noise pair is written the way round the other sentences write it)
_LR_SPECS["sqrt best"] = [
    *_LR_SPECS["adam sqrt~none"], *_LR_SPECS["adam sqrt"],
    ("at 32", _lr("adam", _BIG, "sqrt"), _lr("adam", _BIG, "linear", warmup=False), "lower"),
    *_LR_SPECS["sgd sqrt"], *_LR_SPECS["sgd linear~sqrt"],
    ("at 32", _lr("sgd", _BIG, "linear", warmup=False), _lr("sgd", _BIG, "sqrt"),
     "within noise"),
]
_ADAM_01 = ("with Adam, square-root scaling ends lower than linear scaling, and so does no "
            "scaling")
_SGD_01 = ("linear scaling is within noise of square-root scaling, and within noise of no "
           "scaling too")
_LR_NB01 = {
    "adam sqrt": _ADAM_01, "adam none": _ADAM_01,
    "adam sqrt~none": "square-root scaling and no scaling are within noise of each other",
    "sgd sqrt": "with SGD, square-root scaling ends lower than no scaling",
    "sgd linear~sqrt": _SGD_01, "sgd linear~none": _SGD_01,
    "warm-up": ("linear scaling without warm-up is within noise of linear scaling with it, "
                "with both optimizers"),
    "32 vs 8": ("every batch-32 row ends higher than batch 8 at the base learning rate, with "
                "both optimizers"),
    "sweep x2": "at batch 8, twice the base learning rate is within noise of the base",
    "sweep sgd x0.5": "with SGD half of it is within noise too",
    "sweep adam x0.5": "with Adam half of it ends higher than twice it",
    "sqrt best": ("square-root scaling ended lower than or within noise of every other rule, "
                  "with either optimizer"),
}
_ADAM_DOC = "with Adam, square-root scaling and no scaling both end lower than linear scaling"
_SGD_DOC = "while linear scaling is within noise of both"
_LR_DOC = {
    "adam sqrt": _ADAM_DOC, "adam none": _ADAM_DOC,
    "adam sqrt~none": "and are within noise of each other",
    "sgd sqrt": "with SGD, square-root scaling ends lower than no scaling",
    "sgd linear~sqrt": _SGD_DOC, "sgd linear~none": _SGD_DOC,
    "warm-up": "Linear scaling without warm-up is within noise of linear scaling with it",
    "32 vs 8": "every batch-32 row ends higher than batch 8 at the base learning rate",
}
_LR_CHEAT = {
    "adam sqrt": "Adam: square-root scaling ends lower than linear",
    "sgd sqrt": "SGD: square-root scaling ends lower than no scaling",
    "sgd linear~sqrt": "linear is within noise of square-root",
    "32 vs 8": "4 times the batch ends higher than the base batch under every rule",
}
#: Notebook 06's recipe box (after section 3).
_LR_NB06 = {
    "adam sqrt": "with Adam, square-root ends lower than linear",
    "sgd linear~sqrt": "with SGD, linear is within noise of square-root",
    "32 vs 8": "4 times the batch ends higher than the base batch",
}


def _lr_claims(prose: str, say: dict) -> list[Claim]:
    """The recipe's claims that ``prose`` states, each with its sentence ``say[key]``."""
    return [Claim(cid, a, b, verdict, sentence, prose) for key, sentence in say.items()
            for cid, a, b, verdict in _LR_SPECS[key]]


#: Every claim about the stored benchmarks, in the order the lessons make them.
CLAIMS: list[Claim] = (_ar_claims() + _readme_claims() + _ddp_claims(DOC, _DDP_DOC)
                       + _scaling_claims(DOC, _SCALING_DOC) + _ddp_claims(NB04, _DDP_NB04)
                       + _scaling_claims(NB05, _SCALING_NB05) + _lr_claims(NB01, _LR_NB01)
                       + _lr_claims(DOC, _LR_DOC) + _lr_claims(CHEATSHEET, _LR_CHEAT)
                       + _lr_claims(NB06, _LR_NB06))
