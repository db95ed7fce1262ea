"""SyncBatchNorm from scratch: BatchNorm statistics over the global batch, on CPU/gloo too.

Under data parallelism plain BatchNorm normalises with each rank's slice of the batch (2 images
of 8, say) and the ranks' running mean/var drift apart; SyncBatchNorm uses the *global* batch's
statistics, the same function as BatchNorm on the whole batch in one process
(docs/pitfalls.md B11). torch's ``nn.SyncBatchNorm`` runs on GPUs only ("SyncBatchNorm expected
input tensor to be on GPU"); this one on any device, with plain ``all_reduce`` calls:

* **forward** (training): per channel, each rank's sum, sum of squares and count (from a stable
  local ``var_mean``) in one float64 all_reduce of ``3 x C`` numbers; normalise with the global
  mean and biased variance (ranks may hold different sample counts). Running stats take the
  global mean and *unbiased* variance, as ``nn.BatchNorm*d``: identical on every rank.
* **backward**: the input gradient depends on the whole batch through ``sum(dy)`` and
  ``sum(dy * (x - mean))``, all-reduced (``2 x C``); weight and bias gradients stay local
  (DDP's all_reduce averages them).

So two collectives per BatchNorm layer per training step, each a synchronisation point. In eval
nothing is communicated (torch's ``need_sync`` is False outside training): the running stats
normalise, or with ``track_running_stats=False`` the local batch's own statistics.
:func:`convert_sync_batchnorm` replaces every ``BatchNorm1d/2d/3d`` (as
``torch.nn.SyncBatchNorm.convert_sync_batchnorm``): after moving the model to its device,
*before* wrapping it in DDP (hooks go on the parameters found at construction; NVIDIA/apex #109).

Sources: Ioffe & Szegedy, "Batch Normalization" (arXiv:1502.03167), section 3 (forward and
backward formulas); torch's ``torch/nn/modules/_functions.py`` (``SyncBatchNorm`` autograd
function: local stats, all-gather, ``batch_norm_backward_reduce`` then all_reduce of
``sum_dy`` and ``sum_dy_xmu``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .env import group_active

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "count_batchnorm", "sync_batch_norm"]


def _group_size(process_group) -> int:
    """World size of ``process_group`` (1 without an initialised process group)."""
    if not group_active():
        return 1
    return dist.get_world_size(process_group)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm with statistics all-reduced over ``process_group``: see
    :func:`sync_batch_norm`; only ``y`` carries a gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, process_group):
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        n_local = x.numel() // c if c else 0
        # bf16/fp16 inputs are normalised in float32 and cast back, as torch's batch norm does
        # (also with fp32 parameters: the --sync-bn --amp bf16 path)
        acc = torch.promote_types(x.dtype, torch.float32)
        xa = x.to(acc)
        if n_local > 0:
            # Stable local statistics first (var_mean is a two-pass/Welford reduction), then
            # turned into sums in float64, so combining them cannot cancel catastrophically.
            var_l, mean_l = torch.var_mean(xa, dim=dims, correction=0)
            mean_l, var_l = mean_l.double(), var_l.double()
            sums = torch.stack([mean_l * n_local, (var_l + mean_l * mean_l) * n_local,
                                torch.full_like(mean_l, float(n_local))])
        else:  # a rank with an empty batch still takes part in the all_reduce
            sums = torch.zeros(3, c, dtype=torch.float64, device=x.device)
        if _group_size(process_group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)  # sync point
        total_sum, total_sq, count = sums[0], sums[1], sums[2]
        if float(count[0]) < 1:
            raise ValueError(f"SyncBatchNorm: the global batch holds no values for {c} "
                             "channels (every rank's batch is empty)")
        mean = total_sum / count
        var = (total_sq / count - mean * mean).clamp_(min=0.0)  # biased: normalises
        invstd = torch.rsqrt(var + eps)
        mean_a = mean.to(acc)
        invstd_a = invstd.to(acc)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xa - mean_a.view(shape)) * invstd_a.view(shape)
        if weight is not None:
            y = y * weight.to(acc).view(shape) + bias.to(acc).view(shape)
        ctx.save_for_backward(x, weight, mean_a, invstd_a, count.to(acc))
        ctx.process_group = process_group
        count0 = count[0].clone()
        ctx.mark_non_differentiable(mean, var, count0)
        return y.to(x.dtype), mean, var, count0

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dcount):
        x, weight, mean, invstd, count = ctx.saved_tensors
        acc = mean.dtype
        c = x.shape[1]
        shape = [1, c] + [1] * (x.dim() - 2)
        dims = [d for d in range(x.dim()) if d != 1]
        dy = dy.to(acc)
        xmu = x.to(acc) - mean.view(shape)
        sum_dy = dy.sum(dim=dims)  # zeros (C,) for an empty batch: it still takes part
        sum_dy_xmu = (dy * xmu).sum(dim=dims)
        grad_weight = grad_bias = None
        if weight is not None:
            # Local contributions only: DDP's gradient all_reduce combines them across ranks.
            if ctx.needs_input_grad[1]:
                grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                grad_bias = sum_dy.to(weight.dtype)
        # dx depends on the whole global batch through two per-channel sums. The all_reduce
        # runs whether or not this rank needs dx, so every rank issues the same collectives.
        both = torch.stack([sum_dy, sum_dy_xmu])
        if _group_size(ctx.process_group) > 1:
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.process_group)  # sync point
        grad_x = None
        if ctx.needs_input_grad[0]:
            mean_dy = both[0] / count
            mean_dy_xmu = both[1] / count
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = ((dy - mean_dy.view(shape)
                       - xmu * (invstd * invstd * mean_dy_xmu).view(shape))
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None


def sync_batch_norm(x: torch.Tensor, weight, bias, eps: float = 1e-5, process_group=None):
    """Batch norm of ``x`` ``(N, C, *)`` with the global batch's statistics (training mode);
    ``N`` may differ between ranks, even be 0. ``weight``, ``bias``: ``(C,)`` or both None;
    ``process_group`` None: the default group.

    Returns:
        ``(y, mean, var, count)``: ``y`` like ``x`` (its dtype too, computed in float32); the
        global per-channel ``mean`` and biased ``var``, ``(C,)`` float64; ``count``, global
        values per channel (0-dim).

    Synchronises: one all_reduce in forward and one in backward, on every rank of the group.
    """
    return _SyncBatchNormFunction.apply(x, weight, bias, eps, process_group)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks, for any device and backend (gloo too).

    Constructor, parameters, buffers and ``state_dict`` keys as ``nn.BatchNorm2d`` (their
    checkpoints load into each other), formulas as ``torch.nn.SyncBatchNorm``; inputs ``(N, C)``,
    ``(N, C, L)``, ``(N, C, H, W)``, ``(N, C, D, H, W)``; ``process_group`` None: all ranks.

    Training with more than one rank: two all_reduce calls per step, so every rank of the group
    calls forward and backward equally often. Eval, or one process: exactly ``F.batch_norm`` of
    the local batch, no communication (ranks may run different numbers of evaluation batches).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {input.dim()}-D "
                             f"input of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input of shape "
                             f"{tuple(input.shape)}")

    def _factor(self) -> float:
        """The running-average factor for this step (as ``_BatchNorm.forward`` computes it)."""
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
            return self.momentum
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` ``(N, C, *)``; synchronises in training mode (see class doc)."""
        self._check_input_dim(input)
        # torch's rule (nn.SyncBatchNorm.forward, torch/nn/modules/batchnorm.py): batch
        # statistics in training, and in eval when there are no running stats
        # (track_running_stats=False); synchronise only in training ("Don't sync batchnorm
        # stats in inference mode"): eval without running stats uses the local batch.
        use_batch_stats = self.training or (self.running_mean is None
                                            and self.running_var is None)
        need_sync = self.training and _group_size(self.process_group) > 1
        factor = self._factor()
        if not need_sync:
            # One process, or eval: plain batch norm of the local batch, bit for bit
            # (the same call nn.BatchNorm2d.forward makes); no communication.
            keep = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if keep else None,
                                self.running_var if keep else None, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        y, mean, var, count = sync_batch_norm(input, self.weight, self.bias, self.eps,
                                              self.process_group)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                n = float(count)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        return y


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` (nested ones too; synchronising ones
    left alone) by :class:`SyncBatchNorm` with ``process_group``. Call it after moving the
    model to its device and before wrapping it in DDP.

    The new layers *share* the weight and bias (as torch's converter) and take the running
    statistics and batch counter: same eval output, same ``state_dict``; ``training`` flags,
    ``requires_grad`` and devices kept.

    Returns:
        ``module``, changed in place, or the new layer when ``module`` is a BatchNorm.
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm,
                                                                  nn.SyncBatchNorm)):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        if module.track_running_stats:
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            out.add_module(name, new)
    return out


def count_batchnorm(module: nn.Module) -> dict[str, int]:
    """How many layers of each normalisation kind ``module`` holds, e.g. ``{"BatchNorm2d": 14}``."""
    counts: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, _BatchNorm):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts
