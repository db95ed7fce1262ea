"""What 04.3 (naive DDP) and 04.4 (bucketed DDP) share: the toy models, each rank's data,
one process's SGD trajectory on the global batch, and the first value a rank's differs in.
Rank r builds its model from ``SEED + r`` (only a broadcast makes the copies equal); each
step's global batch comes from a fixed seed, ``B`` samples per rank.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

SEED, B, LR = 100, 3, 0.1


class TiedNet(nn.Module):
    """4 -> 4 -> 4 -> 4 -> 2 with tanh; ``b.weight`` is ``a.weight`` (a tied weight, listed
    once by ``parameters()``), ``frozen`` has ``requires_grad=False`` and the buffer ``shift``
    (4 numbers, drawn with the weights) is added after the first layer."""

    in_features = 4

    def __init__(self):
        super().__init__()
        self.a, self.frozen, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.b.weight = self.a.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", 0.1 * torch.randn(4))

    def forward(self, x):
        h = torch.tanh(self.a(x) + self.shift)
        h = torch.tanh(self.frozen(h))
        return self.head(torch.tanh(self.b(h)))


class ChainNet(nn.Module):
    """3 -> 5 -> 4 -> 2 with tanh: six parameters of 15, 5, 20, 4, 8 and 2 elements, so each
    bucket of a cap has a size of its own."""

    in_features = 3

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(3, 5), nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def build(net: type, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return net()


def global_batch(net: type, step: int, micro: int, world_size: int):
    """Step ``step``'s micro-batch ``micro``: ``(x, y)`` of ``world_size * B`` samples."""
    g = torch.Generator().manual_seed(7 + 1000 * step + micro)
    return (torch.randn(world_size * B, net.in_features, generator=g),
            torch.randn(world_size * B, 2, generator=g))


def values(model: nn.Module) -> dict[str, list[float]]:
    """Every parameter (a tied one once, frozen ones too), then every buffer, by name,
    flattened."""
    out = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    out.update((n, b.detach().reshape(-1).tolist()) for n, b in model.named_buffers())
    return out


def sgd_step(model: nn.Module, lr: float = LR) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def one_process(net: type, plan: tuple, world_size: int, lr: float = LR) -> list[dict]:
    """One process on the global batch: the values after construction, then after each step;
    ``plan[k]`` micro-batches at step k (gradients summed, as accumulation does)."""
    model = build(net, SEED)
    out = [values(model)]
    for step, micros in enumerate(plan):
        for m in range(micros):
            x, y = global_batch(net, step, m, world_size)
            torch.nn.functional.mse_loss(model(x), y).backward()
        sgd_step(model, lr)
        out.append(values(model))
    return out


def train_rank(wrapped, model, net, plan, rank, world_size, on_backward=None) -> list[dict]:
    """This rank's run: ``wrapped`` (the candidate's wrapper around ``model``) over ``plan``,
    the first micro-batches of a step inside ``wrapped.no_sync()``; returns the values after
    construction and after each step. ``on_backward(step, micro, synced)`` runs after each
    backward."""
    out = [values(model)]
    for step, micros in enumerate(plan):
        for m in range(micros):
            x, y = global_batch(net, step, m, world_size)
            xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
            synced = m == micros - 1
            with (contextlib.nullcontext() if synced else wrapped.no_sync()):
                torch.nn.functional.mse_loss(wrapped(xs), ys).backward()
            if on_backward:
                on_backward(step, m, synced)
        sgd_step(model)
        out.append(values(model))
    return out


def first_difference(got: list[dict], want: list[dict]):
    """``(step, name, index, got, want)`` of the first value that differs, or None."""
    import math

    for step, (g, w) in enumerate(zip(got, want)):
        for name, ws in w.items():
            gs = g.get(name, [])
            for i, wv in enumerate(ws):
                gv = gs[i] if i < len(gs) else float("nan")
                if not math.isclose(gv, wv, rel_tol=1e-4, abs_tol=1e-6):
                    return step, name, i, gv, wv
    return None


def matches(got: list[dict], want: list[dict], step: int) -> bool:
    """Whether ``got`` equals ``want`` at ``step`` (and every step before)."""
    return first_difference(got[:step + 1], want[:step + 1]) is None


def _start_problem(runs: list, net: type, r: int, name: str, i: int, gv: float,
                   wv: float) -> str:
    """The sentence for values that differ after construction (rank ``r``'s ``name[i]`` is
    ``gv``, rank 0's initial value ``wv``): whose weights each rank holds tells the cause."""
    from ..values import fmt_num

    R = len(runs)
    text = f"after construction, rank {r}: {name}[{i}] = {fmt_num(gv)}, rank 0's is {fmt_num(wv)}"
    starts = [values(build(net, SEED + k)) for k in range(R)]
    whose = [next((k for k in range(R) if first_difference(run[:1], starts[k:k + 1]) is None),
                  None) for run in runs]
    if len(set(whose)) == 1 and whose[0] not in (None, 0):
        return (f"{text}: the ranks agree, but every rank holds rank {whose[0]}'s initial "
                "weights, so rank 0's were replaced. Broadcast from rank 0 (src=0): the "
                "training starts from rank 0's model, as torch's DDP does.")
    if name.startswith("frozen"):
        why = ("the frozen parameter was not broadcast: broadcast every parameter and buffer "
               "at construction, trainable or not")
    elif name in dict(build(net, SEED).named_buffers()):
        why = (f"the buffer {name} was not broadcast (module.buffers(), e.g. BatchNorm's "
               "running statistics): broadcast every parameter and buffer at construction")
    elif all(w == k for k, w in enumerate(whose)):
        why = ("each rank starts from weights of its own (the checker seeds them "
               "differently): broadcast rank 0's parameters and buffers at construction")
    else:
        held = ", ".join(f"rank {k}: " + ("its own" if w == k else "a mix" if w is None
                                          else f"rank {w}'s") for k, w in enumerate(whose))
        why = (f"the ranks start from different weights ({held}): broadcast rank 0's "
               "parameters and buffers to every rank at construction")
    return f"{text}: {why}."


def trajectory_problem(runs: list, net: type, plan: tuple, context=lambda step: "") -> str | None:
    """The sentence for the earliest step at which some rank (``runs[r]``: its values after
    construction and each step) differs from one process, the lowest such rank, with what it
    looks like (an unbroadcast start, gradients R times too large or too small), or None."""
    from ..values import fmt_num

    R = len(runs)
    want = one_process(net, plan, R)
    diffs = [(d, r) for r, got in enumerate(runs)
             for d in [first_difference(got, want)] if d is not None]
    if not diffs:
        return None
    (step, name, i, gv, wv), r = min(diffs, key=lambda dr: (dr[0][0], dr[1]))
    got = runs[r]
    if step == 0:
        return _start_problem(runs, net, r, name, i, gv, wv)
    text = (f"step {step}{context(step)}, rank {r}: {name}[{i}] = {fmt_num(gv)}, one process "
            f"on the global batch has {fmt_num(wv)}")
    if matches(got, one_process(net, plan, R, LR * R), step):
        return text + (f": the gradients are {R}x the average (a SUM over the ranks, not "
                       "divided by the world size).")
    if matches(got, one_process(net, plan, R, LR / R), step):
        return text + f": the gradients are 1/{R} of the average (divided twice?)."
    return text + "."
