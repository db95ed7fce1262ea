"""Exercise 06.5: the global-count loss, equal to one process on the global batch.

Each rank hands the candidate K micro-batches' summed token cross-entropies and valid counts
(``-100`` padding, counts differing by rank and micro-batch), backpropagates the loss it
returns and averages the gradients as DDP does; the judge names the normalisation they match.
"""
from __future__ import annotations

import torch

from ...core.naive_ddp import all_reduce_mean_
from .. import solutions as S
from ..registry import Exercise, register
from ..values import fmt_num, returned

_T, _FEATURES, _CLASSES = 6, 3, 4
_KS = (2, 3, 1)  # accumulation steps, one case each (2 first: it tells the most apart)


def _count(case, rank, micro):
    return 1 + (7 * rank + 3 * micro + 2 * case) % _T


def _micro(case, rank, micro):
    """``(x, y)``: T positions, the first ``_count`` valid, the rest ``-100``."""
    g = torch.Generator().manual_seed(100 * case + 10 * rank + micro)
    x = torch.randn(_T, _FEATURES, generator=g)
    y = torch.randint(0, _CLASSES, (_T,), generator=g)
    y[_count(case, rank, micro):] = -100
    return x, y


def _model():
    torch.manual_seed(3)
    return torch.nn.Linear(_FEATURES, _CLASSES)


def _sum_loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")


def _flat_grad(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _scalar(value):
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError("not a scalar tensor")
    return value


def _rank(fn, rank, world_size):
    out = []
    for case, k in enumerate(_KS):
        model = _model()
        micro = [_micro(case, rank, j) for j in range(k)]
        sums = [_sum_loss(model, x, y) for x, y in micro]
        counts = [int((y != -100).sum()) for _, y in micro]
        loss = returned(fn(sums, counts), "a scalar tensor (the loss to backpropagate)",
                        _scalar)
        loss.reshape(()).backward()
        for p in model.parameters():
            all_reduce_mean_(p.grad)  # what DDP does to the gradients
        out.append(_flat_grad(model).tolist())
    return out


def _grad_of_sum(case, r, j):
    """The gradient of rank r's micro-batch j's summed loss."""
    model = _model()
    _sum_loss(model, *_micro(case, r, j)).backward()
    return _flat_grad(model)


def _normalisations(case, R, k):
    """Name -> the DDP-averaged gradient that normalisation gives (the right one first)."""
    counts = [[_count(case, r, j) for j in range(k)] for r in range(R)]
    n_global = sum(map(sum, counts))
    coef = {
        "right": lambda r, j: R / n_global,
        "micro-batch mean / K": lambda r, j: 1 / counts[r][j] / k,
        "micro-batch mean, not divided by K": lambda r, j: 1 / counts[r][j],
        "rank's own count": lambda r, j: 1 / sum(counts[r]),
        "global count, not times R": lambda r, j: 1 / n_global,
        "global count averaged over the ranks": lambda r, j: R * R / n_global,
    }
    grads = [[_grad_of_sum(case, r, j) for j in range(k)] for r in range(R)]
    return counts, {name: sum(c(r, j) * grads[r][j] for r in range(R) for j in range(k)) / R
                    for name, c in coef.items()}


_WHY = {
    "micro-batch mean / K": "each micro-batch's mean, averaged over the K micro-batches: right "
    "only when every micro-batch has the same number of valid tokens",
    "micro-batch mean, not divided by K": "each micro-batch's own mean, summed over the K "
    "micro-batches",
    "rank's own count": "divided by this rank's count (a loss divided per rank): right only when "
    "every rank has as many valid tokens",
    "global count, not times R": "divided by the global count but not multiplied by the world "
    "size R: DDP's average divides by R again",
    "global count averaged over the ranks": "the count was averaged over the ranks (all_reduce, "
    "then / R) rather than summed",
}


def _judge(results) -> list[str]:
    R = len(results)
    for case, k in enumerate(_KS):
        counts, found = _normalisations(case, R, k)
        want = found["right"]
        for r in range(R):
            got = torch.tensor(results[r][case])
            bad = (~torch.isclose(got, want, rtol=1e-4, atol=1e-7)).nonzero()
            if not len(bad):
                continue
            i = int(bad[0])
            text = (f"{k} micro-batch(es) per rank, valid tokens by rank {counts}: rank {r}'s "
                    f"averaged gradient[{i}] = {fmt_num(float(got[i]))}, one process on the "
                    f"global batch has {fmt_num(float(want[i]))}")
            name = next((n for n, g in found.items() if n != "right"
                         and torch.allclose(got, g, rtol=1e-4, atol=1e-7)), None)
            return [text + (f": that is {_WHY[name]}." if name else ".")
                    + " The rule: loss = sum of the micro-batch sums * R / (valid tokens of "
                    "every micro-batch of every rank, one all_reduce)."]
    return []


register(Exercise(
    "06.5", "the global-count loss",
    task="Write fn(sums, counts) -> Tensor: sums[j] is micro-batch j's summed token "
         "cross-entropy on this rank (a scalar with a graph; padding ignored), counts[j] its "
         "number of valid tokens, for the K micro-batches of one optimizer step. Return the "
         "one loss this rank backpropagates so that, after DDP averages the gradients over "
         "the R ranks (divides by R), they equal one process's gradient of the mean over every "
         "valid token of the global batch, however unequal the counts. A collective: the "
         "ranks' counts must be combined.",
    signature="fn(sums: list[Tensor ()], counts: list[int]) -> Tensor ()   # a collective; "
              "then loss.backward() and the mean of the gradients over the ranks",
    reference=S.global_count_loss, kind="distributed", world_sizes=(2, 3),
    run_rank=_rank, judge=_judge,
    checked="2 and 3 processes (torchrun, gloo), 2, 3 and 1 micro-batches per rank with 1 to 6 "
            "valid tokens each, against one process on the global batch"))
