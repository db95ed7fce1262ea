"""What ``ddp_lesson.train`` tells its user: rank 0's start lines, the resume lines, one line
per epoch, and ``summary.json``.

The printed lines are an interface that tests and notebooks read: one fact per line, each under
100 characters with its ``[rank 0]`` prefix. The functions read a
:class:`~ddp_lesson.train.Trainer`'s state; nothing here communicates.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict

import torch

from .checkpoint import atomic_write
from .env import resolve_local_rank

__all__ = ["epoch_line", "epoch_stats", "json_safe", "resume_lines", "run_summary",
           "start_lines", "write_json_atomic"]


def start_lines(trainer) -> list[str]:
    """Rank 0's lines at start: world, backend, batch, steps, learning rate, flags."""
    cfg, env, d = trainer.cfg, trainer.env, trainer.derived
    k = d["grad_accum_steps"]
    made_of = f"{cfg.batch_size} x {env.world_size}" + (f" x {k} accumulation steps"
                                                         if k > 1 else "")
    extras = [f"ddp {cfg.ddp}" if env.distributed else "no DDP wrapper (1 process)"]
    if cfg.sync_bn:
        extras.append("sync-bn")
    if env.distributed and cfg.ddp != "naive" and cfg.bucket_cap_mb is not None:
        extras.append(f"bucket-cap-mb {cfg.bucket_cap_mb:g}")
    extras += [flag for flag, on in (("static-graph", cfg.static_graph),
                                     ("gradient-as-bucket-view", cfg.gradient_as_bucket_view))
               if on and env.distributed]
    if cfg.amp != "off":
        extras.append(f"amp {cfg.amp}" + (" (GradScaler)" if cfg.amp == "fp16" else ""))
    if cfg.clip_grad_norm is not None:
        extras.append(f"clip-grad-norm {cfg.clip_grad_norm:g}")
    lines = [
        f"world_size {env.world_size}  backend {env.backend}  device {trainer.device.type}",
        f"backend choice: {env.reason}",
        f"batch per rank {cfg.batch_size}  global batch {d['global_batch']} (= {made_of})",
        f"steps per epoch {d['steps_per_epoch']}  samples per epoch {d['samples_per_epoch']} "
        f"({d['samples_per_rank']} per rank)",
        f"lr {d['effective_lr']:.6g} (--lr {cfg.lr:g} at base global batch {cfg.base_batch}, "
        f"--lr-scaling {cfg.lr_scaling})",
        f"schedule {cfg.lr_schedule}  " + "  ".join(extras),
    ]
    if cfg.local_rank is not None:
        # Same rule as env.resolve_local_rank: the LOCAL_RANK variable wins over the flag.
        resolved = resolve_local_rank([f"--local-rank={cfg.local_rank}"])
        lines.insert(0, f"note: --local_rank={cfg.local_rank} is the legacy "
                        "torch.distributed.launch flag; torchrun sets LOCAL_RANK (rank 0 uses "
                        f"local rank {resolved}), so the flag is not needed")
    return lines


def resume_lines(trainer) -> list[str]:
    """What a resumed run continues, and what a run resumed at another world size keeps."""
    cfg, lay, d = trainer.cfg, trainer.layout, trainer.derived
    steps, where = d["steps_per_epoch"], f"resuming from {trainer.checkpoint_path}"
    if trainer.epoch >= cfg.epochs:
        lines = [f"{where}: all {cfg.epochs} epochs done; nothing left to train (--no-resume "
                 "starts over)"]
    else:
        lines = [f"{where}: epoch {trainer.epoch + 1}/{cfg.epochs}, step "
                 f"{trainer.step_in_epoch}/{steps} (global step {trainer.global_step})"]
    if lay.world_size != trainer.env.world_size:
        lines += [f"world size {lay.world_size} -> {trainer.env.world_size}: the same "
                  f"micro-batches of {lay.batch_size}, {d['grad_accum_steps']} per rank and "
                  f"step (was {lay.grad_accum_steps})",
                  f"global batch {d['global_batch']} kept; cursor at sample "
                  f"{lay.cursor(trainer.step_in_epoch)} of {d['samples_per_epoch']} this epoch"]
    return lines


def epoch_stats(rows: list, cfg) -> dict:
    """An epoch's history figures beyond the loss: ``grad_norm_mean``/``grad_norm_max`` (finite
    norms only, None without any) and ``clipped_steps`` with ``--clip-grad-norm``;
    ``skipped_steps`` with ``--amp fp16``."""
    stats = {}
    if cfg.clip_grad_norm is not None:
        norms = [
            r.grad_norm for r in rows if r.grad_norm is not None and math.isfinite(r.grad_norm)
        ]
        stats["grad_norm_mean"] = sum(norms) / len(norms) if norms else None
        stats["grad_norm_max"] = max(norms) if norms else None
        stats["clipped_steps"] = sum(n > cfg.clip_grad_norm for n in norms)
    if cfg.amp == "fp16":
        stats["skipped_steps"] = sum(bool(r.skipped) for r in rows)
    return stats


def epoch_line(entry: dict, cfg) -> str:
    """The line printed after each epoch, from its :attr:`Trainer.history` entry."""
    extra = ""
    if entry.get("grad_norm_max") is not None:
        extra += (f"  grad_norm mean {entry['grad_norm_mean']:.4g} "
                  f"max {entry['grad_norm_max']:.4g}")
    if cfg.amp == "fp16":
        extra += f"  skipped {entry['skipped_steps']}"
    return (f"epoch {entry['epoch']}/{cfg.epochs}  train_loss {entry['train_loss']:.4f}  "
            f"val_mIoU {entry['val_miou']:.4f}  "
            f"pixel_acc {entry['val_pixel_accuracy']:.4f}{extra}")


def run_summary(trainer, facts: dict, wall_start: float) -> dict:
    """The run's ``summary.json`` content, built on every rank (no communication).

    ``facts`` is what :meth:`Trainer.fit` returned; ``wall_start`` the job's start
    (``time.perf_counter()``). Non-finite numbers (a diverged run) are None, and
    ``diverged`` says so.
    """
    cfg, env, d = trainer.cfg, trainer.env, trainer.derived
    last = trainer.history[-1] if trainer.history else {}
    return json_safe({
        "world_size": env.world_size,
        "backend": env.backend,
        "backend_reason": env.reason,
        "device": trainer.device.type,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "global_batch": d["global_batch"],
        "grad_accum_steps": d["grad_accum_steps"],  # this run's K' (per rank and step)
        # the micro-batches' layout: R, K of the run that started training
        "layout": {"world_size": trainer.layout.world_size,
                   "grad_accum_steps": trainer.layout.grad_accum_steps},
        "steps_per_epoch": d["steps_per_epoch"],
        "samples_per_epoch": d["samples_per_epoch"],
        "effective_lr": d["effective_lr"],
        "global_step": trainer.global_step,
        "stopped_early": facts["stopped"],
        "resumed_from": trainer.resumed_from,
        "final_train_loss": last.get("train_loss"),
        "diverged": not math.isfinite(last.get("train_loss", 0.0)),
        "val_miou": last.get("val_miou"),
        "val_pixel_accuracy": last.get("val_pixel_accuracy"),
        "per_class_iou": (trainer.per_class_iou.tolist()
                          if trainer.per_class_iou is not None else None),
        "history": trainer.history,
        "step_losses": [r.loss_sum / r.pixel_count if r.pixel_count > 0 else None
                        for r in trainer.step_log],
        # each step's gradient norm before clipping (None without --clip-grad-norm)
        "grad_norms": [r.grad_norm for r in trainer.step_log],
        # --amp fp16: the steps the GradScaler skipped (1-based global steps), final scale
        "skipped_steps": [r.epoch * d["steps_per_epoch"] + r.step_in_epoch + 1
                          for r in trainer.step_log if r.skipped],
        "amp_scale": (trainer.precision.scaler.get_scale()
                      if trainer.precision.scaler is not None else None),
        "samples_per_s": (facts["train_samples"] / facts["train_seconds"]
                          if facts["train_seconds"] > 0 else None),
        "wall_s": time.perf_counter() - wall_start,
        "checkpoint": trainer.checkpoint_path,
        "config": asdict(cfg),
        "torch": str(torch.__version__),
    })


def json_safe(obj):
    """``obj`` with every NaN/inf float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(json_safe(v) for v in obj)
    return obj


def write_json_atomic(path: str, obj: dict) -> None:
    """Write ``obj`` as JSON, atomically (NaN/inf as null: a diverged run gets its summary)."""
    def write(fh):
        json.dump(json_safe(obj), fh, indent=2, allow_nan=False)
        fh.write("\n")

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, write, binary=False)
