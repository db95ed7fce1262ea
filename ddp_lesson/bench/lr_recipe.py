"""The batch-size and learning-rate recipe, tried on TinyGPT: 1x and 4x a base global batch.

    python -m ddp_lesson.bench.lr_recipe              # benchmarks/lr_recipe.csv and .png
    python -m ddp_lesson.bench.lr_recipe --seeds 0 1 2 3 --out runs/lr.csv --figure none

A learning rate was tuned at a base global batch B; the job now runs at 4B. Which learning
rate? Adam and the trainer's SGD with momentum train TinyGPT (:mod:`ddp_lesson.gpt`) on the
same number of samples at both batches (4B: a quarter of the steps):

* at B: the base learning rate, half and twice it (is the base near the best at B?);
* at 4B: the base rate (``none``), times 2 (``sqrt``) and times 4 (``linear``), with warm-up,
  and ``linear`` without it.

Rates from :func:`ddp_lesson.gradients.scale_lr`, schedule
:func:`ddp_lesson.gradients.warmup_cosine` (warm-up over :data:`WARMUP_FRACTION` of the
samples, cosine decay to :data:`FLOOR` of the peak). One run per seed (initial weights and
windows); the CSV keeps the mean, sample standard deviation, min, max and each seed's final
evaluation loss: mean next-token cross-entropy (nats per token) on :data:`EVAL_WINDOWS` fixed
windows of the corpus's last tenth, which no training window touches.

**One process, the global batch in one piece**: DDP's averaged gradient over R ranks equals
one process's on the global batch (notebook 01, ``tests/ddp``'s equality tests), so the
learning rate's effect is the global batch's. One thread: no communication, the same numbers.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass

from .common import figure_target, read_rows, save_figure, write_rows

#: TinyGPT's size for the experiment (``vocab_size`` comes from the corpus).
MODEL = {"block_size": 32, "n_embd": 32, "n_head": 2, "n_layer": 2}
#: The base global batch B, in sequences of ``block_size`` tokens, and the larger one's factor.
BASE_BATCH, FACTOR = 8, 4
#: Training sequences every configuration sees: 600 steps at B, 150 at 4B.
SAMPLES = 4800
#: The base learning rate per optimizer (tuned at B; the sweep rows check it).
BASE_LR = {"adam": 4e-3, "sgd": 0.1}
#: The multiples of the base learning rate tried at B.
SWEEP = (0.5, 1.0, 2.0)
WARMUP_FRACTION, FLOOR = 0.1, 0.1
EVAL_WINDOWS, EVAL_SEED, HELD_OUT = 256, 1234, 0.1
SEEDS = (0, 1, 2)
DEFAULT_OUT = "benchmarks/lr_recipe.csv"
CSV_COLUMNS = ("optimizer", "global_batch", "rule", "lr_mult", "warmup", "lr", "steps",
               "warmup_steps", "samples", "seeds", "eval_loss", "eval_loss_std",
               "eval_loss_min", "eval_loss_max", "eval_loss_per_seed", "diverged")
TEXT_COLUMNS = ("optimizer", "rule", "eval_loss_per_seed")
BOOL_COLUMNS = ("warmup",)


@dataclass(frozen=True)
class Variant:
    """One configuration: optimizer, global batch, scaling rule, multiple of the base lr,
    warm-up or not."""

    optimizer: str
    global_batch: int
    rule: str = "none"
    lr_mult: float = 1.0
    warmup: bool = True

    def lr(self) -> float:
        """The peak learning rate: the base times ``lr_mult``, scaled by ``rule``."""
        from ..gradients import scale_lr

        return scale_lr(BASE_LR[self.optimizer] * self.lr_mult, BASE_BATCH, self.global_batch,
                        self.rule)

    def schedule(self, samples: int) -> tuple[int, int]:
        """``(steps, warmup_steps)`` for ``samples`` training sequences.

        Raises:
            ValueError: ``samples`` is not a multiple of the global batch.
        """
        steps, rest = divmod(samples, self.global_batch)
        if rest or steps < 2:
            raise ValueError(f"samples {samples} must be a multiple of the global batch "
                             f"{self.global_batch}, at least 2 steps")
        return steps, (max(1, round(WARMUP_FRACTION * steps)) if self.warmup else 0)


def plan(optimizers=("adam", "sgd")) -> list[Variant]:
    """Every configuration, in the CSV's order."""
    out = []
    for opt in optimizers:
        out += [Variant(opt, BASE_BATCH, "none", m) for m in SWEEP]
        out += [Variant(opt, FACTOR * BASE_BATCH, rule) for rule in ("none", "sqrt", "linear")]
        out.append(Variant(opt, FACTOR * BASE_BATCH, "linear", warmup=False))
    return out


def corpus_split():
    """``(train_ids, eval_x, eval_y, vocab_size)``: the corpus's first 90% for training and
    :data:`EVAL_WINDOWS` fixed windows of the rest."""
    import torch

    from ..gpt import get_batch, load_corpus

    corpus = load_corpus()
    cut = int(len(corpus.data) * (1 - HELD_OUT))
    held = corpus.data[cut:]
    g = torch.Generator().manual_seed(EVAL_SEED)
    ex, ey = get_batch(held, EVAL_WINDOWS, MODEL["block_size"], generator=g)
    return corpus.data[:cut], ex, ey, corpus.vocab_size


def _optimizer(name: str, params, lr: float):
    import torch

    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))
    if name == "sgd":  # the trainer's SGD: momentum 0.9, weight decay 1e-4
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    raise ValueError(f"optimizer {name!r} is not one of adam, sgd")


def train_once(v: Variant, seed: int, samples: int = SAMPLES, split=None,
               threads: int = 1) -> float:
    """Train a fresh TinyGPT for ``samples`` sequences under ``v``; the final evaluation loss
    (NaN when the training loss stopped being finite: diverged). One process, ``threads``
    intra-op threads (restored afterwards)."""
    import torch

    from ..gpt import GPTConfig, TinyGPT, get_batch
    from ..gradients import warmup_cosine

    train, ex, ey, vocab = split if split is not None else corpus_split()
    steps, warm = v.schedule(samples)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig(vocab_size=vocab, **MODEL))
        opt = _optimizer(v.optimizer, model.parameters(), v.lr())
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, steps, warm, FLOOR))
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = get_batch(train, v.global_batch, MODEL["block_size"], generator=g)
            _, loss = model(x, y)
            if not torch.isfinite(loss):
                return float("nan")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            return float(model(ex, ey)[1])
    finally:
        torch.set_num_threads(before)


def summarise(v: Variant, losses: list[float], samples: int) -> dict:
    """One CSV row: the variant, its schedule and the statistics of ``losses`` over seeds
    (of the finite ones; ``diverged`` counts the others)."""
    finite = [x for x in losses if math.isfinite(x)]
    steps, warm = v.schedule(samples)
    row = {"optimizer": v.optimizer, "global_batch": v.global_batch, "rule": v.rule,
           "lr_mult": v.lr_mult, "warmup": v.warmup, "lr": v.lr(), "steps": steps,
           "warmup_steps": warm, "samples": samples, "seeds": len(losses),
           "eval_loss_per_seed": " ".join(f"{x:.4f}" for x in losses),
           "diverged": len(losses) - len(finite)}
    if finite:
        row.update(eval_loss=statistics.fmean(finite),
                   eval_loss_std=statistics.stdev(finite) if len(finite) > 1 else 0.0,
                   eval_loss_min=min(finite), eval_loss_max=max(finite))
    return row


def run(seeds=SEEDS, samples: int = SAMPLES, optimizers=("adam", "sgd"), out=DEFAULT_OUT,
        figure: str | None = None, echo=print) -> list[dict]:
    """Every configuration of :func:`plan` for every seed; writes the CSV (and the figure)."""
    split = corpus_split()
    rows = []
    for v in plan(optimizers):
        row = summarise(v, [train_once(v, s, samples, split) for s in seeds], samples)
        rows.append(row)
        echo(line(row))
    write_rows(rows, out, CSV_COLUMNS)
    if figure:
        from ..viz.training import lr_recipe_figure

        save_figure(lr_recipe_figure, rows, figure)
    return rows


def line(row: dict) -> str:
    """``adam, batch 32, sqrt, warm-up, lr 0.008: 2.270 ± 0.032 (2.234-2.297)``: the mean, the
    standard deviation and the min-max over seeds."""
    what = row["rule"] if row["global_batch"] != BASE_BATCH else f"lr x{row['lr_mult']:g}"
    warm = "warm-up" if row["warmup"] else "no warm-up"
    loss = (f"{row['eval_loss']:.3f} ± {row['eval_loss_std']:.3f} ({row['eval_loss_min']:.3f}"
            f"-{row['eval_loss_max']:.3f})" if row.get("eval_loss") is not None else "diverged")
    div = f", {row['diverged']} of {row['seeds']} diverged" if row["diverged"] else ""
    return (f"{row['optimizer']}, batch {row['global_batch']}, {what}, {warm}, "
            f"lr {row['lr']:.3g}: {loss}{div}")


def read_csv(path=DEFAULT_OUT) -> list[dict]:
    """The stored rows, typed (``warmup`` a bool, the text columns strings)."""
    return read_rows(path, text=TEXT_COLUMNS, bools=BOOL_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lesson.bench.lr_recipe",
                                description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--samples", type=int, default=SAMPLES,
                   help=f"training sequences per configuration (default {SAMPLES})")
    p.add_argument("--optimizers", nargs="+", default=["adam", "sgd"], choices=["adam", "sgd"])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV to write (default {DEFAULT_OUT})")
    p.add_argument("--figure", default=None,
                   help="PNG to write (default: the CSV's name with .png; 'none' skips it)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.seeds) < 2:
        p.error(f"--seeds needs at least 2 seeds for a spread, got {len(args.seeds)}")
    figure = figure_target(args)
    t0 = time.process_time()
    run(args.seeds, args.samples, args.optimizers, args.out, figure)
    print(f"wrote {args.out}" + (f" and {figure}" if figure else ""))
    print(f"CPU time: {time.process_time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
