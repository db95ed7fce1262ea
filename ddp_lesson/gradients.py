"""Why averaging shard gradients is training on the global batch — helpers for notebook 01.

Data parallelism in one sentence: R ranks hold identical model copies, each computes the
gradient of the **mean** loss over its own shard of the global batch, and the gradients are
averaged with an all-reduce (as torch's DDP does it: each rank divides its gradient by R, then
the all-reduce sums). For equal shards of size B, with global batch N = R·B,

    (1/R) Σ_r ∇ (1/B) Σ_{i in shard r} ℓ_i  =  ∇ (1/N) Σ_i ℓ_i ,

so one data-parallel step equals one single-process step on the whole batch. The helpers here
compute each side on one process (no process group), plus the ways it breaks: a ``sum`` loss
(the averaged gradient is the single-process sum gradient divided by R), unequal shard sizes
(the plain average gives a small shard's samples more weight; weight by shard size instead),
and the learning rate for a larger global batch.

Sources: PyTorch DistributedDataParallel notes ("gradients are averaged",
https://pytorch.org/docs/stable/notes/ddp.html); P. Goyal et al., "Accurate, Large Minibatch
SGD: Training ImageNet in 1 Hour", 2017 (linear LR scaling rule); A. Krizhevsky, "One weird
trick for parallelizing convolutional neural networks", 2014 (square-root rule).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .core.naive_ddp import all_reduce_mean_

__all__ = [
    "make_toy_model", "make_toy_batch", "split_batch", "batch_gradient", "shard_gradients",
    "average", "weighted_average", "all_reduce_average", "scalar_squared_error_grad",
    "scale_lr", "accumulation_steps", "warmup_cosine", "sgd_step", "max_abs_diff", "LR_RULES",
]

#: Rules for following the global batch with the learning rate (``scale_lr``, the trainer's
#: ``--lr-scaling``).
LR_RULES = ("none", "linear", "sqrt")


def make_toy_model(seed: int = 0, in_features: int = 4, hidden: int = 3) -> nn.Module:
    """A tiny MLP ``Linear(in, hidden) -> Tanh -> Linear(hidden, 1)``, seeded: the same on
    every rank.

    With the defaults it has 4·3 + 3 + 3 + 1 = 19 parameters.
    """
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def make_toy_batch(
    n: int = 8, seed: int = 1, in_features: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded regression batch ``x: (n, in_features)``, ``y: (n, 1)``; identical on every rank."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    y = torch.randn(n, 1, generator=g)
    return x, y


def split_batch(x: torch.Tensor, y: torch.Tensor, world_size: int,
                sizes: Sequence[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into ``world_size`` contiguous shards: ``[(x_0, y_0), ..., (x_{R-1}, y_{R-1})]``.

    Args:
        x, y: the global batch (first dimension N).
        world_size: number of shards R.
        sizes: shard sizes summing to N; default: equal shards (N must be divisible by R).

    Raises:
        ValueError: N not divisible by R without ``sizes``, or sizes that do not add up to N
            ("shard sizes [3, 2] add up to 5, the batch has 6").
    """
    n = x.shape[0]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if y.shape[0] != n:
        raise ValueError(f"x has {n} samples but y has {y.shape[0]}")
    if sizes is None:
        if n % world_size:
            raise ValueError(f"a batch of {n} does not split into {world_size} equal shards; "
                             "pass sizes=[...] for unequal shards")
        sizes = [n // world_size] * world_size
    sizes = list(sizes)
    if len(sizes) != world_size:
        raise ValueError(f"{len(sizes)} shard sizes for world_size {world_size}")
    if any(s < 0 for s in sizes) or sum(sizes) != n:
        raise ValueError(f"shard sizes {sizes} add up to {sum(sizes)}, the batch has {n}")
    return list(zip(x.split(sizes), y.split(sizes)))


def batch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   reduction: str = "mean") -> torch.Tensor:
    """Gradient of the MSE loss of ``model`` on ``(x, y)``, every parameter flattened into one
    vector.

    Args:
        model: any module; its ``.grad`` fields are cleared before and after.
        x, y: a batch; ``reduction`` is ``"mean"`` (divide by the element count) or ``"sum"``.

    Returns:
        A 1-D float tensor of ``sum(p.numel())`` entries, in ``model.parameters()`` order.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y, reduction=reduction)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach().clone()
    model.zero_grad(set_to_none=True)
    return grad


def shard_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    world_size: int,
    reduction: str = "mean",
    sizes: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """What each of ``world_size`` ranks would compute: the gradient on its own shard.

    Runs on one process (no communication): the shards come from :func:`split_batch`.
    """
    return [batch_gradient(model, xs, ys, reduction)
            for xs, ys in split_batch(x, y, world_size, sizes)]


def average(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The plain average ``(1/R) Σ g_r`` — what DDP's all-reduce computes."""
    if not grads:
        raise ValueError("no gradients to average")
    return torch.stack(list(grads)).sum(0) / len(grads)


def weighted_average(grads: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """``Σ n_r g_r / Σ n_r``: the global mean-loss gradient when shard r holds n_r samples.

    With a mean loss per shard, g_r = (1/n_r) Σ ∇ℓ_i, so n_r g_r is the shard's *sum* gradient
    and dividing the total by N = Σ n_r gives the global mean gradient, whatever the sizes.
    On R ranks: all-reduce ``n_r · g_r`` and ``n_r`` (two sums), then divide.

    Raises:
        ValueError: mismatched lengths or a non-positive total.
    """
    if len(grads) != len(counts):
        raise ValueError(f"{len(grads)} gradients but {len(counts)} counts")
    total = sum(counts)
    if total <= 0:
        raise ValueError(f"shard sizes {list(counts)} add up to {total}")
    return sum(g * n for g, n in zip(grads, counts)) / total


def all_reduce_average(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Average ``tensor`` over the ranks in place: ``÷ world_size``, then ``all_reduce(SUM)``.

    The package's one averaging rule, :func:`ddp_lesson.core.naive_ddp.all_reduce_mean_`, in
    torch's DDP order: each rank divides by the world size *before* the SUM, so a float16 sum
    over the ranks cannot overflow where the mean itself fits. Portable on every backend:
    gloo before PyTorch's 2025 change (pytorch/pytorch#149781) had no ``ReduceOp.AVG``, and
    gloo's refuses an integer tensor (NCCL's ``ncclAvg``, 2.10 and later, refuses only bool:
    ``getNcclReduceOp`` in torch's ProcessGroupNCCL.cpp).

    Args:
        tensor: floating-point tensor, same shape on every rank.
        group: process group (None: default).

    Returns:
        ``tensor``, now the mean over ranks.

    Raises:
        TypeError: an integer tensor (the mean is not an integer).

    Synchronisation: yes — a collective; every rank must call it.
    """
    if not tensor.is_floating_point():
        raise TypeError(f"cannot average a {tensor.dtype} tensor in place; convert to float first")
    all_reduce_mean_(tensor, group)
    return tensor


def scalar_squared_error_grad(w: float, x: Sequence[float], reduction: str = "mean") -> float:
    """d/dw of the squared error of the one-weight model ``w·x`` against target 0 (case B5).

    ``mean``: (1/n) Σ 2 w x_i²; ``sum``: Σ 2 w x_i². Computed with autograd, returned as float.
    """
    wt = torch.tensor(float(w), dtype=torch.float64, requires_grad=True)
    xt = torch.tensor([float(v) for v in x], dtype=torch.float64)
    loss = nn.functional.mse_loss(wt * xt, torch.zeros_like(xt), reduction=reduction)
    loss.backward()
    return float(wt.grad)


def scale_lr(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear") -> float:
    """Learning rate for ``global_batch`` given one tuned at ``base_batch``.

    ``linear`` (Goyal et al., "Accurate, Large Minibatch SGD", arXiv:1706.02677):
    ``base_lr · global_batch / base_batch``; ``sqrt`` (Krizhevsky, arXiv:1404.5997; Hoffer et
    al., arXiv:1705.08741): ``base_lr · sqrt(global_batch / base_batch)``; ``none``:
    ``base_lr``. ``global_batch`` is world_size × per-rank batch (× accumulation steps): with
    averaged gradients one DDP step on R ranks × B samples *is* one step on the R·B batch
    (docs/pitfalls.md B7), so nothing else changes with R — no extra division by the number
    of processes. The one learning-rate rule of the package (the trainer uses it too).

    >>> scale_lr(0.1, 256, 4 * 128)
    0.2

    Raises:
        ValueError: a non-positive number or an unknown rule.
    """
    if base_lr <= 0 or base_batch <= 0 or global_batch <= 0:
        raise ValueError(f"base_lr, base_batch and global_batch must be > 0, got "
                         f"{base_lr}, {base_batch}, {global_batch}")
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"lr scaling rule {rule!r} is not one of {', '.join(LR_RULES)}")


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step K so that ``global_batch = micro_batch × K × world_size``.

    The recipe's second step: take the biggest ``micro_batch`` that fits on one device, then
    accumulate K micro-batches per step to reach the global batch the learning rate was tuned
    for (or scaled to, :func:`scale_lr`). Averaged gradients make the K × R micro-batches one
    step on the global batch (docs/pitfalls.md B4, B7).

    >>> accumulation_steps(256, 16, 4)
    4

    Raises:
        ValueError: a count below 1, or a global batch that ``micro_batch × world_size`` does
            not divide (the error names the nearest global batches that work).
    """
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch),
                    ("world_size", world_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    per_step = micro_batch * world_size
    k, rest = divmod(global_batch, per_step)
    if rest or k == 0:
        lower, upper = max(k, 1) * per_step, (k + 1) * per_step
        near = f"{lower} or {upper}" if k else f"{per_step}"
        raise ValueError(
            f"global batch {global_batch} is not a multiple of micro_batch {micro_batch} x "
            f"world_size {world_size} = {per_step}; use a global batch of {near}, or another "
            f"micro-batch")
    return k


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, floor: float = 0.1) -> float:
    """The learning rate's factor at optimizer step ``step`` (0-based): a linear warm-up from
    ``1 / warmup_steps`` to 1 over ``warmup_steps`` steps, then a cosine decay from 1 to
    ``floor`` at the last step. ``warmup_steps=0``: the decay from step 0.

    For ``torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, total, warm))``,
    with the optimizer's lr set to the scaled peak (:func:`scale_lr`). Count the warm-up in
    samples, not steps: at 4 times the global batch the same samples are a quarter of the steps.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps`` outside ``[0, total_steps)``, or
            ``floor`` outside ``[0, 1]``.
    """
    if total_steps < 1 or not 0 <= warmup_steps < total_steps or not 0.0 <= floor <= 1.0:
        raise ValueError(f"need total_steps >= 1, 0 <= warmup_steps < total_steps and floor in "
                         f"[0, 1], got {total_steps}, {warmup_steps}, {floor}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay = total_steps - warmup_steps - 1
    progress = (step - warmup_steps) / decay if decay else 0.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> nn.Module:
    """One plain SGD step on the mean MSE loss of ``(x, y)``, in place; returns ``model``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model


def max_abs_diff(a, b) -> float:
    """``max |a - b|`` over two tensors, or over two models' parameters in order. Local.

    Compared on the CPU, so one side may be on a GPU (a rank's result under NCCL) and the
    other on the CPU (a single-process reference).
    """
    if isinstance(a, nn.Module):
        return max(max_abs_diff(p, q) for p, q in zip(a.parameters(), b.parameters()))
    return float((a.detach().cpu() - b.detach().cpu()).abs().max())
