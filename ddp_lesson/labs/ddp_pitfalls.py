"""The DDP wrapper's classic pitfalls, run on real processes (docs/pitfalls.md B1, B2, B4, B5, B8).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.ddp_pitfalls

Each function is one scenario and works with the cores of :mod:`ddp_lesson.core` or torch's
``DistributedDataParallel`` (``wrapper`` argument), so a notebook cell and a test can run the
same thing and compare with torch. :func:`walk_autograd_graph` is what
``find_unused_parameters=True`` does after each forward (deep dive 04 · edge cases).
Every function is a collective: call it on every rank, in the same order. Modules and inputs
are built on the CPU (the same numbers on any machine) and moved to the device the default group
reduces on (:func:`ddp_lesson.env.reduce_device`: ``cuda:LOCAL_RANK`` under NCCL, which refuses
CPU tensors), so the returned gradients live there too.
"""
from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch.distributed as dist
from torch import nn

from ddp_lesson.cli import plain
from ddp_lesson.commsim import Recorder
from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP
from ddp_lesson.env import reduce_device
from ddp_lesson.labs import gather
from ddp_lesson.labs.ddp_toys import IN_FEATURES, TwoLayer

__all__ = ["Scalar", "MICRO_GRADS", "no_sync_accumulation", "unused_parameters",
           "loss_reduction", "broadcast_at_construction", "ReentrantHead",
           "reentrant_checkpoint_on_input", "walk_autograd_graph", "main"]

#: B4's local micro-batch gradients: rank -> [micro-batch 0, micro-batch 1].
MICRO_GRADS = {0: [1.0, 3.0], 1: [1.0, 6.0]}


class Scalar(nn.Module):
    """One scalar weight ``w`` (starts at 0); ``forward(c) = w * c``, so d(output)/dw = c."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, c):
        return self.w * c


def _ours(wrapper) -> bool:
    """The cores (they take a recorder; they send zeros for a missing gradient, no flag)."""
    return isinstance(wrapper, type) and issubclass(wrapper, NaiveDDP)


def _wrap(wrapper, module, recorder=None, find_unused_parameters: bool = False):
    if _ours(wrapper):
        return wrapper(module, recorder=recorder)
    return wrapper(module, find_unused_parameters=find_unused_parameters)


def _find_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside a (nested) tuple/list/dict output."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    return []


def walk_autograd_graph(outputs) -> tuple[int, set[int]]:
    """Walk the autograd graph back from ``outputs``: ``(nodes visited, ids of leaves reached)``.

    Follows ``grad_fn.next_functions`` from every tensor in ``outputs`` (nested
    tuples/lists/dicts searched); a leaf is an ``AccumulateGrad`` node whose ``.variable`` is
    the parameter, so ``id(p) in leaves`` says whether ``p`` took part in ``outputs``. torch's
    DDP with ``find_unused_parameters=True`` does this walk after every forward, in C++
    (``Reducer::search_unused_parameters`` in ``reducer.cpp``). No synchronisation.
    """
    stack = [t.grad_fn for t in _find_tensors(outputs) if t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return len(seen), found


def no_sync_accumulation(wrapper=BucketedDDP, order: str = "correct") -> tuple[float, int | None]:
    """B4: accumulate 2 micro-batches with local gradients ``MICRO_GRADS[rank]`` (2 ranks).

    Args:
        wrapper: NaiveDDP, BucketedDDP or torch's DistributedDataParallel.
        order: ``"correct"`` — micro-batch 0 (forward and backward) inside ``no_sync()``,
            micro-batch 1 synchronised; ``"buggy"`` — the other way round (sync first);
            ``"backward-only"`` — ``no_sync()`` around micro-batch 0's ``backward()`` only.

    Returns:
        ``(w.grad on this rank, synchronised backward passes)``; the count is None for
        torch's DDP (not recorded). Expected: correct 5.5 on both ranks with 1 sync; buggy
        4.0 / 7.0; backward-only 5.5 but with 2 syncs (the forward decided to sync).

    Raises:
        ValueError: an unknown ``order`` or a world size other than 2.
    """
    if dist.get_world_size() != 2:
        raise ValueError(f"B4 needs 2 ranks, got {dist.get_world_size()}")
    if order not in ("correct", "buggy", "backward-only"):
        raise ValueError(f"order must be correct, buggy or backward-only, got {order!r}")
    rank = dist.get_rank()
    recorder = Recorder()
    # every module is built on the CPU (the same weights on any machine), then moved to where
    # the default group reduces: cuda:LOCAL_RANK under NCCL, which refuses CPU tensors, else cpu
    ddp = _wrap(wrapper, Scalar().to(reduce_device()), recorder=recorder)
    skip = {"correct": 0, "buggy": 1, "backward-only": 0}[order]
    for m, c in enumerate(MICRO_GRADS[rank]):
        c = torch.tensor(c, device=reduce_device())
        if m == skip and order == "backward-only":
            out = ddp(c)
            with ddp.no_sync():
                out.backward()
            continue
        with ddp.no_sync() if m == skip else contextlib.nullcontext():
            ddp(c).backward()
    syncs = len(recorder.steps) if _ours(wrapper) else None
    return float(ddp.module.w.grad), syncs


def unused_parameters(wrapper=BucketedDDP, find_unused_parameters: bool = False,
                      b_on_ranks=(), iterations: int = 2):
    """B1: layers ``a`` and ``b``; ``b`` takes part only on the ranks in ``b_on_ranks``.

    Every rank feeds ``x = (rank + 1) * ones(2, 4)`` and backpropagates ``output.sum()``.

    Returns:
        ``("error", message)`` when an iteration raised RuntimeError (then it stops), else
        ``("grads", {name: grad or None})`` after the last iteration (the averaged gradients
        of the last iteration; ``zero_grad(set_to_none=True)`` before each). The cores ignore
        ``find_unused_parameters``: a rank without a gradient sends zeros, so a parameter
        unused everywhere ends with a zero ``.grad`` (torch's DDP: None).
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = _wrap(wrapper, TwoLayer().to(reduce_device()),
                find_unused_parameters=find_unused_parameters)
    for _ in range(iterations):
        ddp.zero_grad(set_to_none=True)
        x = torch.full((2, IN_FEATURES), float(rank + 1), device=reduce_device())
        try:
            ddp(x, use_b=rank in b_on_ranks).sum().backward()
        except RuntimeError as err:
            return "error", str(err)
    return "grads", {n: None if p.grad is None else p.grad.clone()
                     for n, p in ddp.module.named_parameters()}


def loss_reduction(wrapper=BucketedDDP) -> dict[str, float]:
    """B5: one weight w=1, prediction ``w*x``, target 0, squared error; x = [1,2] | [3,4].

    Returns:
        The averaged ``w.grad`` for ``"mean"``, ``"sum"`` and ``"mean*R"`` losses (2 ranks).
        Expected 15, 30 (= 60/R) and 30 (2x too big); one process on [1,2,3,4] gives 15 / 60.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([1.0, 2.0], device=reduce_device()) + 2.0 * rank
    grads = {}
    for kind in ("mean", "sum", "mean*R"):
        model = nn.Linear(1, 1, bias=False).to(reduce_device())
        with torch.no_grad():
            model.weight.fill_(1.0)
        ddp = _wrap(wrapper, model)
        err = ddp(x[:, None]).squeeze(1) ** 2
        loss = err.sum() if kind == "sum" else err.mean() * (world_size if kind == "mean*R" else 1)
        loss.backward()
        grads[kind] = float(model.weight.grad)
    return grads


def broadcast_at_construction(wrapper=BucketedDDP, steps: int = 3) -> tuple[float, bool]:
    """B8: ranks that start from different weights end up with rank 0's, and stay identical.

    Two checks: (1) fill every parameter and buffer of a Linear-BatchNorm-Linear model with
    this rank's number and wrap it: everything must read 0.0 (rank 0's value); (2) build the
    model from a per-rank seed (different weights on every rank), wrap, train ``steps`` SGD
    steps on per-rank data, and compare a float64 checksum of the parameters across ranks.

    Returns:
        ``(largest |value| of any parameter or buffer after wrapping the filled model,
        checksums identical on every rank)``; expected ``(0.0, True)``.
    """
    rank = dist.get_rank()

    def build():
        return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(),
                             nn.Linear(8, 2)).to(reduce_device())

    model = build()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(rank)
    _wrap(wrapper, model)
    largest = max(float(t.detach().abs().max())
                  for t in list(model.parameters()) + list(model.buffers()))

    torch.manual_seed(rank)  # a different initialisation on every rank
    model = build()
    ddp = _wrap(wrapper, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)  # different data on every rank
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, IN_FEATURES, generator=g).to(reduce_device())).pow(2).mean().backward()
        opt.step()
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    sums = [torch.zeros((), dtype=torch.float64, device=checksum.device)
            for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    return largest, all(bool(torch.equal(s, sums[0])) for s in sums)


class ReentrantHead(nn.Module):
    """B20's torch case: ``checkpoint(self.head, self.body(x), use_reentrant=True)``.

    ``body`` and ``head`` are ``Linear(IN_FEATURES, 1)`` scalars' worth of weights, seeded the
    same on every rank (``torch.manual_seed(0)``). Only ``head`` runs inside the reentrant
    checkpoint, whose inner backward accumulates ``head``'s gradient.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN_FEATURES, IN_FEATURES)
        self.head = nn.Linear(IN_FEATURES, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.head, self.body(x), use_reentrant=True)


def reentrant_checkpoint_on_input(wrapper=BucketedDDP) -> dict[str, bool]:
    """B20: a reentrant checkpoint applied to an input that requires grad, one backward.

    Each rank feeds its own batch (seeded by rank, ``requires_grad_(True)``) through
    :class:`ReentrantHead` wrapped in ``wrapper`` (no ``static_graph``), runs one backward
    of ``out.sum()``, and compares every parameter's ``.grad`` with this rank's own gradient
    (the bare module, no wrapper) and with the mean of all ranks' own gradients.

    Returns:
        ``{"averaged": every .grad equals the mean (|Δ| < 1e-6), "rank_local": every .grad
        equals this rank's own gradient}`` (docs/pitfalls.md B20, the run in deep dive 04 ·
        edge cases). Synchronises (all-reduces and gathers).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, IN_FEATURES, generator=g).to(reduce_device())  # drawn on the CPU
    bare = ReentrantHead().to(x.device)
    bare(x.clone().requires_grad_(True)).sum().backward()  # autograd.grad refuses reentrant
    own = [p.grad for p in bare.parameters()]
    mean = [o.clone() / world for o in own]
    for m in mean:
        dist.all_reduce(m)
    module = ReentrantHead().to(x.device)
    ddp = _wrap(wrapper, module)
    ddp(x.clone().requires_grad_(True)).sum().backward()
    grads = [p.grad for p in module.parameters()]
    return {"averaged": all((gr - m).abs().max().item() < 1e-6 for gr, m in zip(grads, mean)),
            "rank_local": all(torch.equal(gr, o) for gr, o in zip(grads, own))}


def main(argv=None) -> None:
    """Run every scenario with both wrappers; rank 0 prints one line per result."""
    from ddp_lesson.env import cleanup, init_distributed, print0

    argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0])).parse_args(argv)
    init_distributed(timeout=60)
    for wrapper in (NaiveDDP, BucketedDDP):
        name = wrapper.__name__
        for order in ("correct", "buggy"):
            grad, syncs = no_sync_accumulation(wrapper, order)
            grads = gather(grad)
            print0(f"{name} B4 {order}: w.grad per rank {grads}, synchronised backwards {syncs}")
        kind, value = unused_parameters(wrapper, False, b_on_ranks=(0,))
        print0(f"{name} B1, b on rank 0 only: b.weight.grad[0, 0] = "
               f"{value['b.weight'][0, 0].item()}")
        print0(f"{name} B5 grads: {loss_reduction(wrapper)}")
        print0(f"{name} B8: largest |value| after wrapping, same weights after 3 steps: "
               f"{broadcast_at_construction(wrapper)}")
    # torch's DDP holds the process group (its reducer keeps a reference): free unreachable
    # wrappers now, so that the group is not torn down during interpreter exit, where
    # gloo can abort ("terminate called without an active exception").
    gc.collect()
    cleanup()


if __name__ == "__main__":
    main()
