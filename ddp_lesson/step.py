"""One optimizer step of the training job, on the global batch.

:func:`train_step` is what every rank runs for each step of ``python -m ddp_lesson.train``:
the loss is the mean over the labelled pixels of the whole *global* batch (one small
all_reduce of the pixel count per step), and :func:`accumulate_gradients` runs the
micro-batches of a step with ``no_sync`` on all but the last, so the gradients are
all-reduced once per step (docs/pitfalls.md B4, B5). :class:`Precision` adds mixed precision
(autocast in bf16 or fp16, a ``torch.amp.GradScaler`` for fp16) and gradient clipping to a
step, and records the step's total gradient norm and whether the scaler skipped it.
:class:`StepTimer` measures the phases of a step (data, forward, backward, comm, optimizer)
for the benchmarks.

The :class:`ddp_lesson.train.Trainer` drives these; benchmarks and tests call them directly.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F

from .config import AMP_MODES
from .data import IGNORE_INDEX
from .env import all_reduce_sum, group_active, reduce_device

__all__ = ["AMP_MODES", "Precision", "StepTimer", "accumulate_gradients", "cuda_bf16_native",
           "model_logits", "sum_over_ranks", "train_step"]

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum a CPU tensor over ranks; returns a CPU tensor (a synchronisation point).

    Every rank must call it with a tensor of the same shape and dtype; without a process
    group it returns a copy.
    """
    # NCCL reduces CUDA tensors only; gloo is happy with CPU ones.
    return all_reduce_sum(t.to(reduce_device())).cpu()


def _sum_over_ranks_in_place(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks; the result stays on ``t``'s device (no read to the host).

    Under NCCL with ``t`` on the rank's GPU and under gloo with ``t`` on the CPU there is no
    copy at all; without a process group it is a copy. Every rank must call it alike.
    """
    where = reduce_device() if group_active() else t.device
    return all_reduce_sum(t.to(where)).to(t.device)


def model_logits(model, images):
    """``model(images)``, unwrapped when the model returns a dict: ``(B, C, H, W)`` logits."""
    out = model(images)
    if isinstance(out, dict):  # torchvision-style segmentation models return {"out": ...}
        out = out["out"]
    return out


class StepTimer:
    """Wall-clock seconds per phase of a training step (data, forward, backward, comm, optimizer).

    ``with timer.phase("forward"): ...`` adds the block's duration to that phase. On CUDA
    pass ``sync=torch.cuda.synchronize`` so that a phase ends when its kernels do, not when
    they were queued. Local to the process: no communication.
    """

    def __init__(self, sync=None):
        self.sync = sync
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.sync:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
            self.counts[name] = self.counts.get(name, 0) + 1

    def reset(self) -> None:
        self.totals.clear()
        self.counts.clear()


def _phase(timer, name):
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


class Precision:
    """Mixed precision and gradient clipping for :func:`train_step` (one per process).

    ``amp="bf16"`` / ``"fp16"`` runs each forward under ``torch.autocast(device_type,
    dtype)``; the loss is computed in float32 from the logits. ``"fp16"`` also needs a
    ``torch.amp.GradScaler`` (one per process, built here unless one is given): the loss is
    multiplied by the scale before backward, so small fp16 gradients do not flush to zero;
    before the optimizer step the gradients are unscaled, checked for inf/NaN, and the step is
    skipped (and the scale halved) when there are any; after ``growth_interval`` good steps
    the scale doubles (torch/amp/grad_scaler.py). bf16 has fp32's exponent range: no scaler.

    ``clip_grad_norm > 0`` clips the total L2 norm of the gradients to that value with
    ``torch.nn.utils.clip_grad_norm_``, after ``scaler.unscale_(optimizer)`` under fp16 (the
    norm of *scaled* gradients would be compared with the limit otherwise), once per optimizer
    step: after the last micro-batch's backward, the one that all-reduces, so the norm is the
    norm of the averaged gradient and the same, bit for bit, on every rank.

    After each step :attr:`grad_norm` holds the total norm before clipping, a 0-d float32
    tensor on the gradients' device (None when not clipping: read it at a logging boundary,
    ``float(...)`` waits for the GPU), and :attr:`skipped` whether the scaler skipped the
    step. Local to the process; the norm needs no communication because the gradients are
    already all-reduced. Host reads: none per step without fp16; under fp16 torch's
    ``GradScaler.step`` itself reads the inf/NaN flags to the host (``.item()`` in
    ``_maybe_opt_step``, torch/amp/grad_scaler.py); :attr:`skipped` comes from an optimizer
    step post-hook (a fused optimizer's from the scale, read to the host).

    Raises:
        ValueError: ``amp`` not in :data:`AMP_MODES`, ``clip_grad_norm < 0``, or autocast
            not available for ``device_type`` and the dtype.
    """

    def __init__(self, amp: str = "off", device_type: str = "cpu",
                 clip_grad_norm: float = 0.0, scaler=None):
        if amp not in AMP_MODES:
            raise ValueError(f"amp {amp!r} is not one of {', '.join(AMP_MODES)}")
        if not (math.isfinite(clip_grad_norm) and clip_grad_norm >= 0):
            raise ValueError(f"clip_grad_norm must be a finite number >= 0, got {clip_grad_norm}")
        problem = amp_unavailable(amp, device_type)
        if problem:
            raise ValueError(problem)
        self.amp, self.device_type, self.clip_grad_norm = amp, device_type, clip_grad_norm
        if amp == "fp16" and scaler is None:
            scaler = torch.amp.GradScaler(device_type)
        self.scaler = scaler if amp == "fp16" else None
        self.grad_norm: torch.Tensor | None = None
        self.skipped = False

    @property
    def active(self) -> bool:
        """True when this changes anything (autocast, a scaler or clipping)."""
        return self.amp != "off" or self.clip_grad_norm > 0

    def autocast(self):
        """The forward's context: ``torch.autocast`` for bf16/fp16, nothing for off."""
        if self.amp == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_AMP_DTYPES[self.amp])

    def backward(self, loss) -> None:
        """``loss.backward()``, the loss multiplied by the scaler's scale under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer, parameters) -> None:
        """Unscale (fp16), measure and clip (``clip_grad_norm > 0``), then step the optimizer.

        Under fp16 ``scaler.step`` skips ``optimizer.step()`` when any gradient is inf/NaN
        and ``scaler.update()`` then halves the scale; :attr:`skipped` says so (read from an
        optimizer step post-hook: whether ``optimizer.step()`` ran).
        """
        self.grad_norm = None
        if self.scaler is not None and self.clip_grad_norm > 0:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        if self.clip_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(parameters, self.clip_grad_norm)
            self.grad_norm = norm.detach()  # on the device: float() would wait for the GPU
        if self.scaler is None:
            optimizer.step()
            self.skipped = False
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # a fused optimizer skips inside its own step: update() halves the scale exactly
            # when the step found inf/NaN (backoff 0.5); get_scale() reads it to the host
            scale_before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            self.skipped = self.scaler.get_scale() < scale_before
            return
        # GradScaler.step calls optimizer.step() only when no gradient is inf/NaN
        # (_maybe_opt_step, torch/amp/grad_scaler.py); a post-hook sees whether it ran, with
        # no read of the scale to the host
        stepped = []
        hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
        try:
            self.scaler.step(optimizer)
        finally:
            hook.remove()
        self.scaler.update()
        self.skipped = not stepped

    def state_dict(self) -> dict | None:
        """The scaler's state (scale, growth tracker, factors) for a checkpoint; None without."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the scaler's state from :meth:`state_dict` (ignored when None)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def amp_unavailable(amp: str, device_type: str) -> str | None:
    """Why autocast in ``amp`` cannot run on ``device_type``, or None when it can (local).

    bf16 on CUDA needs a GPU that computes in bfloat16 natively (:func:`cuda_bf16_native`:
    compute capability 8 and up, Ampere and later). ``torch.cuda.is_bf16_supported()`` with
    its default ``including_emulation=True`` is not that test: it also answers True when a
    bfloat16 tensor can merely be created on the device (torch/cuda/__init__.py,
    ``is_bf16_supported`` and ``_check_bf16_tensor_supported``), which a T4 (7.5) allows, and
    cuDNN has no bfloat16 convolutions there. On CPU torch 2.13 autocasts to bf16 and fp16
    (``torch.amp.autocast_mode.is_autocast_available``).
    """
    if amp == "off":
        return None
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return f"--amp {amp}: autocast is not available on device type {device_type!r}"
    if amp == "bf16" and device_type == "cuda" and not cuda_bf16_native():
        return (f"--amp bf16: this GPU ({torch.cuda.get_device_name()}) does not support "
                "bfloat16; use --amp fp16")
    return None


def cuda_bf16_native() -> bool:
    """True when the current CUDA device computes in bfloat16 natively (local, no sync).

    ``torch.cuda.is_bf16_supported(including_emulation=False)``: True on ROCm, False without
    CUDA, else compute capability >= 8 (torch/cuda/__init__.py, ``is_bf16_supported``). An
    older torch whose ``is_bf16_supported`` takes no ``including_emulation`` raises
    TypeError: then the same test is made here from ``torch.version.hip`` and the device's
    compute capability (``torch.cuda.get_device_properties(...).major``).
    """
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # an older torch: no including_emulation argument
        if torch.version.hip:
            return True
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


# --------------------------------------------------------------------------- one step

def accumulate_gradients(model, micro_batches, compute_loss, timer=None,
                         backward=None) -> None:
    """Forward and backward over ``K`` micro-batches, all-reducing gradients only on the last.

    Micro-batches ``0 .. K-2`` run inside ``model.no_sync()`` (when the wrapper has it):
    their gradients accumulate locally in ``.grad``; the last one runs normally, and its
    backward all-reduces the accumulated sums (docs/pitfalls.md B4: sync on the *last*
    micro-batch, or the ranks end with different gradients). Forward *and* backward go inside
    ``no_sync``: torch's DDP decides during forward whether the next backward syncs.

    Args:
        model: the (wrapped) model.
        micro_batches: a list of batches.
        compute_loss: ``compute_loss(model, batch) -> scalar tensor`` to backpropagate,
            already scaled (e.g. divided by the global count).
        timer: optional :class:`StepTimer` (phases "forward" and "backward").
        backward: ``backward(loss)`` (default ``loss.backward()``), e.g.
            :meth:`Precision.backward`, which multiplies by the GradScaler's scale.

    Synchronises in the last backward (DDP's gradient all_reduce).
    """
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        skip_sync = i < last and hasattr(model, "no_sync")
        with (model.no_sync() if skip_sync else contextlib.nullcontext()):
            with _phase(timer, "forward"):
                loss = compute_loss(model, batch)
            with _phase(timer, "backward"):
                if backward is None:
                    loss.backward()
                else:
                    backward(loss)


def train_step(model, optimizer, micro_batches, world_size: int, scheduler=None,
               timer=None, precision: Precision | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on the global batch: mean cross-entropy over its labelled pixels.

    Every rank sums the per-pixel losses of its micro-batches and divides by the number of
    labelled (not ``IGNORE_INDEX``) pixels in the *global* batch (all micro-batches of all
    ranks, one all_reduce), times ``world_size`` because DDP then averages over ranks. The
    gradient is then exactly the single-process gradient of the mean loss over the
    concatenated batch, whatever the share of void pixels on each rank; a per-rank mean
    would weight a rank's pixels by its own count instead.

    Args:
        model: the wrapped model (or a bare one in a single process).
        optimizer: steps once; gradients are zeroed first.
        micro_batches: list of ``(images (B, 3, H, W), target (B, H, W))`` on the model's
            device.
        world_size: R, the number of ranks DDP averages over.
        scheduler: stepped once after the optimizer, if given, and only when the optimizer
            stepped: a step the fp16 GradScaler skipped (inf/NaN gradients) does not consume
            the schedule, so the first real step runs with the schedule's first value and torch
            does not warn "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
            (``LRScheduler.step``, torch/optim/lr_scheduler.py). Accelerate does the same
            (``AcceleratedScheduler.step`` returns when an optimizer's ``step_was_skipped``,
            src/accelerate/scheduler.py).
        timer: optional :class:`StepTimer` (phases comm, forward, backward, optimizer).
        precision: optional :class:`Precision`: autocast for the forwards, the GradScaler,
            clipping after the last (all-reducing) backward; it records the step's gradient
            norm and whether the step was skipped. None: plain fp32, no clipping.

    Returns:
        ``(local_loss_sum, local_pixel_count)``: this rank's summed per-pixel loss (a 0-d
        float64 tensor) and its labelled pixel count (0-d int64), both on the batch's device
        (sum both over ranks and divide for the global mean; ``float(...)`` reads them).

    Synchronises: one all_reduce of the pixel count, DDP's gradient all_reduce. Reads
    nothing to the host (no ``.item()``, ``float(tensor)``): on CUDA the step is queued
    and the CPU runs ahead, the pixel count and the scale stay on the GPU; under fp16 torch's
    GradScaler reads its inf/NaN flags (see :class:`Precision`).
    """
    if not micro_batches:
        raise ValueError("train_step needs at least 1 micro-batch, got 0")
    local_count = sum((t != IGNORE_INDEX).sum() for _, t in micro_batches)
    with _phase(timer, "comm"):
        global_count = _sum_over_ranks_in_place(local_count.to(torch.float64))
    # the same float64 division as world_size / max(count, 1.0) on the host, cast to float32
    # by the multiplication below as the Python float was
    scale = world_size / global_count.clamp(min=1.0)
    sums = []

    autocast = precision.autocast if precision is not None else contextlib.nullcontext

    def compute_loss(m, batch):
        images, target = batch
        with autocast():
            logits = model_logits(m, images)
        # the loss in float32 whatever the forward's dtype: a sum over many pixels
        s = F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX,
                            reduction="sum")
        sums.append(s.detach())
        return s * scale

    optimizer.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro_batches, compute_loss, timer,
                         precision.backward if precision is not None else None)
    with _phase(timer, "optimizer"):
        if precision is None:
            optimizer.step()
        else:
            precision.step(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        if scheduler is not None and not (precision is not None and precision.skipped):
            scheduler.step()  # a skipped step leaves the schedule where it was
    loss_sum = sums[0].double()
    for s in sums[1:]:  # in order, in float64: what float(sum(s.item() ...)) added
        loss_sum = loss_sum + s.double()
    return loss_sum, local_count
