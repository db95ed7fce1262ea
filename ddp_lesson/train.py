"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train --epochs 6

The seed program (DeepLab on Cityscapes with DistributedDataParallel) done right: one process
per rank, each with a full model, training on its shard of every epoch, DDP averaging the
gradients in ``backward()``. What changed from the seed is notebook 06's table (and
``notebooks/deep/06_the_seed_repaired.ipynb``, step by step): every hyper-parameter declared,
``LOCAL_RANK`` from torchrun, ``set_epoch``, ``ignore_index=255``, the loss over the *global*
batch's labelled pixels (docs/pitfalls.md B5), exact validation, one backend rule, atomic
checkpoints and an exact resume (mid-epoch, at another world size: :mod:`ddp_lesson.layout`),
accumulation with ``no_sync``, SyncBN, AMP and clipping. Bad input stops with one line
``error: ...`` naming the values (exit status 2, any checkpoint untouched). ``python -m
ddp_lesson.train`` runs one plain process: no process group, no wrapper, the same lines.

Read top to bottom: one optimizer step (:func:`train_step`, :class:`Precision`), the
:class:`Trainer` (data, model, checkpoints, evaluation, :meth:`Trainer.fit`), the entry
(:func:`main`). Flags: :mod:`ddp_lesson.config`; printed lines and ``summary.json``:
:mod:`ddp_lesson.report`; the launcher's preflight: :func:`ddp_lesson.cli.preflight`.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from . import env as dist_env
from . import faults
from .checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    capture_rng_state,
    decide_on_rank0,
    layout_problem,
    load_checkpoint,
    restore_rng_state,
    resume_plan,
    run_on_rank0,
    save_checkpoint,
    strip_module_prefix,
    sweep_temporaries,
)
from .config import (
    AMP_MODES,
    TrainConfig,
    TrainInputError,
    check_steps,
    derived_values,
    layout_for,
    parse_config,
)
from .data import IGNORE_INDEX, NUM_CLASSES, load_datasets
from .env import all_reduce_sum, group_active, print0, reduce_device
from .evaluation import evaluate_exact
from .layout import LayoutBatchSampler
from .metrics import miou_from_confusion
from .models import build_model
from .report import (
    epoch_line,
    epoch_stats,
    resume_lines,
    run_summary,
    start_lines,
    write_json_atomic,
)
from .syncbn import convert_sync_batchnorm

# Trainer.step calls train_step through this module's globals, so a test can replace
# ``ddp_lesson.train.train_step`` to simulate a crash.
__all__ = ["Precision", "StepRecord", "Trainer", "accumulate_gradients",
           "cuda_bf16_native", "main", "model_logits", "sum_over_ranks",
           "train_step", "wrap_model"]

# --------------------------------------------------------------------------- one step

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _sum_over_ranks_in_place(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks, the result on ``t``'s device: no read to the host, no copy when
    ``t`` is where the backend reduces (synchronises; every rank alike)."""
    where = reduce_device() if group_active() else t.device
    return all_reduce_sum(t.to(where)).to(t.device)


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks; returns a new CPU tensor of the same shape and dtype.

    Synchronises: every rank calls it with the same shape and dtype. Without a process group
    it returns a copy (:func:`ddp_lesson.env.all_reduce_sum`).
    """
    return all_reduce_sum(t.to(reduce_device())).cpu()  # NCCL reduces CUDA tensors only


def model_logits(model, images):
    """``model(images)``, unwrapped when the model returns a dict: ``(B, C, H, W)`` logits."""
    out = model(images)
    if isinstance(out, dict):  # torchvision-style segmentation models return {"out": ...}
        out = out["out"]
    return out


def _phase(timer, name):
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


class Precision:
    """Mixed precision and gradient clipping for :func:`train_step` (one per process, local).

    ``amp="bf16"``/``"fp16"`` runs each forward under ``torch.autocast``; the loss is computed
    in float32. ``"fp16"`` adds a ``torch.amp.GradScaler`` (bf16 has fp32's exponent range):
    the loss is scaled before backward so small gradients do not flush to zero, a step with
    inf/NaN gradients is skipped and the scale halved (torch/amp/grad_scaler.py, whose
    ``_maybe_opt_step`` reads the inf/NaN flags to the host). ``clip_grad_norm > 0`` clips the
    total L2 norm once per step, after the last (all-reducing) backward and ``unscale_``: the
    averaged gradient's norm, the same bit for bit on every rank. After each step
    :attr:`grad_norm` holds it before clipping (a 0-d tensor on the gradients' device; None
    without clipping) and :attr:`skipped` whether the scaler skipped the step.

    Raises:
        ValueError: ``amp`` not in :data:`AMP_MODES`, ``clip_grad_norm < 0``, or autocast
            not available for ``device_type`` and the dtype (:func:`amp_unavailable`).
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

        Call it after backward, on gradients already all-reduced: no collective of its own
        (every rank computes the same norm). ``parameters``: the optimizer's. Sets
        :attr:`grad_norm` (0-d tensor on the device: the L2 norm before clipping, None
        without clipping) and :attr:`skipped`: under fp16 ``scaler.step`` skips
        ``optimizer.step()`` when a gradient is inf/NaN, and ``scaler.update()`` then halves
        the scale (``torch/amp/grad_scaler.py``).
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

    bf16 on CUDA needs native bfloat16 (:func:`cuda_bf16_native`); on CPU torch 2.13
    autocasts to bf16 and fp16 (``torch.amp.autocast_mode.is_autocast_available``).
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

    ``torch.cuda.is_bf16_supported(including_emulation=False)`` (torch/cuda/__init__.py, the
    argument exists on every torch in the range): True on ROCm, False without CUDA, else compute
    capability >= 8; the default ``True`` also says True where a bfloat16 tensor can merely be
    created (``_check_bf16_tensor_supported``: a T4, 7.5).
    """
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def accumulate_gradients(model, micro_batches, compute_loss, timer=None,
                         backward=None) -> None:
    """Forward and backward over ``K`` micro-batches, all-reducing gradients only on the last.

    Micro-batches ``0 .. K-2`` run forward *and* backward inside ``model.no_sync()`` (torch's
    DDP decides in forward whether the next backward syncs): their gradients accumulate
    locally, the last backward all-reduces the sums (docs/pitfalls.md B4). ``compute_loss(model,
    batch)`` returns the scaled loss; ``backward(loss)`` defaults to ``loss.backward()``;
    ``timer``: an optional StepTimer. Synchronises in the last backward.
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

    Each rank sums its micro-batches' per-pixel losses and divides by the labelled (not
    ``IGNORE_INDEX``) pixels of the *global* batch (one all_reduce), times ``world_size``
    because DDP then averages: exactly the single-process gradient of the mean over the
    concatenated batch, whatever each rank's share of void pixels. ``micro_batches``:
    ``(images (B, 3, H, W), target (B, H, W))`` pairs on the model's device; ``scheduler``
    steps only when the optimizer did (a step the fp16 GradScaler skipped does not consume
    the schedule: ``LRScheduler.step`` warns otherwise; Accelerate's
    ``AcceleratedScheduler.step`` does the same); ``timer``: an optional StepTimer (phases
    comm, forward, backward, optimizer); ``precision``: a :class:`Precision`, None for fp32.

    Returns:
        ``(local_loss_sum, local_pixel_count)``: this rank's summed loss (0-d float64, summed
        in float32 per micro-batch) and labelled pixel count (0-d int64) on the batch's device.

    Synchronises: the pixel count's all_reduce and DDP's. Reads nothing to the host (under
    fp16 the GradScaler reads its flags).
    """
    if not micro_batches:
        raise ValueError("train_step needs at least 1 micro-batch, got 0")
    local_count = sum((t != IGNORE_INDEX).sum() for _, t in micro_batches)
    with _phase(timer, "comm"):
        global_count = _sum_over_ranks_in_place(local_count.to(torch.float64))
    scale = world_size / global_count.clamp(min=1.0)
    sums = []

    autocast = precision.autocast if precision is not None else contextlib.nullcontext

    def compute_loss(m, batch):
        images, target = batch
        with autocast():
            logits = model_logits(m, images)
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
    return sum(s.double() for s in sums), local_count


class StepRecord(NamedTuple):
    """One optimizer step: ``loss_sum / pixel_count`` is its mean loss.

    In :attr:`Trainer.step_log` the numbers are floats summed over ranks; a pending record
    holds this rank's own as 0-d tensors on its device, read at the next flush.
    """

    epoch: int
    step_in_epoch: int
    loss_sum: float
    pixel_count: float
    #: norm of the all-reduced gradients before clipping (``--clip-grad-norm``; else None)
    grad_norm: float | None = None
    #: True when the fp16 GradScaler skipped this step (inf/NaN in the gradients)
    skipped: bool = False


# --------------------------------------------------------------------------- the trainer

class Trainer:
    """Everything one rank needs to train, built on every rank after ``init_distributed``.

    :meth:`fit` runs the epochs; benchmarks and tests drive single steps (:meth:`batches`,
    :meth:`step`). ``layout=(R, K)``: ranks and accumulation steps of the run a checkpoint
    continues, when not this one's. Attributes: ``cfg``, ``env``, ``device``, ``derived``
    (:func:`~ddp_lesson.config.derived_values`); ``layout`` (the run's micro-batches,
    :class:`~ddp_lesson.layout.DataLayout`) and ``batch_sampler`` (this rank's share);
    ``module`` (bare, what checkpoints hold) and ``model`` (wrapped); ``optimizer`` (SGD),
    ``scheduler`` (LambdaLR), ``precision``; ``epoch``, ``step_in_epoch``, ``global_step``
    (the resume point); ``history`` (one dict per epoch); ``step_log`` (one
    :class:`StepRecord` per step, summed over ranks).

    Construction synchronises: the wrapper broadcasts rank 0's parameters and buffers
    (:func:`wrap_model`).

    Raises:
        TrainInputError: bad data folder, zero steps per epoch, ``--amp`` unavailable, a
            ``layout`` this world size cannot share.
    """

    def __init__(self, cfg: TrainConfig, env, device=None, layout: tuple[int, int] | None = None):
        self.cfg, self.env = cfg, env
        self.device = torch.device(env.device if device is None else device)
        check_amp(cfg, self.device.type)
        train_ds, self.val_set = load_datasets(cfg)
        # The micro-batches of the run that started training (R, K): this run's own, or, when
        # it resumes a checkpoint written at another world size, that run's (ddp_lesson.layout).
        r, k = layout if layout is not None else (env.world_size, cfg.grad_accum_steps)
        self.layout = layout_for(cfg, len(train_ds), r, k)
        problem = layout_problem(self.checkpoint_path, self.layout, env.world_size)
        if problem:  # every rank alike, before any collective
            raise TrainInputError(problem)
        self.derived = derived_values(cfg, env.world_size, len(train_ds), self.layout)
        check_steps(cfg, self.derived, len(train_ds))
        # This rank's micro-batches of each epoch (shuffled with seed + epoch, the same on every
        # rank): at the layout's world size exactly a DistributedSampler's and a DataLoader's.
        self.batch_sampler = LayoutBatchSampler(self.layout, env.world_size, env.rank)
        # Own generator: iter(loader) draws a seed from it, not from the global RNG, so an
        # epoch restarted mid-way leaves the global RNG as an unbroken one would.
        self.train_loader = DataLoader(
            train_ds, batch_sampler=self.batch_sampler,
            generator=torch.Generator().manual_seed(cfg.seed),
            num_workers=cfg.workers, pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.workers > 0)
        if len(self.train_loader) != self.derived["micro_batches_per_epoch"]:
            raise RuntimeError(
                f"micro-batches per epoch: the loader has {len(self.train_loader)}"
                f", derived_values expected {self.derived['micro_batches_per_epoch']}"
                f" (N={len(train_ds)}, R={env.world_size}, B={cfg.batch_size}, "
                f"drop_last={cfg.drop_last})"
            )

        self.module, self.model = self._build_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(),
                                         lr=self.derived["effective_lr"],
                                         momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        total = cfg.epochs * self.derived["steps_per_epoch"]
        poly = cfg.lr_schedule == "poly"  # DeepLab's (1 - step/total)**0.9, else constant
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: max(0.0, 1.0 - step / total) ** 0.9 if poly else 1.0)
        self.precision = Precision(cfg.amp, self.device.type, cfg.clip_grad_norm or 0.0)
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.history: list[dict] = []
        self.step_log: list[StepRecord] = []
        self._pending: list[StepRecord] = []  # this rank's, not yet summed over ranks
        self.resumed_from: dict | None = None
        self.per_class_iou = None

    # ---- model
    def _build_model(self):
        cfg = self.cfg
        # Same seed on every rank: identical initial weights (DDP would broadcast rank 0's
        # anyway, but a 1-process run then starts from the same weights as an N-process run).
        torch.manual_seed(cfg.seed)
        module = build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width)
        module = module.to(self.device)
        if cfg.sync_bn:  # after .to(device), before wrapping: docs/pitfalls.md B11
            module = (torch.nn.SyncBatchNorm.convert_sync_batchnorm
                      if self.device.type == "cuda" else convert_sync_batchnorm)(module)
        return module, wrap_model(module, cfg.ddp, self.env, self.device, cfg.bucket_cap_mb,
                                  cfg.static_graph, cfg.gradient_as_bucket_view)

    # ---- data
    def batches(self, epoch: int, start_step: int = 0):
        """Yield ``(step_in_epoch, micro_batches, data_seconds)`` for this epoch's steps from
        ``start_step`` on (the steps before it were taken), tensors on the rank's device."""
        self.batch_sampler.set_epoch(epoch)
        self.batch_sampler.start_step = start_step
        it = iter(self.train_loader)
        for step in range(start_step, self.derived["steps_per_epoch"]):
            n = self.batch_sampler.micro_batches_in_step(step)
            start = time.perf_counter()
            group = []
            for _ in range(n):
                images, target = next(it)
                group.append((images.to(self.device, non_blocking=True),
                              target.to(self.device, non_blocking=True)))
            yield step, group, time.perf_counter() - start

    def step(self, micro_batches, timer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step (:func:`train_step`); advances the counters and returns this
        rank's ``(loss_sum, pixel_count)``, 0-d tensors on its device."""
        self.model.train()
        precision = self.precision if self.precision.active else None
        result = train_step(self.model, self.optimizer, micro_batches, self.env.world_size,
                            self.scheduler, timer, precision=precision)
        self._pending.append(StepRecord(self.epoch, self.step_in_epoch, *result,
                                        grad_norm=self.precision.grad_norm,
                                        skipped=self.precision.skipped))
        self.step_in_epoch += 1
        self.global_step += 1
        return result

    def _flush_losses(self) -> None:
        """Sum the pending steps' (loss_sum, count) over ranks into :attr:`step_log` (sync):
        the one read to the host for these steps' sums and gradient norms."""
        if not self._pending:  # the same on every rank: they step in lockstep
            return
        local = torch.stack([torch.stack([torch.as_tensor(p.loss_sum, dtype=torch.float64),
                                          torch.as_tensor(p.pixel_count, dtype=torch.float64)])
                             .to(self.device) for p in self._pending])
        total = sum_over_ranks(local).tolist()
        norms = [None if p.grad_norm is None else float(p.grad_norm) for p in self._pending]
        self.step_log += [p._replace(loss_sum=s, pixel_count=c, grad_norm=n)
                          for p, (s, c), n in zip(self._pending, total, norms)]
        self._pending = []

    # ---- checkpoints
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.cfg.out, CHECKPOINT_FILE)

    def checkpoint_state(self, rng_states) -> dict:
        """The checkpoint for the current position (built on rank 0; no communication).

        ``model``: the bare module's state_dict (B12); ``epoch``: the epoch in progress
        (``epochs`` when done), ``step_in_epoch`` its steps taken; ``cursor``: the samples of
        its padded permutation read and the layout (R, K, B) of the run that started training;
        ``rng``: every rank's generators (``rng_states``, in rank order); ``scaler``: the fp16
        GradScaler's state. Plain types only: ``torch.load(weights_only=True)`` reads it.
        """
        lay = self.layout
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "sampler": {"seed": self.cfg.seed, "epoch": self.epoch, "shuffle": True,
                        "drop_last": self.cfg.drop_last, "num_replicas": lay.world_size},
            "cursor": {"epoch": self.epoch, "samples": lay.cursor(self.step_in_epoch),
                       "world_size": lay.world_size, "grad_accum_steps": lay.grad_accum_steps,
                       "batch_size": lay.batch_size},
            "rng": rng_states,
            "config": asdict(self.cfg),
            "world_size": self.env.world_size,
            "history": self.history,
            "step_log": [list(r) for r in self.step_log],
            "scaler": self.precision.state_dict(),  # same on every rank: one per process
            "torch": str(torch.__version__),
        }

    def save(self) -> None:
        """Write the checkpoint (all ranks call it; rank 0 writes; synchronises, B14)."""
        self._flush_losses()
        rng = capture_rng_state()
        if group_active() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, rng)  # every rank's generators, for exact resume
        else:
            states = [rng]
        hook = faults.during_save(self.cfg, self.env.rank, self.global_step)
        try:
            # the state is built on rank 0 inside the protocol: an error there reaches every rank
            save_checkpoint(None, self.checkpoint_path, before_replace=hook,
                            build=lambda: self.checkpoint_state(states))
        except OSError as exc:
            raise TrainInputError(str(exc)) from None

    def try_resume(self) -> bool:
        """Resume from ``{out}/checkpoint.pt`` if there is one (and not ``--no-resume``); True
        when state was restored. Rank 0 decides whether the file exists (B14); every rank then
        loads it, mapped to its own device. Synchronises.

        Raises:
            TrainInputError: (every rank) the checkpoint's cursor does not match this layout.
        """
        path = self.checkpoint_path
        if self.cfg.no_resume or not decide_on_rank0(lambda: os.path.exists(path)):
            return False
        ckpt = load_checkpoint(path, map_location=self.device)
        cursor = ckpt.get("cursor")
        if cursor and cursor["samples"] != self.layout.cursor(ckpt["step_in_epoch"]):
            raise TrainInputError(  # the same file and arithmetic on every rank
                f"checkpoint {path}: its cursor says {cursor['samples']} samples of epoch "
                f"{ckpt['epoch'] + 1} were read, but {ckpt['step_in_epoch']} steps of "
                f"{self.layout.global_batch} read {self.layout.cursor(ckpt['step_in_epoch'])};"
                " move it away or pass --no-resume to start over")
        self.module.load_state_dict(strip_module_prefix(ckpt["model"]))
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.epoch, self.step_in_epoch = ckpt["epoch"], ckpt["step_in_epoch"]
        self.global_step = ckpt["global_step"]
        self.history = list(ckpt.get("history", []))
        self.step_log = [StepRecord(*x) for x in ckpt.get("step_log", [])]
        # the scale and its growth tracker decide which later steps are skipped: restore them
        self.precision.load_state_dict(ckpt.get("scaler"))
        rng = ckpt["rng"]
        restore_rng_state(rng[self.env.rank] if len(rng) == self.env.world_size else rng[0])
        self.resumed_from = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                             "global_step": self.global_step}
        if self.global_step > 0:
            self._settle_ddp_buckets()
        return True

    def _settle_ddp_buckets(self) -> None:
        """Give a resumed torch DDP the bucket layout the interrupted run had (synchronises).

        torch's DDP rebuilds its buckets after the first backward, in the order gradients became
        ready; with 3 or more ranks an element's place in its bucket decides the order of the
        all-reduce's sum, so a fresh wrapper's first step would differ in the last bit. One
        forward and backward of a zero batch (gradients dropped, buffers restored) lets it
        rebuild as before, changing no state. The package's wrappers never rebuild.
        """
        if not isinstance(self.model, DistributedDataParallel):
            return
        buffers = {k: v.clone() for k, v in self.module.named_buffers()}
        h, w = self.cfg.size
        zeros = torch.zeros(2, 3, h, w, device=self.device)
        self.model.train()
        (model_logits(self.model, zeros).sum() * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, v in self.module.named_buffers():
                v.copy_(buffers[k])

    # ---- evaluation
    def validate(self) -> tuple[float, float]:
        """Exact mIoU and pixel accuracy over the whole validation set (synchronises)."""
        # Rank 0's BatchNorm statistics everywhere: DDP broadcasts them at each training
        # forward, but the last step updated them after that, on each rank alone.
        if group_active() and dist.get_world_size() > 1:
            for buf in self.module.buffers():
                dist.broadcast(buf, src=0)
        # The bare module: DDP's forward may sync buffers, a collective, and ranks hold
        # different numbers of validation batches.
        self.module.eval()

        def predict(images):
            return model_logits(self.module, images).argmax(1)

        # Each rank evaluates its unpadded shard (every sample once, no collective per batch);
        # the integer counts are summed over ranks once.
        result = evaluate_exact(predict, self.val_set, num_classes=NUM_CLASSES,
                                batch_size=self.cfg.batch_size, ignore_index=IGNORE_INDEX,
                                device=self.device, num_replicas=self.env.world_size,
                                rank=self.env.rank, num_workers=self.cfg.workers)
        miou, self.per_class_iou, pixel_acc = miou_from_confusion(result.confusion)
        return miou, pixel_acc

    # ---- the loop
    def fit(self) -> dict:
        """Train from the current position to the end (or ``--max-steps``); returns run facts.

        Writes the checkpoint every ``checkpoint_every_steps`` steps and after each epoch's
        evaluation; prints one line per epoch on rank 0. Synchronises at every step, at
        every checkpoint and after each epoch.
        """
        cfg, env, d = self.cfg, self.env, self.derived
        steps = d["steps_per_epoch"]
        train_seconds, train_samples = 0.0, 0
        stopped = bool(cfg.max_steps) and self.global_step >= cfg.max_steps
        if stopped:
            print0(f"global step {self.global_step} already reached --max-steps "
                   f"{cfg.max_steps}; nothing to train", env=env)
        while self.epoch < cfg.epochs and not stopped:
            epoch, start_step = self.epoch, self.step_in_epoch
            remaining = max(0, steps - start_step)
            lay = self.layout  # all ranks' samples: the epoch's cursor at its end, and now
            samples_left = lay.cursor(steps) - lay.cursor(start_step)
            bar = tqdm(total=samples_left, unit=" samples", unit_scale=True,
                       desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not env.is_main,
                       leave=False, dynamic_ncols=True, mininterval=1.0)
            start = time.perf_counter()
            shown = -math.inf
            for step, group, _data_s in (self.batches(epoch, start_step) if remaining else ()):
                loss_sum, count = self.step(group)
                n = lay.cursor(step + 1) - lay.cursor(step)  # the global batch, all ranks
                train_samples += n
                bar.update(n)
                # reading the loss waits for the GPU: only for a bar that shows, once a second
                if not bar.disable and time.perf_counter() - shown >= bar.mininterval:
                    shown = time.perf_counter()
                    bar.set_postfix(loss=f"{float(loss_sum) / max(float(count), 1.0):.3f}",
                                    refresh=False)
                last_of_epoch = self.step_in_epoch == steps
                if cfg.max_steps and self.global_step >= cfg.max_steps:
                    stopped = True
                    break
                if (cfg.checkpoint_every_steps and not last_of_epoch
                        and self.global_step % cfg.checkpoint_every_steps == 0):
                    self.save()
                faults.after_step(cfg, env.rank, self.global_step)
            train_seconds += time.perf_counter() - start
            bar.close()
            if stopped:
                self.save()
                print0(f"stopped after global step {self.global_step} (--max-steps "
                       f"{cfg.max_steps}), epoch {epoch + 1} step {self.step_in_epoch}/{steps}; "
                       f"checkpoint {self.checkpoint_path}; run again with the same --out to "
                       "resume", env=env)
                break
            self._flush_losses()
            rows = [r for r in self.step_log if r.epoch == epoch]
            train_loss = (sum(r.loss_sum for r in rows)
                          / max(sum(r.pixel_count for r in rows), 1.0))
            miou, pixel_acc = self.validate()
            self.history.append({"epoch": epoch + 1, "train_loss": train_loss, "val_miou": miou,
                                 "val_pixel_accuracy": pixel_acc, **epoch_stats(rows, cfg)})
            print0(epoch_line(self.history[-1], cfg), env=env)
            self.epoch, self.step_in_epoch = epoch + 1, 0
            self.save()
        return {"train_seconds": train_seconds, "train_samples": train_samples,
                "stopped": stopped}

def wrap_model(module, kind: str, env, device, bucket_cap_mb: float | None = None,
               static_graph: bool = False, gradient_as_bucket_view: bool = False):
    """Wrap ``module`` for data parallelism: torch's DDP, or notebook 04's NaiveDDP/BucketedDDP.

    No wrapper without a process group. ``naive``/``bucketed`` are the cores
    (``ddp_lesson/core/``). torch's DDP gets ``device_ids`` only on CUDA, no
    ``find_unused_parameters`` (every parameter gets a gradient each step). ``bucket_cap_mb``
    goes to torch's DDP and BucketedDDP; None keeps torch's default (1 MiB for the first bucket,
    25 for the others: ``_BucketCapacityConfig`` in torch 2.13's
    ``torch/nn/parallel/distributed.py``; an explicit 25 drops the small bucket).
    ``static_graph`` and ``gradient_as_bucket_view`` go to torch's DDP only
    (:class:`~ddp_lesson.config.TrainConfig` refuses them with the cores).

    The cores have what the trainer uses: ``no_sync()``, ``.module``. Buffers: torch's DDP
    broadcasts rank 0's before every training forward (``_sync_buffers``: authoritative rank 0
    without ``Join``), the cores at construction only. That is enough here: a training forward
    normalises with its batch's statistics, so the parameters do not depend on the buffers, and
    rank 0's buffers, which ``validate`` broadcasts first and rank 0 checkpoints, take the same
    values under both. CUDA: the cores' end-of-backward callback runs on the streams current at
    ``backward()``, after they waited for the gradients' streams (``GraphTask::
    exec_post_processing`` in torch's ``torch/csrc/autograd/engine.cpp``; 2.13's
    ``graph_task.h``, ``caller_current_streams_``); ``work.wait()`` makes that stream wait for
    NCCL's (``WorkNCCL::synchronize``, ``ProcessGroupNCCL.hpp``).
    Synchronises: every wrapper broadcasts rank 0's parameters and buffers at construction.
    """
    from .core.bucketed_ddp import BucketedDDP
    from .core.naive_ddp import NaiveDDP

    if not (env.distributed and group_active()):
        return module
    if kind == "naive":
        return NaiveDDP(module)
    if kind == "bucketed":
        return BucketedDDP(module, bucket_cap_mb=bucket_cap_mb)
    kwargs = {"device_ids": [env.local_rank]} if device.type == "cuda" else {}
    return DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph,
                                   gradient_as_bucket_view=gradient_as_bucket_view, **kwargs)


# --------------------------------------------------------------------------- entry point

def set_threads_from_env() -> None:
    """Set torch's intra-op threads to ``OMP_NUM_THREADS`` when it is set; never synchronises."""
    # torchrun sets OMP_NUM_THREADS=1 (with a warning) and our launcher does so quietly; make
    # torch's intra-op pool follow it, so N processes on N cores do not oversubscribe them.
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) >= 1:
        torch.set_num_threads(int(raw))


def check_amp(cfg: TrainConfig, device_type: str) -> None:
    """Raise TrainInputError when ``--amp`` cannot run on ``device_type`` (local)."""
    problem = amp_unavailable(cfg.amp, device_type)
    if problem:
        raise TrainInputError(problem)


def check_start(cfg: TrainConfig, world_size: int):
    """``(problem, (R, K))``: why ``--out``, the checkpoint there or ``--failure-rank`` stops
    this run (None when nothing does), and the layout of the run the checkpoint continues
    (None without one): :func:`~ddp_lesson.checkpoint.resume_plan`. Local: disk only."""
    problem, layout = resume_plan(cfg, world_size, lambda: build_model(
        cfg.model, num_classes=NUM_CLASSES, width=cfg.width).state_dict())
    return problem or faults.failure_rank_problem(cfg, world_size), layout


def _run(cfg: TrainConfig, env, wall_start: float) -> dict:
    def check():  # before anything is built or printed: a bad --out or checkpoint fails fast
        # rank 0, before any write: remove what killed writers left
        sweep_temporaries(os.path.join(cfg.out, CHECKPOINT_FILE), only_dead=False)
        return check_start(cfg, env.world_size)

    # rank 0 decides, all ranks act; layout: (R, K) of the run a checkpoint continues
    problem, layout = decide_on_rank0(check)
    if problem:
        raise TrainInputError(problem)
    trainer = Trainer(cfg, env, layout=layout)
    for line in start_lines(trainer):
        print0(line, env=env)
    for line in resume_lines(trainer) if trainer.try_resume() else []:
        print0(line, env=env)
    facts = trainer.fit()
    if trainer.per_class_iou is None and trainer.history and not facts["stopped"]:
        trainer.validate()  # a finished run resumed: evaluate once more for the summary
    summary = run_summary(trainer, facts, wall_start)
    path = os.path.join(cfg.out, "summary.json")
    # rank 0 writes; every rank returns once it is on disk, or raises if the write failed
    run_on_rank0(lambda: write_json_atomic(path, summary), f"write {path}")
    print0(f"wrote {path}", env=env)
    return summary


def _fail(exc: BaseException, env, owns_group: bool):
    """Print ``error: <message>`` once (rank 0), leave the group we made, exit with status 2."""
    rank = env.rank if env is not None else int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if owns_group and group_active():
        gc.collect()  # see main(): free wrappers before the group goes
        dist.destroy_process_group()  # no barrier: every rank is leaving with the same error
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    """Run the training job on every rank; returns the summary dict on every rank.

    Joins the process group unless the caller did (then leaves it as found). Synchronises at
    init, every step, every checkpoint, after each epoch and at cleanup.

    Raises:
        SystemExit: status 2 for bad input, after one line ``error: ...`` on rank 0's stderr.
    """
    wall_start = time.perf_counter()
    cfg = parse_config(argv)
    set_threads_from_env()
    owns_group = not group_active()
    env = None
    try:
        try:
            # "auto" defers to DDP_LESSON_BACKEND (set by %%torchrun), then to the rule.
            env = dist_env.init_distributed(
                timeout=cfg.timeout_s, backend=None if cfg.backend == "auto" else cfg.backend,
                announce=False)
        except ValueError as exc:  # unknown backend, nccl without GPUs, bad torchrun vars
            raise TrainInputError(str(exc)) from None
        check_amp(cfg, torch.device(env.device).type)  # every rank alike: same device type
        summary = _run(cfg, env, wall_start)
    except TrainInputError as exc:
        _fail(exc, env, owns_group)
    if owns_group:
        # Free the DDP wrapper (it lives in reference cycles) while the interpreter is fully
        # alive: a process group kept alive by it until interpreter shutdown can abort the
        # process there ("terminate called without an active exception", gloo worker threads).
        gc.collect()
        dist_env.cleanup()
    return summary


if __name__ == "__main__":
    main()
