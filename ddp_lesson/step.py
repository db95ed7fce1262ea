"""One optimizer step of the training job, on the global batch.

:func:`train_step` is what every rank runs for each step of ``python -m ddp_lesson.train``:
the loss is the mean over the labelled pixels of the whole *global* batch (one small
all_reduce of the pixel count per step), and :func:`accumulate_gradients` runs the
micro-batches of a step with ``no_sync`` on all but the last, so the gradients are
all-reduced once per step (docs/pitfalls.md B4, B5). :class:`StepTimer` measures the phases
of a step (data, forward, backward, comm, optimizer) for the benchmarks.

The :class:`ddp_lesson.train.Trainer` drives these; benchmarks and tests call them directly.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .env import all_reduce_sum, reduce_device

__all__ = ["StepTimer", "accumulate_gradients", "model_logits", "sum_over_ranks",
           "train_step"]


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Sum a CPU tensor over ranks; returns a CPU tensor (a synchronisation point).

    Every rank must call it with a tensor of the same shape and dtype; without a process
    group it returns a copy.
    """
    # NCCL reduces CUDA tensors only; gloo is happy with CPU ones.
    return all_reduce_sum(t.to(reduce_device())).cpu()


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


# --------------------------------------------------------------------------- one step

def accumulate_gradients(model, micro_batches, compute_loss, timer=None) -> None:
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

    Synchronises in the last backward (DDP's gradient all_reduce).
    """
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        skip_sync = i < last and hasattr(model, "no_sync")
        with (model.no_sync() if skip_sync else contextlib.nullcontext()):
            with _phase(timer, "forward"):
                loss = compute_loss(model, batch)
            with _phase(timer, "backward"):
                loss.backward()


def train_step(model, optimizer, micro_batches, world_size: int, scheduler=None,
               timer=None) -> tuple[float, int]:
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
        scheduler: stepped once after the optimizer, if given.
        timer: optional :class:`StepTimer` (phases comm, forward, backward, optimizer).

    Returns:
        ``(local_loss_sum, local_pixel_count)``: this rank's summed per-pixel loss and its
        labelled pixel count (sum both over ranks and divide for the global mean).

    Synchronises: one all_reduce of the pixel count, DDP's gradient all_reduce.
    """
    local_count = sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)
    with _phase(timer, "comm"):
        global_count = sum_over_ranks(torch.tensor([float(local_count)],
                                                           dtype=torch.float64))[0].item()
    scale = world_size / max(global_count, 1.0)
    sums = []

    def compute_loss(m, batch):
        images, target = batch
        s = F.cross_entropy(model_logits(m, images), target, ignore_index=IGNORE_INDEX,
                            reduction="sum")
        sums.append(s.detach())
        return s * scale

    optimizer.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro_batches, compute_loss, timer)
    with _phase(timer, "optimizer"):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return float(sum(s.item() for s in sums)), local_count
