"""The cores NaiveDDP and BucketedDDP where torch's DDP works: passes that differentiate
through the model for something other than the parameters, and what the bucketed core leaves
out.

    torchrun --standalone --nproc-per-node R tests/programs/ddp_where_torch_works.py

World size 2 or 3, gloo. Each scenario prints one JSON line per rank:
``{"scenario": ..., "rank": r, "<variant> <case>": value}`` where a value is the flat list
of every parameter's ``.grad`` after the case (``None`` for a missing one), or
``["error", type, message]``. tests/ddp/test_ddp_where_torch_works.py compares each core
with torch's ``DistributedDataParallel`` on the same inputs (docs/pitfalls.md B40-B41).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP

WRAPPERS = {"torch": DistributedDataParallel, "naive": NaiveDDP, "bucketed": BucketedDDP}
VARIANTS = {**WRAPPERS, "torch+unused": (
    lambda m: DistributedDataParallel(m, find_unused_parameters=True))}


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return ["error", type(e).__name__, str(e)]


def _grads(model: nn.Module) -> list:
    out = []
    for p in model.parameters():
        if p.grad is None:
            out.append(None)
            continue
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        g = torch.view_as_real(g) if g.is_complex() else g
        out += g.double().flatten().tolist()
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _pgd(ddp, x, y, steps):
    """torchattacks-style PGD: ``steps`` input-gradient passes, then the training backward."""
    adv = x.clone()
    for _ in range(steps):
        adv.requires_grad_(True)
        loss = ((ddp(adv) - y) ** 2).mean()
        (g,) = torch.autograd.grad(loss, adv)
        adv = (adv.detach() + 0.1 * g.sign()).detach()
    ((ddp(adv) - y) ** 2).mean().backward()


def _penalty(ddp, x, y):
    """A gradient penalty: the input gradient with create_graph=True, in the loss."""
    x = x.clone().requires_grad_(True)
    loss = ((ddp(x) - y) ** 2).mean()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + g.pow(2).sum()).backward()


def _inputs(ddp, x, y):
    """``backward(inputs=[x])`` (x only), then the full backward of the same graph."""
    x = x.clone().requires_grad_(True)
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward(inputs=[x], retain_graph=True)
    loss.backward()


def _func(ddp, x, y):
    """``torch.func.grad`` with respect to the input, then a training step on x + grad."""
    gx = torch.func.grad(lambda t: ((ddp(t) - y) ** 2).mean())(x)
    ((ddp(x + gx) - y) ** 2).mean().backward()


def _param_grad(ddp, x, y):
    """``autograd.grad`` with respect to the parameters fills no ``.grad`` (torch: local)."""
    loss = ((ddp(x) - y) ** 2).mean()
    grads = torch.autograd.grad(loss, list(ddp.parameters()))
    ((ddp(x) - y) ** 2).mean().backward()
    for p, g in zip(ddp.parameters(), grads):
        p.grad += g  # the local gradient of autograd.grad, added by hand


def _eval(ddp, x, y, no_grad):
    """An evaluation forward whose output is used without backward, then a training step."""
    if no_grad:
        with torch.no_grad():
            ddp(x).sum().item()
    else:
        ddp(x).sum().item()
    ((ddp(x) - y) ** 2).mean().backward()


def input_gradients(rank, world):
    """Every case, every variant, on rank-dependent inputs (so the average is not local)."""
    cases = {
        "pgd": lambda d, x, y: _pgd(d, x, y, 2),
        # a PGD attack that stops after rank + 1 steps: the ranks run different numbers of
        # forwards before the training backward (the model has no buffers)
        "pgd_uneven": lambda d, x, y: _pgd(d, x, y, rank + 1),
        "penalty": _penalty, "inputs": _inputs, "func": _func, "param_grad": _param_grad,
        "eval_no_grad": lambda d, x, y: _eval(d, x, y, True),
        "eval_grad": lambda d, x, y: _eval(d, x, y, False),
    }
    out = {}
    for case, run in cases.items():
        for v, cls in VARIANTS.items():
            model = _model()
            ddp = cls(model)
            g = torch.Generator().manual_seed(100 + rank)
            x, y = torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)

            def step(ddp=ddp, model=model, x=x, y=y, run=run):
                run(ddp, x, y)
                return _grads(model)
            out[f"{v} {case}"] = _try(step)
            dist.barrier()
    return out


class SparseModel(nn.Module):
    def __init__(self, sparse: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 3, sparse=sparse)
        self.head = nn.Linear(3, 1)

    def forward(self, idx):
        h = self.emb(idx) if idx is not None else torch.ones(2, 3)  # None: the table unused
        return self.head(h).sum()


class FunctionalSparse(nn.Module):
    """A sparse gradient torch's DDP cannot see at construction (no nn.Embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(6, 3))

    def forward(self, idx):
        return nn.functional.embedding(idx, self.table, sparse=True).sum()


def _conv_model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 1, 1))
    return m.to(memory_format=torch.channels_last) if channels_last else m


class Mixed(nn.Module):
    """A float32 layer, then a float64 one: two dtypes, never in one bucket."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2).double()

    def forward(self, x):
        return self.b(self.a(x).double())


def features(rank, world):
    """Sparse gradients, complex parameters, channels_last and two dtypes: what each does."""
    out = {}
    idx = torch.tensor([rank, rank + 1, 5])

    def sparse(cls):
        model = SparseModel()
        ddp = cls(model)
        ddp(idx).backward()
        return _grads(model)
    for v in WRAPPERS:
        out[f"{v} sparse"] = _try(lambda v=v: sparse(WRAPPERS[v]))
        dist.barrier()

    def functional_sparse(cls):
        model = FunctionalSparse()
        ddp = cls(model)
        ddp(idx).backward()
        return _grads(model)
    for v in WRAPPERS:
        out[f"{v} functional_sparse"] = _try(lambda v=v: functional_sparse(WRAPPERS[v]))
        dist.barrier()

    g = torch.Generator().manual_seed(200 + rank)
    builders = {
        "complex": (lambda: (torch.manual_seed(0), nn.Linear(3, 2, dtype=torch.cfloat))[1],
                    torch.randn(4, 3, dtype=torch.cfloat, generator=g)),
        "channels_last": (lambda: _conv_model(True),
                          torch.randn(2, 2, 5, 5, generator=g).to(
                              memory_format=torch.channels_last)),
        "mixed_dtypes": (Mixed, torch.randn(4, 3, generator=g)),
    }
    for case, (build, x) in builders.items():
        for v, cls in WRAPPERS.items():
            def step(cls=cls, build=build, x=x):
                model = build()
                ddp = cls(model)  # kept: torch's reducer goes with its DDP object
                y = ddp(x)
                (y.abs() if y.is_complex() else y).double().sum().backward()
                return _grads(model)
            out[f"{v} {case}"] = _try(step)
            dist.barrier()
    return out


SCENARIOS = {f.__name__: f for f in (input_gradients, features)}


def main(argv=None) -> None:
    from ddp_lesson.env import cleanup, init_distributed

    names = (sys.argv[1:] if argv is None else argv) or list(SCENARIOS)
    env = init_distributed(timeout=20, backend="gloo", announce=False)
    for name in names:
        result = SCENARIOS[name](env.rank, env.world_size)
        print(json.dumps({"scenario": name, "rank": env.rank, **result}), flush=True)
        dist.barrier()
    import gc
    gc.collect()  # free torch's DDP objects before the group goes
    cleanup()


if __name__ == "__main__":
    main()
