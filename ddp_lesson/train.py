"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.train --epochs 6

The seed program (DeepLab on Cityscapes with DistributedDataParallel), done right.

One process per rank, started by torchrun; each rank holds a full copy of the model, trains
on its own shard of every epoch, and DDP averages the gradients with an ``all_reduce`` during
``backward()``, so every rank takes the same optimizer step. What changed from the seed:

* every hyper-parameter the program reads is declared (the seed read ``args.lr``,
  ``args.momentum`` and ``args.weight_decay`` that its parser never defined);
* the local rank comes from torchrun's ``LOCAL_RANK`` variable; the legacy ``--local_rank``
  flag is still accepted so old command lines keep working, but it is not needed;
* ``train_sampler.set_epoch(epoch)`` every epoch, so each epoch has a new shuffle (without
  it the sampler repeats epoch 0's order forever); the DataLoader gets ``shuffle=False``
  because the sampler does the shuffling;
* no ``find_unused_parameters=True``: every parameter gets a gradient in every step, and the
  flag costs an extra traversal of the autograd graph each iteration;
* ``ignore_index=255``: Cityscapes marks "void" pixels 255, which are not a class and must
  not be learned (without it the loss raises on label 255, or on CUDA trips a device-side
  assert);
* the loss is the mean over the labelled pixels of the whole *global* batch: each rank sums
  its pixels' losses and divides by the global pixel count (one small all_reduce per step),
  so R processes compute exactly the gradient one process computes on the concatenated
  batch, whatever the share of void pixels on each rank (shared/cases B5);
* validation on a sampler that gives each sample to exactly one rank, with the confusion
  matrix summed over ranks: the mIoU is exact, the same at any world size;
* backend and device chosen by one rule (:mod:`ddp_lesson.env`): NCCL + one GPU per rank
  when there are enough GPUs, gloo on CPU otherwise;
* checkpoints (:mod:`ddp_lesson.checkpoint`): rank 0 writes ``{out}/checkpoint.pt``
  atomically every ``--checkpoint-every-steps`` steps and at each epoch end; a new run with
  the same ``--out`` resumes where the last one stopped, mid-epoch too, and ends with the same
  weights bit for bit as a run that was never interrupted (the seed had ``--start-epoch``
  and no checkpoint at all);
* ``--sync-bn`` (BatchNorm statistics over the global batch, :mod:`ddp_lesson.syncbn` on
  CPU, torch's ``nn.SyncBatchNorm`` on GPUs), ``--grad-accum-steps`` (``no_sync`` on all but
  the last micro-batch), ``--lr-scaling`` (the learning rate follows the global batch),
  ``--ddp`` (torch's wrapper or this package's);
* bad input stops with one line that names the values (``error: ...``), exit status 2, and
  leaves any checkpoint untouched.

Also runs as a single process, ``python -m ddp_lesson.train``: world size 1, no process
group, no DDP wrapper, same numbers printed. Rank 0 prints the derived values at start, one
line per epoch, and writes ``{out}/summary.json`` at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from . import env as dist_env
from .data import IGNORE_INDEX
from .env import BACKENDS, print0
from .models import MODELS

#: Rules for ``--lr-scaling``: how the learning rate follows the global batch.
LR_SCALINGS = ("none", "linear", "sqrt")
#: ``--lr-schedule`` choices: constant, or DeepLab's "poly" decay ``(1 - step/total)**0.9``.
LR_SCHEDULES = ("constant", "poly")
#: ``--ddp`` choices: torch's DistributedDataParallel or this package's wrappers (ddp.py).
DDP_WRAPPERS = ("torch", "naive", "bucketed")
#: File name of the checkpoint inside ``--out``.
CHECKPOINT_FILE = "checkpoint.pt"
#: Config fields a run must share with the checkpoint it resumes from: they decide the
#: trajectory (data order, batch composition, model shape, optimiser). Others (``--out``,
#: ``--workers``, ``--max-steps``, ``--ddp``, ``--backend``, ...) may change between runs.
RESUME_MUST_MATCH = ("model", "width", "size", "seed", "num_train", "batch_size",
                     "grad_accum_steps", "drop_last", "sync_bn", "lr", "momentum",
                     "weight_decay", "lr_scaling", "base_batch", "lr_schedule", "epochs")


class TrainInputError(Exception):
    """Bad input the user can fix (flags, data folder, checkpoint, output folder).

    ``main`` prints the message as one line, ``error: <message>``, on rank 0 and exits with
    status 2, without a traceback. Raised on every rank alike (decisions taken on rank 0
    are broadcast first), so no rank is left waiting in a collective.
    """


def _note(help_: str, *flags: str, **argparse_kwargs) -> dict:
    """Field metadata: the help text, extra flag spellings, and argparse extras."""
    return {"help": help_, "flags": flags, "argparse": argparse_kwargs}


@dataclass
class TrainConfig:
    """Everything the training job reads. One field = one command-line flag.

    The flag is ``--`` + the field name with ``_`` -> ``-`` (``num_train`` ->
    ``--num-train``), plus the spellings listed in the field's metadata (the seed's
    ``-b``/``-j``). Values are checked on construction; errors show the numbers.
    """

    # Defaults sized for a 2-core CPU: 2 gloo ranks finish in about 25-55 s, and the mIoU
    # climbs every epoch (about 0.21 -> 0.34), so there is something to watch.
    epochs: int = field(default=6, metadata=_note(
        "passes over the training set"))
    batch_size: int = field(default=8, metadata=_note(
        "samples per micro-batch on EACH rank; the global batch is batch_size x world_size "
        "x grad_accum_steps", "-b"))
    workers: int = field(default=0, metadata=_note(
        "DataLoader worker processes per rank; 0 loads in the training process, which keeps "
        "the CPU path light (each worker is another process competing for the cores)", "-j"))
    lr: float = field(default=0.05, metadata=_note(
        "SGD learning rate at the base global batch --base-batch (declared here; the seed "
        "read args.lr without declaring it)"))
    momentum: float = field(default=0.9, metadata=_note("SGD momentum, in [0, 1)"))
    weight_decay: float = field(default=1e-4, metadata=_note("SGD L2 weight decay, >= 0"))
    seed: int = field(default=0, metadata=_note(
        "seeds the model init (same on every rank), the synthetic data and the sampler's "
        "shuffle"))
    num_train: int = field(default=1024, metadata=_note("training samples (synthetic set)"))
    num_val: int = field(default=128, metadata=_note("validation samples (synthetic set)"))
    size: tuple = field(default=(64, 128), metadata=_note(
        "image height and width in pixels", nargs=2, type=int, metavar=("H", "W")))
    model: str = field(default="deeplab", metadata=_note(
        "network (ddp_lesson.models.build_model): deeplab = DeepLabV3Mini, tiny = TinyConvNet",
        choices=tuple(MODELS)))
    width: int = field(default=16, metadata=_note(
        "model width: channels of the first stage (not the image width, see --size)"))
    backend: str = field(default="auto", metadata=_note(
        "collective backend; auto = DDP_LESSON_BACKEND if set, else nccl when every rank "
        "can have its own GPU, gloo on CPU otherwise", choices=BACKENDS))
    data_root: str | None = field(default=None, metadata=_note(
        "Cityscapes root folder (leftImg8bit/, gtFine/); unset = synthetic scenes",
        type=str))
    out: str = field(default="runs/main", metadata=_note(
        "output folder; rank 0 writes checkpoint.pt and summary.json there, and a run finding "
        "a checkpoint there resumes from it"))
    grad_accum_steps: int = field(default=1, metadata=_note(
        "micro-batches per optimizer step (gradient accumulation); gradients are all-reduced "
        "once, on the last one (no_sync on the others)"))
    lr_scaling: str = field(default="none", metadata=_note(
        "how the learning rate follows the global batch G: none = --lr; linear = --lr x "
        "G/--base-batch; sqrt = --lr x sqrt(G/--base-batch)", choices=LR_SCALINGS))
    base_batch: int = field(default=16, metadata=_note(
        "the global batch at which --lr is given (the default lr was tuned at 16 = 8 x 2)"))
    lr_schedule: str = field(default="constant", metadata=_note(
        "learning-rate schedule over the optimizer steps: constant, or poly = "
        "(1 - step/total)^0.9 as in DeepLab", choices=LR_SCHEDULES))
    drop_last: bool = field(default=False, metadata=_note(
        "cut each epoch to equal shards without repeats (sampler) and drop each rank's last "
        "short batch (loader), instead of padding", action="store_true"))
    sync_bn: bool = field(default=False, metadata=_note(
        "BatchNorm statistics over the global batch: this package's SyncBatchNorm on CPU, "
        "torch's nn.SyncBatchNorm on GPUs", action="store_true"))
    ddp: str = field(default="torch", metadata=_note(
        "data-parallel wrapper: torch = DistributedDataParallel, naive / bucketed = "
        "ddp_lesson.ddp.NaiveDDP / BucketedDDP", choices=DDP_WRAPPERS))
    checkpoint_every_steps: int = field(default=0, metadata=_note(
        "also write the checkpoint every N optimizer steps (0: only at each epoch end)"))
    no_resume: bool = field(default=False, metadata=_note(
        "start over even if --out holds a checkpoint (it is replaced at the first save)",
        action="store_true"))
    max_steps: int = field(default=0, metadata=_note(
        "stop after this many optimizer steps in all (0: no limit), writing the checkpoint "
        "there: a stand-in for an interrupted run; run again with the same --out to resume"))
    simulate_failure_at_step: int = field(default=0, metadata=_note(
        "fault injector for lessons and tests: --failure-rank kills itself with SIGKILL once, "
        "right after global step K (after that step's checkpoint, if any); a marker file in "
        "--out keeps a restarted job (torchrun --max-restarts) from failing again (0: off)"))
    failure_rank: int = field(default=0, metadata=_note(
        "the rank that --simulate-failure-at-step kills"))
    simulate_failure_during_save: bool = field(default=False, metadata=_note(
        "with --simulate-failure-at-step K: rank 0 dies instead inside the first checkpoint "
        "write at a global step >= K, after the temporary file is written and before the "
        "rename, so the previous checkpoint must survive", action="store_true"))
    timeout_s: float = field(default=120.0, metadata=_note(
        "seconds a collective may wait for its peers before raising, instead of hanging"))
    local_rank: int | None = field(default=None, metadata=_note(
        "legacy flag of torch.distributed.launch; torchrun sets LOCAL_RANK, which wins; "
        "accepted so old command lines keep working", "--local_rank", type=int))

    def __post_init__(self):
        self.size = tuple(self.size)
        checks = [
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.workers >= 0, f"workers must be >= 0, got {self.workers}"),
            (math.isfinite(self.lr) and self.lr > 0, f"lr must be a finite number > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.num_train >= 1, f"num_train must be >= 1, got {self.num_train}"),
            (self.num_val >= 1, f"num_val must be >= 1, got {self.num_val}"),
            (len(self.size) == 2 and min(self.size) >= 16,
             f"size must be two numbers H W, each >= 16, got {self.size}"),
            (self.model in MODELS,
             f"model {self.model!r} is not one of {', '.join(MODELS)}"),
            (self.width >= 1, f"width must be >= 1, got {self.width}"),
            (self.backend in BACKENDS,
             f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}"),
            (self.grad_accum_steps >= 1,
             f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}"),
            (self.lr_scaling in LR_SCALINGS,
             f"lr_scaling {self.lr_scaling!r} is not one of {', '.join(LR_SCALINGS)}"),
            (self.base_batch >= 1, f"base_batch must be >= 1, got {self.base_batch}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"lr_schedule {self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}"),
            (self.ddp in DDP_WRAPPERS,
             f"ddp {self.ddp!r} is not one of {', '.join(DDP_WRAPPERS)}"),
            (self.checkpoint_every_steps >= 0,
             f"checkpoint_every_steps must be >= 0, got {self.checkpoint_every_steps}"),
            (self.max_steps >= 0, f"max_steps must be >= 0, got {self.max_steps}"),
            (self.simulate_failure_at_step >= 0,
             f"simulate_failure_at_step must be >= 0, got {self.simulate_failure_at_step}"),
            (self.failure_rank >= 0, f"failure_rank must be >= 0, got {self.failure_rank}"),
            (not self.simulate_failure_during_save or self.simulate_failure_at_step >= 1,
             "simulate_failure_during_save needs --simulate-failure-at-step K >= 1"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (self.local_rank is None or self.local_rank >= 0,
             f"local_rank must be >= 0, got {self.local_rank}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error as one line (no usage block): ``prog: error: ...``."""

    def error(self, message):
        # Under torchrun every rank parses the same flags: only rank 0 reports.
        if os.environ.get("RANK", "0") in ("", "0"):
            sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The command line, built from :class:`TrainConfig`'s fields (one flag per field)."""
    parser = _OneLineParser(
        prog="python -m ddp_lesson.train",
        description="Data-parallel DeepLab training (synthetic Cityscapes-like scenes by "
                    "default). Start it with torchrun, one process per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        kwargs = dict(meta.get("argparse", {}))
        if "action" not in kwargs:  # store_true flags take no type
            kwargs.setdefault("type", type(f.default))
        long_flag = "--" + f.name.replace("_", "-")
        parser.add_argument(*meta.get("flags", ()), long_flag, dest=f.name, default=f.default,
                            help=meta["help"], **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a checked :class:`TrainConfig`.

    Raises:
        SystemExit: unknown flag or invalid value: one line ``prog: error: <message with
            the numbers>`` on stderr, exit status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))


# --------------------------------------------------------------------------- derived values

def scaled_lr(lr: float, base_batch: int, global_batch: int, rule: str = "linear") -> float:
    """The learning rate for ``global_batch``, given ``lr`` tuned at ``base_batch``.

    With gradients averaged over ranks, one DDP step on R ranks x B samples *is* one step on
    the R*B batch (shared/cases B7): no division by R is needed. What changes with more
    ranks is the global batch, and the usual rules follow it: ``linear`` (Goyal et al.,
    "Accurate, Large Minibatch SGD", arXiv:1706.02677) multiplies by ``G / base``; ``sqrt``
    (Krizhevsky, arXiv:1404.5997; Hoffer et al., arXiv:1705.08741) by ``sqrt(G / base)``;
    ``none`` keeps ``lr``. Example: 0.1 at 256 with R=4, B=128 (G=512), linear -> 0.2.

    Raises:
        ValueError: unknown rule or a batch < 1.
    """
    if rule not in LR_SCALINGS:
        raise ValueError(f"lr scaling {rule!r} is not one of {', '.join(LR_SCALINGS)}")
    if base_batch < 1 or global_batch < 1:
        raise ValueError(f"batches must be >= 1, got base_batch={base_batch}, "
                         f"global_batch={global_batch}")
    ratio = global_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def derived_values(cfg: TrainConfig, world_size: int, num_train: int | None = None) -> dict:
    """The numbers that follow from the config and the world size (no process group needed).

    With ``drop_last=False`` the training sampler pads the dataset to a multiple of
    ``world_size`` by repeating samples, so every rank gets ``ceil(N / world_size)``
    samples and takes the same number of steps (a rank that stepped fewer times would leave
    its peers waiting in an all_reduce); a rank's last micro-batch may be short. With
    ``drop_last=True`` the sampler cuts the tail (``N // R`` per rank) and the loader drops
    each rank's last short batch. A step is ``grad_accum_steps`` micro-batches; the last
    step of an epoch may hold fewer.

    Args:
        cfg: the config.
        world_size: number of ranks R.
        num_train: dataset length N (default ``cfg.num_train``; the real folder may hold
            fewer files).

    Returns:
        dict with world_size, batch_size (per rank and micro-batch), global_batch
        (``B x R x K``), samples_per_rank, samples_per_epoch (all ranks, padding included),
        steps_per_epoch (optimizer steps), grad_accum_steps, micro_batches_per_epoch
        (per rank) and effective_lr.
    """
    from .sampler import num_samples_per_rank

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = cfg.num_train if num_train is None else num_train
    samples_per_rank = num_samples_per_rank(n, world_size, cfg.drop_last)
    if cfg.drop_last:
        micro = samples_per_rank // cfg.batch_size
    else:
        micro = math.ceil(samples_per_rank / cfg.batch_size)
    global_batch = cfg.batch_size * world_size * cfg.grad_accum_steps
    return {
        "world_size": world_size,
        "batch_size": cfg.batch_size,
        "global_batch": global_batch,
        "samples_per_rank": samples_per_rank,
        "samples_per_epoch": samples_per_rank * world_size,
        "steps_per_epoch": math.ceil(micro / cfg.grad_accum_steps),
        "grad_accum_steps": cfg.grad_accum_steps,
        "micro_batches_per_epoch": micro,
        "effective_lr": scaled_lr(cfg.lr, cfg.base_batch, global_batch, cfg.lr_scaling),
    }


def _check_steps(cfg: TrainConfig, derived: dict, n: int) -> None:
    """Raise TrainInputError when an epoch would have no step at all."""
    if derived["steps_per_epoch"] >= 1:
        return
    r, spr, b = derived["world_size"], derived["samples_per_rank"], cfg.batch_size
    if cfg.drop_last and n < r:
        raise TrainInputError(
            f"no training steps: {n} training samples on {r} ranks with --drop-last give each "
            f"rank 0 samples; use at most {n} ranks or no --drop-last")
    raise TrainInputError(
        f"no training steps: {n} training samples on {r} ranks give {spr} per rank, fewer than "
        f"one batch of {b} with --drop-last; use a batch size <= {spr} or no --drop-last")


# --------------------------------------------------------------------------- small helpers

def _set_threads_from_env() -> None:
    # torchrun sets OMP_NUM_THREADS=1 (with a warning) and our launcher does so quietly; make
    # torch's intra-op pool follow it, so N processes on N cores do not oversubscribe them.
    import torch

    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) >= 1:
        torch.set_num_threads(int(raw))


def _group_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _sum_tensor_over_ranks(t):
    """All-reduce (SUM) a float64 CPU tensor; returns a CPU tensor (a synchronisation point)."""
    import torch.distributed as dist

    if _group_active() and dist.get_world_size() > 1:
        # NCCL reduces CUDA tensors only; gloo is happy with CPU ones.
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def _logits(model, images):
    out = model(images)
    if isinstance(out, dict):  # torchvision-style segmentation models return {"out": ...}
        out = out["out"]
    return out


def _sync_buffers(module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats) before evaluating.

    Why: BatchNorm's running mean/var are buffers, updated locally by each rank's own batches.
    DDP copies rank 0's buffers to the others at the start of every training forward, but the
    last step's update happens after that copy, so after training the ranks differ by one
    step. Broadcasting makes every rank evaluate the very same model.
    """
    import torch.distributed as dist

    if _group_active() and dist.get_world_size() > 1:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


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


class SkipSampler:
    """This epoch's indices of ``sampler`` without the first ``skip`` ones (already consumed).

    A thin wrapper used for resuming mid-epoch: with ``skip = steps_done x K x B`` the
    DataLoader's remaining batches are exactly the batches the interrupted run had not yet
    taken, because batches are consecutive runs of ``B`` indices. The wrapped sampler (and its
    shuffle) is untouched; :meth:`set_epoch` passes through. No synchronisation.
    """

    def __init__(self, sampler, skip: int = 0):
        self.sampler = sampler
        self.skip = skip

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


# --------------------------------------------------------------------------- one step

def accumulate_gradients(model, micro_batches, compute_loss, timer=None) -> None:
    """Forward and backward over ``K`` micro-batches, all-reducing gradients only on the last.

    Micro-batches ``0 .. K-2`` run inside ``model.no_sync()`` (when the wrapper has it):
    their gradients accumulate locally in ``.grad``; the last one runs normally, and its
    backward all-reduces the accumulated sums (shared/cases B4: sync on the *last*
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
    import torch
    import torch.nn.functional as F

    local_count = sum(int((t != IGNORE_INDEX).sum()) for _, t in micro_batches)
    with _phase(timer, "comm"):
        global_count = _sum_tensor_over_ranks(torch.tensor([float(local_count)],
                                                           dtype=torch.float64))[0].item()
    scale = world_size / max(global_count, 1.0)
    sums = []

    def compute_loss(m, batch):
        images, target = batch
        s = F.cross_entropy(_logits(m, images), target, ignore_index=IGNORE_INDEX,
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


def evaluate(model, loader, num_classes, device):
    """This rank's confusion matrix over its validation shard, ``(C, C)`` int64 on ``device``.

    No collective inside the loop: with the eval sampler ranks may hold different numbers of
    batches (7 samples on 2 ranks: 4 and 3), so only the final sum synchronises.
    """
    import torch

    from .metrics import confusion_matrix

    model.eval()
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    with torch.no_grad():
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            pred = _logits(model, images).argmax(1)
            cm += confusion_matrix(pred, target, num_classes, IGNORE_INDEX)
    return cm


def _json_safe(obj):
    """``obj`` with every NaN/inf float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _write_json_atomic(path: str, obj: dict) -> None:
    # A reader never sees half a file, and an interrupted run leaves the previous summary intact.
    from .checkpoint import atomic_write

    def write(fh):
        # a diverged run (loss NaN) still gets its summary: non-finite values become null
        json.dump(_json_safe(obj), fh, indent=2, allow_nan=False)
        fh.write("\n")

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, write, binary=False)


def _finite_or_none(x):
    return None if (x is None or not math.isfinite(x)) else float(x)


# --------------------------------------------------------------------------- checks of input

def _check_out_writable(out: str) -> str | None:
    """None when ``out`` can be created and written, else a one-line reason."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        return f"--out {out!r} cannot be written: {exc.strerror or exc}"
    return None


def _bare_model_state(cfg: TrainConfig):
    """The ``state_dict`` of a freshly built bare model for ``cfg`` (names and shapes)."""
    from .data import NUM_CLASSES
    from .models import build_model

    return build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width).state_dict()


def inspect_checkpoint(path: str, cfg: TrainConfig, world_size: int, model_state) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed by this run, or None when it can.

    Checks, in order: readable and a ddp_lesson checkpoint; the model's tensor names and
    shapes (first mismatch named); the world size; the config fields of
    :data:`RESUME_MUST_MATCH` (first mismatch named). Local: reads the file, no collective.
    """
    from .checkpoint import (CheckpointError, first_config_mismatch, first_state_mismatch,
                             load_checkpoint, strip_module_prefix)

    try:
        ckpt = load_checkpoint(path, map_location="cpu")
    except (CheckpointError, OSError) as exc:
        return f"{exc}; move it away or pass --no-resume to start over"
    hint = "resume with the same settings, or pass --no-resume to start over"
    mismatch = first_state_mismatch(model_state, strip_module_prefix(ckpt["model"]))
    if mismatch:
        return f"checkpoint {path} does not fit this model: {mismatch}; {hint}"
    if ckpt["world_size"] != world_size:
        return (f"checkpoint {path} was written by {ckpt['world_size']} processes, this run "
                f"has {world_size} (the data order and global batch depend on it); {hint}")
    mismatch = first_config_mismatch(ckpt["config"], asdict(cfg), RESUME_MUST_MATCH)
    if mismatch:
        return f"checkpoint {path} does not match this run: {mismatch}; {hint}"
    return None


def preflight(argv: list[str] | None, world_size: int) -> TrainConfig:
    """Check a trainer command line before starting any process (for launchers such as the CLI).

    Runs, in the calling process and without a process group, the checks every rank would
    run at start: flags, the data folder, at least one step per epoch, a writable ``--out``,
    and a checkpoint there that this run can resume from. A launcher that calls it reports
    bad input in one line instead of starting ``world_size`` processes that all fail.

    Args:
        argv: the trainer's flags.
        world_size: the number of processes the job will have.

    Returns:
        The parsed :class:`TrainConfig`.

    Raises:
        SystemExit: a bad flag (one line printed by the parser, status 2).
        TrainInputError: any other bad input (message names the values).
    """
    from .data import make_datasets

    cfg = parse_config(argv)
    if world_size < 1:
        raise TrainInputError(f"the job needs at least 1 process, got {world_size}")
    train_ds, _ = _make_datasets(cfg, make_datasets)
    _check_steps(cfg, derived_values(cfg, world_size, len(train_ds)), len(train_ds))
    problem = _check_out_writable(cfg.out)
    if problem is None and not cfg.no_resume:
        path = os.path.join(cfg.out, CHECKPOINT_FILE)
        if os.path.exists(path):
            problem = inspect_checkpoint(path, cfg, world_size, _bare_model_state(cfg))
    if problem:
        raise TrainInputError(problem)
    return cfg


def _make_datasets(cfg: TrainConfig, make_datasets):
    try:
        return make_datasets(cfg.num_train, cfg.num_val, cfg.size, cfg.seed,
                             data_root=cfg.data_root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        if cfg.data_root is not None:
            raise TrainInputError(f"--data-root {cfg.data_root!r}: {exc}") from None
        raise TrainInputError(str(exc)) from None


# --------------------------------------------------------------------------- the trainer

class Trainer:
    """Everything one rank needs to train: data, model, wrapper, optimizer, schedule, state.

    Built on every rank (after ``init_distributed``); :meth:`fit` runs the epochs with
    checkpoints and evaluation. The pieces are public so that benchmarks and notebooks can
    drive single steps (:meth:`batches`, :meth:`step`).

    Attributes:
        cfg, env, device, derived: the config, this rank's DistEnv, torch device, and
            :func:`derived_values`.
        module: the bare model (what checkpoints hold); model: the wrapped one.
        optimizer, scheduler: SGD and a LambdaLR (constant or poly).
        epoch, step_in_epoch, global_step: where training stands (the resume point).
        history: one dict per finished epoch (train_loss, val_miou, ...).
        step_log: ``[epoch, step_in_epoch, loss_sum, pixel_count]`` per optimizer step,
            summed over ranks (``loss_sum / pixel_count`` is the step's global mean loss).

    Raises:
        TrainInputError: bad data folder, zero steps per epoch, an unavailable wrapper.
    """

    def __init__(self, cfg: TrainConfig, env, device=None):
        import torch
        from torch.utils.data import DataLoader

        from .data import NUM_CLASSES, make_datasets
        from .sampler import DistributedEvalSampler, DistributedSampler

        self.cfg, self.env = cfg, env
        self.device = torch.device(env.device if device is None else device)
        self.num_classes = NUM_CLASSES
        train_ds, val_ds = _make_datasets(cfg, make_datasets)
        self.derived = derived_values(cfg, env.world_size, len(train_ds))
        _check_steps(cfg, self.derived, len(train_ds))
        # Explicit num_replicas/rank: works with and without a process group.
        self.sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                          shuffle=True, seed=cfg.seed, drop_last=cfg.drop_last)
        self.skip_sampler = SkipSampler(self.sampler)
        val_sampler = DistributedEvalSampler(val_ds, num_replicas=env.world_size, rank=env.rank)
        pin = self.device.type == "cuda"
        kwargs = dict(batch_size=cfg.batch_size, num_workers=cfg.workers, pin_memory=pin,
                      persistent_workers=cfg.workers > 0)
        # shuffle=False: the sampler shuffles (DataLoader refuses shuffle=True with a
        # sampler). Own generator: iter(loader) draws a seed from it, not from the global
        # RNG, so an epoch restarted mid-way leaves the global RNG as an unbroken one would.
        self.train_loader = DataLoader(train_ds, sampler=self.skip_sampler, shuffle=False,
                                       drop_last=cfg.drop_last,
                                       generator=torch.Generator().manual_seed(cfg.seed),
                                       **kwargs)
        self.val_loader = DataLoader(val_ds, sampler=val_sampler, shuffle=False, **kwargs)
        self.num_train = len(train_ds)
        if len(self.train_loader) != self.derived["micro_batches_per_epoch"]:
            raise RuntimeError(f"micro-batches per epoch: the loader has {len(self.train_loader)}"
                               f", derived_values expected {self.derived['micro_batches_per_epoch']}"
                               f" (N={len(train_ds)}, R={env.world_size}, B={cfg.batch_size}, "
                               f"drop_last={cfg.drop_last})")

        self.module, self.model = self._build_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(),
                                         lr=self.derived["effective_lr"],
                                         momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        total = cfg.epochs * self.derived["steps_per_epoch"]
        if cfg.lr_schedule == "poly":
            def factor(step, total=total):
                return max(0.0, 1.0 - step / total) ** 0.9
        else:
            def factor(step):
                return 1.0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.history: list[dict] = []
        self.step_log: list[list[float]] = []
        self._pending: list[tuple[int, int, float, int]] = []
        self.resumed_from: dict | None = None
        self.per_class_iou = None

    # ---- model
    def _build_model(self):
        import torch

        from .models import build_model

        cfg, env = self.cfg, self.env
        # Same seed on every rank: identical initial weights (DDP would broadcast rank 0's
        # anyway, but this also makes a 1-process run start from the same weights as an
        # N-process run).
        torch.manual_seed(cfg.seed)
        module = build_model(cfg.model, num_classes=self.num_classes, width=cfg.width)
        module = module.to(self.device)
        if cfg.sync_bn:
            # After moving to the device, before wrapping (the wrapper must see the final
            # layers): shared/cases B11.
            if self.device.type == "cuda":
                module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
            else:
                from .syncbn import convert_sync_batchnorm

                module = convert_sync_batchnorm(module)
        return module, wrap_model(module, cfg.ddp, env, self.device)

    # ---- data
    def batches(self, epoch: int, start_step: int = 0):
        """Yield this epoch's steps from ``start_step`` on, each a list of up to K micro-batches.

        Calls ``set_epoch(epoch)`` first (a new shuffle each epoch, the same on every rank)
        and skips the ``start_step x K x B`` samples this rank already consumed. Yields
        ``(step_in_epoch, micro_batches, data_seconds)``, tensors on the rank's device.
        """
        k, b = self.cfg.grad_accum_steps, self.cfg.batch_size
        self.skip_sampler.set_epoch(epoch)
        self.skip_sampler.skip = start_step * k * b
        it = iter(self.train_loader)
        micro_total = self.derived["micro_batches_per_epoch"]
        for step in range(start_step, self.derived["steps_per_epoch"]):
            n = min(k, micro_total - step * k)
            start = time.perf_counter()
            group = []
            for _ in range(n):
                images, target = next(it)
                group.append((images.to(self.device, non_blocking=True),
                              target.to(self.device, non_blocking=True)))
            yield step, group, time.perf_counter() - start

    def step(self, micro_batches, timer=None) -> tuple[float, int]:
        """One optimizer step (see :func:`train_step`); advances the counters."""
        self.model.train()
        result = train_step(self.model, self.optimizer, micro_batches, self.env.world_size,
                            self.scheduler, timer)
        self._pending.append((self.epoch, self.step_in_epoch, *result))
        self.step_in_epoch += 1
        self.global_step += 1
        return result

    def _flush_losses(self) -> None:
        """Sum the pending per-step (loss_sum, count) over ranks into :attr:`step_log` (sync)."""
        import torch

        if not self._pending:  # the same on every rank: they step in lockstep
            return
        local = torch.tensor([[p[2], p[3]] for p in self._pending], dtype=torch.float64)
        total = _sum_tensor_over_ranks(local).tolist()
        self.step_log += [[p[0], p[1], s, c] for p, (s, c) in zip(self._pending, total)]
        self._pending = []

    # ---- checkpoints
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.cfg.out, CHECKPOINT_FILE)

    def checkpoint_state(self, rng_states) -> dict:
        """The checkpoint dict for the current position (built on rank 0; no communication).

        Entries: ``format``/``version`` (what this file is), ``model`` (the bare module's
        state_dict, no ``module.`` prefix), ``optimizer`` (SGD state: momentum buffers),
        ``scheduler`` (LambdaLR state), ``epoch`` (the epoch in progress, 0-based; equal to
        ``epochs`` when training is done), ``step_in_epoch`` (optimizer steps of that epoch
        already taken), ``global_step``, ``sampler`` (seed, epoch, shuffle, drop_last,
        num_replicas and the samples each rank consumed this epoch), ``rng`` (every rank's
        generators, in rank order), ``config`` (the TrainConfig as a dict), ``world_size``,
        ``history`` (per-epoch results), ``step_log`` (per-step global loss sums and pixel
        counts) and ``torch`` (the version that wrote it).

        Args:
            rng_states: list of :func:`ddp_lesson.checkpoint.capture_rng_state` results, one
                per rank.
        """
        import torch

        from .checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION

        k, b = self.cfg.grad_accum_steps, self.cfg.batch_size
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "model": self.module.state_dict(),  # the bare model: no "module." prefix (B12)
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "sampler": {"seed": self.cfg.seed, "epoch": self.epoch, "shuffle": True,
                        "drop_last": self.cfg.drop_last, "num_replicas": self.env.world_size,
                        "consumed_per_rank": self.step_in_epoch * k * b},
            "rng": rng_states,
            "config": asdict(self.cfg),
            "world_size": self.env.world_size,
            "history": self.history,
            "step_log": self.step_log,
            "torch": str(torch.__version__),  # a plain str: weights_only loads only plain types
        }

    def save(self) -> None:
        """Write the checkpoint (all ranks call it; rank 0 writes; synchronises, B14)."""
        import torch.distributed as dist

        from .checkpoint import capture_rng_state, save_checkpoint

        self._flush_losses()
        rng = capture_rng_state()
        if _group_active() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, rng)  # every rank's generators, for exact resume
        else:
            states = [rng]
        state = self.checkpoint_state(states) if self.env.is_main else None
        hook = None
        if (self.cfg.simulate_failure_during_save and self.env.is_main
                and self.global_step >= self.cfg.simulate_failure_at_step):
            hook = lambda tmp: self._simulated_failure("during the checkpoint write")  # noqa: E731
        try:
            save_checkpoint(state, self.checkpoint_path, before_replace=hook)
        except OSError as exc:
            raise TrainInputError(str(exc)) from None

    # ---- fault injection (--simulate-failure-at-step)
    @property
    def failure_marker(self) -> str:
        """``{out}/simulated_failure_step{K}.done``: written just before the simulated kill."""
        return os.path.join(self.cfg.out,
                            f"simulated_failure_step{self.cfg.simulate_failure_at_step}.done")

    def _simulated_failure(self, where: str) -> None:
        """Kill this process with SIGKILL, once per ``--out`` (the marker makes a restart run on).

        The marker is written (and fsync'ed) BEFORE the kill: a SIGKILL leaves no chance to
        write it afterwards, and without it the restarted job would die at the same step again.
        SIGKILL, not an exception: no ``finally``, no atexit, no flushing, as when the kernel's
        OOM killer or a lost machine ends a worker.
        """
        import signal

        if os.path.exists(self.failure_marker):
            return
        with open(self.failure_marker, "w") as fh:
            fh.write(f"rank {self.env.rank} killed {where} at global step {self.global_step}\n")
            fh.flush()
            os.fsync(fh.fileno())
        print(f"simulated failure: rank {self.env.rank} kills itself (SIGKILL) {where} at "
              f"global step {self.global_step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_fail_after_step(self) -> None:
        cfg = self.cfg
        if (cfg.simulate_failure_at_step and not cfg.simulate_failure_during_save
                and self.global_step == cfg.simulate_failure_at_step
                and self.env.rank == cfg.failure_rank):
            self._simulated_failure("after the step")

    def try_resume(self, validate: bool = True) -> bool:
        """Resume from ``{out}/checkpoint.pt`` when there is one (and not ``--no-resume``).

        Rank 0 decides whether the file exists and (with ``validate``) can be resumed from,
        and broadcasts the answer (B14); then every rank loads the file itself, mapped to its
        own device. Synchronises (a broadcast).

        Returns:
            True when training state was restored.

        Raises:
            TrainInputError: (every rank) the file is unreadable or does not match this run.
        """
        from .checkpoint import decide_on_rank0, load_checkpoint, restore_rng_state, \
            strip_module_prefix

        if self.cfg.no_resume:
            return False
        path = self.checkpoint_path

        def decide():
            if not os.path.exists(path):
                return False, None
            if not validate:
                return True, None
            return True, inspect_checkpoint(path, self.cfg, self.env.world_size,
                                            self.module.state_dict())

        exists, problem = decide_on_rank0(decide)
        if problem:
            raise TrainInputError(problem)
        if not exists:
            return False
        ckpt = load_checkpoint(path, map_location=self.device)
        self.module.load_state_dict(strip_module_prefix(ckpt["model"]))
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.epoch, self.step_in_epoch = ckpt["epoch"], ckpt["step_in_epoch"]
        self.global_step = ckpt["global_step"]
        self.history = list(ckpt.get("history", []))
        self.step_log = [list(x) for x in ckpt.get("step_log", [])]
        rng = ckpt["rng"]
        restore_rng_state(rng[self.env.rank] if len(rng) == self.env.world_size else rng[0])
        self.resumed_from = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                             "global_step": self.global_step}
        if self.global_step > 0:
            self._settle_ddp_buckets()
        return True

    def _settle_ddp_buckets(self) -> None:
        """Give a resumed torch DDP the bucket layout the interrupted run had (synchronises).

        Why: torch's DDP lays out its gradient buckets in parameter order at construction,
        then, after the first backward, rebuilds them in the order gradients became ready.
        The interrupted run was using the rebuilt layout; a fresh wrapper would use the
        initial one for its first step. The all-reduce sums each element in an order that
        depends on where it sits in the bucket (with 3 or more ranks), so that one step would
        differ in the last bit. One forward and backward of a zero batch, with the gradients
        thrown away and the buffers put back, lets DDP record the order and rebuild exactly
        as before, without changing any state. (With 2 ranks a + b is the same either way; the
        package's wrappers never rebuild.)
        """
        import torch
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(self.model, DistributedDataParallel):
            return
        buffers = {k: v.clone() for k, v in self.module.named_buffers()}
        h, w = self.cfg.size
        zeros = torch.zeros(2, 3, h, w, device=self.device)
        self.model.train()
        (_logits(self.model, zeros).sum() * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, v in self.module.named_buffers():
                v.copy_(buffers[k])

    # ---- evaluation
    def validate(self) -> tuple[float, float]:
        """Exact mIoU and pixel accuracy over the whole validation set (synchronises)."""
        from .metrics import all_reduce_confusion, miou_from_confusion

        # Evaluate the bare module: DDP's forward may sync buffers, a collective, and ranks
        # hold different numbers of validation batches.
        _sync_buffers(self.module)
        cm = all_reduce_confusion(evaluate(self.module, self.val_loader, self.num_classes,
                                           self.device))
        miou, per_class, pixel_acc = miou_from_confusion(cm)
        self.per_class_iou = per_class
        return miou, pixel_acc

    # ---- the loop
    def fit(self) -> dict:
        """Train from the current position to the end (or ``--max-steps``); returns run facts.

        Writes the checkpoint every ``checkpoint_every_steps`` steps and after each epoch's
        evaluation; prints one line per epoch on rank 0. Synchronises at every step, at
        every checkpoint and after each epoch.
        """
        from tqdm import tqdm

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
            samples_left = (d["samples_per_rank"] if not cfg.drop_last
                            else d["micro_batches_per_epoch"] * cfg.batch_size)
            samples_left -= min(samples_left, start_step * cfg.grad_accum_steps * cfg.batch_size)
            bar = tqdm(total=samples_left * env.world_size, unit=" samples", unit_scale=True,
                       desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not env.is_main,
                       leave=False, dynamic_ncols=True, mininterval=1.0)
            start = time.perf_counter()
            for _step, group, _data_s in (self.batches(epoch, start_step) if remaining else ()):
                loss_sum, count = self.step(group)
                n = sum(images.shape[0] for images, _ in group)
                train_samples += n * env.world_size
                bar.update(n * env.world_size)
                bar.set_postfix(loss=f"{loss_sum / max(count, 1):.3f}", refresh=False)
                last_of_epoch = self.step_in_epoch == steps
                if cfg.max_steps and self.global_step >= cfg.max_steps:
                    stopped = True
                    break
                if (cfg.checkpoint_every_steps and not last_of_epoch
                        and self.global_step % cfg.checkpoint_every_steps == 0):
                    self.save()
                self._maybe_fail_after_step()
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
            rows = [r for r in self.step_log if r[0] == epoch]
            train_loss = sum(r[2] for r in rows) / max(sum(r[3] for r in rows), 1.0)
            miou, pixel_acc = self.validate()
            self.history.append({"epoch": epoch + 1, "train_loss": train_loss,
                                 "val_miou": miou, "val_pixel_accuracy": pixel_acc})
            print0(f"epoch {epoch + 1}/{cfg.epochs}  train_loss {train_loss:.4f}  "
                   f"val_mIoU {miou:.4f}  pixel_acc {pixel_acc:.4f}", env=env)
            self.epoch, self.step_in_epoch = epoch + 1, 0
            self.save()
        return {"train_seconds": train_seconds, "train_samples": train_samples,
                "stopped": stopped}


def wrap_model(module, kind: str, env, device):
    """Wrap ``module`` for data parallelism: torch's DDP or a wrapper of ``ddp_lesson.ddp``.

    No wrapper without a process group (a single plain process). For torch's DDP,
    ``device_ids`` only on CUDA (one GPU per process); no ``find_unused_parameters``: every
    parameter gets a gradient each step. Synchronises: the wrapper broadcasts rank 0's
    parameters and buffers at construction.

    Raises:
        TrainInputError: ``kind`` names a wrapper that cannot be imported.
    """
    if not (env.distributed and _group_active()):
        return module
    if kind == "torch":
        from torch.nn.parallel import DistributedDataParallel

        kwargs = {"device_ids": [env.local_rank]} if device.type == "cuda" else {}
        return DistributedDataParallel(module, **kwargs)
    try:
        from . import ddp as ddp_mod  # imported lazily: only --ddp naive/bucketed need it
        cls = {"naive": ddp_mod.NaiveDDP, "bucketed": ddp_mod.BucketedDDP}[kind]
    except (ImportError, AttributeError) as exc:
        raise TrainInputError(f"--ddp {kind} needs ddp_lesson.ddp, which is not available "
                              f"({exc}); use --ddp torch") from None
    return cls(module)


# --------------------------------------------------------------------------- entry point

def _start_lines(trainer: Trainer) -> list[str]:
    cfg, env, d = trainer.cfg, trainer.env, trainer.derived
    k = cfg.grad_accum_steps
    made_of = f"{cfg.batch_size} x {env.world_size}" + (f" x {k} accumulation steps"
                                                         if k > 1 else "")
    extras = [f"ddp {cfg.ddp}" if env.distributed else "no DDP wrapper (1 process)"]
    if cfg.sync_bn:
        extras.append("sync-bn")
    return [
        f"world_size {env.world_size}  backend {env.backend} ({env.reason})  "
        f"device {trainer.device.type}",
        f"batch per rank {cfg.batch_size}  global batch {d['global_batch']} (= {made_of})  "
        f"steps per epoch {d['steps_per_epoch']}  samples per epoch {d['samples_per_epoch']} "
        f"({d['samples_per_rank']} per rank)",
        f"lr {d['effective_lr']:.6g} (--lr {cfg.lr:g} at base global batch {cfg.base_batch}, "
        f"--lr-scaling {cfg.lr_scaling})  schedule {cfg.lr_schedule}  " + "  ".join(extras),
    ]


def _run(cfg: TrainConfig, env, wall_start: float) -> dict:
    import torch
    import torch.distributed as dist

    from .checkpoint import decide_on_rank0, sweep_temporaries

    path = os.path.join(cfg.out, CHECKPOINT_FILE)

    def check_out_and_checkpoint():
        # Before anything is built or printed: a bad --out or checkpoint fails fast.
        problem = _check_out_writable(cfg.out)
        sweep_temporaries(path, only_dead=False)  # rank 0, before any write: killed writers' files
        if problem is None and not cfg.no_resume and os.path.exists(path):
            problem = inspect_checkpoint(path, cfg, env.world_size, _bare_model_state(cfg))
        return problem

    problem = decide_on_rank0(check_out_and_checkpoint)  # rank 0 decides, all ranks act
    if problem:
        raise TrainInputError(problem)
    if cfg.simulate_failure_at_step and cfg.failure_rank >= env.world_size:
        raise TrainInputError(f"--failure-rank {cfg.failure_rank} is outside [0, "
                              f"{env.world_size - 1}] (world size {env.world_size})")
    trainer = Trainer(cfg, env)
    if cfg.local_rank is not None:
        # Same rule as env.resolve_local_rank: the LOCAL_RANK variable wins over the flag.
        resolved = dist_env.resolve_local_rank([f"--local-rank={cfg.local_rank}"])
        print0(f"note: --local_rank={cfg.local_rank} is the legacy torch.distributed.launch "
               f"flag; torchrun sets LOCAL_RANK (rank 0 uses local rank {resolved}), so the "
               f"flag is not needed", env=env)
    for line in _start_lines(trainer):
        print0(line, env=env)
    steps = trainer.derived["steps_per_epoch"]
    if trainer.try_resume(validate=False):  # validated above
        if trainer.epoch >= cfg.epochs:
            print0(f"resuming from {trainer.checkpoint_path}: all {cfg.epochs} epochs done; "
                   "nothing left to train (--no-resume starts over)", env=env)
        else:
            print0(f"resuming from {trainer.checkpoint_path}: epoch {trainer.epoch + 1}/"
                   f"{cfg.epochs}, step {trainer.step_in_epoch}/{steps} (global step "
                   f"{trainer.global_step})", env=env)
    facts = trainer.fit()
    if trainer.per_class_iou is None and trainer.history and not facts["stopped"]:
        trainer.validate()  # a finished run resumed: evaluate once more for the summary
    last = trainer.history[-1] if trainer.history else {}
    d = trainer.derived
    summary = {
        "world_size": env.world_size,
        "backend": env.backend,
        "backend_reason": env.reason,
        "device": trainer.device.type,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "global_batch": d["global_batch"],
        "grad_accum_steps": cfg.grad_accum_steps,
        "steps_per_epoch": steps,
        "samples_per_epoch": d["samples_per_epoch"],
        "effective_lr": d["effective_lr"],
        "global_step": trainer.global_step,
        "stopped_early": facts["stopped"],
        "resumed_from": trainer.resumed_from,
        "final_train_loss": _finite_or_none(last.get("train_loss")),
        # True when the loss became NaN/inf (e.g. too large a learning rate): the numbers
        # below are then null, not a crash at the very end of the run
        "diverged": not math.isfinite(last.get("train_loss", 0.0)),
        "val_miou": _finite_or_none(last.get("val_miou")),
        "val_pixel_accuracy": _finite_or_none(last.get("val_pixel_accuracy")),
        "per_class_iou": ([_finite_or_none(v) for v in trainer.per_class_iou.tolist()]
                          if trainer.per_class_iou is not None else None),
        "history": [{k: _finite_or_none(v) if isinstance(v, float) else v for k, v in h.items()}
                    for h in trainer.history],
        "step_losses": [s / c if c > 0 else None for _, _, s, c in trainer.step_log],
        "samples_per_s": (facts["train_samples"] / facts["train_seconds"]
                          if facts["train_seconds"] > 0 else None),
        "wall_s": time.perf_counter() - wall_start,
        "checkpoint": trainer.checkpoint_path,
        "config": asdict(cfg),
        "torch": str(torch.__version__),
    }
    if env.is_main:
        path = os.path.join(cfg.out, "summary.json")
        _write_json_atomic(path, summary)
        print0(f"wrote {path}", env=env)
    if _group_active() and dist.get_world_size() > 1:
        from .checkpoint import _barrier

        _barrier()  # rank 0's summary is on disk before any rank returns
    return summary


def _fail(exc: BaseException, env, owns_group: bool):
    """Print ``error: <message>`` once (rank 0), leave the group we made, exit with status 2."""
    import torch.distributed as dist

    rank = env.rank if env is not None else int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    if owns_group and _group_active():
        gc.collect()  # see main(): free wrappers before the group goes
        dist.destroy_process_group()  # no barrier: every rank is leaving with the same error
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    """Run the training job (every rank runs this). Returns the summary dict on every rank.

    Joins the process group unless the caller already did (then leaves it as found).
    Synchronises at init, at every step (pixel count and gradient all_reduce), at every
    checkpoint, after each epoch (loss and confusion-matrix reductions) and at cleanup.

    Raises:
        SystemExit: status 2 for bad input, after one line ``error: ...`` on rank 0's
            stderr (flags, backend, data folder, checkpoint, output folder, zero steps).
    """
    wall_start = time.perf_counter()
    cfg = parse_config(argv)
    _set_threads_from_env()
    owns_group = not _group_active()
    env = None
    try:
        try:
            # "auto" defers to DDP_LESSON_BACKEND (set by %%torchrun), then to the rule.
            env = dist_env.init_distributed(
                timeout=cfg.timeout_s, backend=None if cfg.backend == "auto" else cfg.backend,
                announce=False)
        except ValueError as exc:  # unknown backend, nccl without GPUs, bad torchrun vars
            raise TrainInputError(str(exc)) from None
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
