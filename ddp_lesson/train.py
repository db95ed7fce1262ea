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
* ``CrossEntropyLoss(ignore_index=255)``: Cityscapes marks "void" pixels 255, which are not a
  class and must not be learned (without it the loss raises on label 255, or on CUDA trips a
  device-side assert);
* validation on a sampler that gives each sample to exactly one rank, with the confusion
  matrix summed over ranks: the mIoU is exact, the same at any world size;
* backend and device chosen by one rule (:mod:`ddp_lesson.env`): NCCL + one GPU per rank
  when there are enough GPUs, gloo on CPU otherwise.

Also runs as a single process, ``python -m ddp_lesson.train``: world size 1, no process
group, no DDP wrapper, same numbers printed. Rank 0 prints the derived values at start, one
line per epoch, and writes ``{out}/summary.json`` at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from . import env as dist_env
from .env import BACKENDS, print0
from .models import MODELS

#: Label of "void" pixels (Cityscapes); neither learned nor scored.
IGNORE_INDEX = 255


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
        "samples per step on EACH rank; the global batch is batch_size x world_size",
        "-b"))
    workers: int = field(default=0, metadata=_note(
        "DataLoader worker processes per rank; 0 loads in the training process, which keeps "
        "the CPU path light (each worker is another process competing for the cores)", "-j"))
    lr: float = field(default=0.05, metadata=_note(
        "SGD learning rate (declared here; the seed read args.lr without declaring it)"))
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
        "output folder; rank 0 writes summary.json there"))
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
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
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
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (self.local_rank is None or self.local_rank >= 0,
             f"local_rank must be >= 0, got {self.local_rank}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line, built from :class:`TrainConfig`'s fields (one flag per field)."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_lesson.train",
        description="Data-parallel DeepLab training (synthetic Cityscapes-like scenes by "
                    "default). Start it with torchrun, one process per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        kwargs = dict(meta.get("argparse", {}))
        kwargs.setdefault("type", type(f.default))
        long_flag = "--" + f.name.replace("_", "-")
        parser.add_argument(*meta.get("flags", ()), long_flag, dest=f.name, default=f.default,
                            help=meta["help"], **kwargs)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a checked :class:`TrainConfig`.

    Raises:
        SystemExit: unknown flag or invalid value (argparse prints the message, with the
            numbers, and exits with status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))


def derived_values(cfg: TrainConfig, world_size: int) -> dict:
    """The numbers that follow from the config and the world size (no process group needed).

    With ``drop_last=False`` the training sampler pads the dataset to a multiple of
    ``world_size`` by repeating samples, so every rank gets ``ceil(num_train / world_size)``
    samples and takes the same number of steps (a rank that stepped fewer times would leave
    its peers waiting in an all_reduce). The last batch of a rank may be short.

    Returns:
        dict with world_size, batch_size (per rank), global_batch, samples_per_rank,
        samples_per_epoch (all ranks, padding included), steps_per_epoch.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    samples_per_rank = math.ceil(cfg.num_train / world_size)
    return {
        "world_size": world_size,
        "batch_size": cfg.batch_size,
        "global_batch": cfg.batch_size * world_size,
        "samples_per_rank": samples_per_rank,
        "samples_per_epoch": samples_per_rank * world_size,
        "steps_per_epoch": math.ceil(samples_per_rank / cfg.batch_size),
    }


def _set_threads_from_env() -> None:
    # torchrun sets OMP_NUM_THREADS=1 (with a warning) and our launcher does so quietly; make
    # torch's intra-op pool follow it, so N processes on N cores do not oversubscribe them.
    import torch

    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) >= 1:
        torch.set_num_threads(int(raw))


def _sum_over_ranks(values: list[float]):
    """All-reduce (SUM) a few floats in one float64 tensor (a synchronisation point)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        # NCCL reduces CUDA tensors only; gloo is happy with CPU ones.
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


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

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def train_one_epoch(model, loader, sampler, criterion, optimizer, epoch, cfg, env, device):
    """One pass over this rank's shard. Returns (loss_sum, num_batches, num_samples, seconds).

    The caller reduces these over ranks; nothing here synchronises except DDP's gradient
    all_reduce inside ``backward()``.
    """
    from tqdm import tqdm

    # Why set_epoch: the shuffle is seeded with seed + epoch. Without this call every epoch
    # replays epoch 0's order (the seed program's bug: shuffle=False plus no set_epoch).
    sampler.set_epoch(epoch)
    model.train()
    # Every rank runs the same number of equal-sized steps (the sampler pads), so local
    # samples x world_size is the global count the bar shows, and its rate is global samples/s.
    bar = tqdm(total=len(sampler) * env.world_size, unit="sample", unit_scale=True,
               desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not env.is_main,
               leave=False, dynamic_ncols=True, mininterval=1.0)
    loss_sum, batches, samples = 0.0, 0, 0
    start = time.perf_counter()
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        logits = _logits(model, images)
        loss = criterion(logits, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP: gradients are all-reduced (averaged over ranks) here
        optimizer.step()
        loss_sum += loss.item()
        batches += 1
        samples += images.shape[0]
        bar.update(images.shape[0] * env.world_size)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    seconds = time.perf_counter() - start
    bar.close()
    return loss_sum, batches, samples, seconds


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


def _write_json_atomic(path: str, obj: dict) -> None:
    # Write a temporary file and rename it: a reader never sees half a file, and an
    # interrupted run leaves the previous summary intact (os.replace is atomic on POSIX).
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, allow_nan=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _finite_or_none(x: float):
    return None if (x is None or not math.isfinite(x)) else float(x)


def main(argv: list[str] | None = None) -> dict:
    """Run the training job (every rank runs this). Returns the summary dict on every rank.

    Synchronises at init, at every step (gradient all_reduce), after each epoch (loss and
    confusion-matrix reductions) and at cleanup.
    """
    wall_start = time.perf_counter()
    cfg = parse_config(argv)
    _set_threads_from_env()

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from .data import NUM_CLASSES, make_datasets
    from .metrics import all_reduce_confusion, miou_from_confusion
    from .models import build_model
    from .sampler import DistributedEvalSampler, DistributedSampler

    # "auto" defers to DDP_LESSON_BACKEND (set by the %%torchrun magic), then to the rule.
    env = dist_env.init_distributed(timeout=cfg.timeout_s,
                                    backend=None if cfg.backend == "auto" else cfg.backend,
                                    announce=False)
    if cfg.local_rank is not None:
        # Same rule as env.resolve_local_rank: the LOCAL_RANK variable wins over the flag.
        resolved = dist_env.resolve_local_rank([f"--local-rank={cfg.local_rank}"])
        print0(f"note: --local_rank={cfg.local_rank} is the legacy torch.distributed.launch "
               f"flag; torchrun sets LOCAL_RANK (rank 0 uses local rank {resolved}), so the "
               f"flag is not needed", env=env)
    device = torch.device(env.device)

    # Same seed on every rank: identical initial weights (DDP would broadcast rank 0's anyway,
    # but this also makes a 1-process run start from the same weights as an N-process run).
    torch.manual_seed(cfg.seed)
    train_ds, val_ds = make_datasets(cfg.num_train, cfg.num_val, cfg.size, cfg.seed,
                                     data_root=cfg.data_root)
    # Explicit num_replicas/rank: works with and without a process group.
    train_sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                       shuffle=True, seed=cfg.seed, drop_last=False)
    val_sampler = DistributedEvalSampler(val_ds, num_replicas=env.world_size, rank=env.rank)
    pin = device.type == "cuda"
    loader_kwargs = dict(batch_size=cfg.batch_size, num_workers=cfg.workers, pin_memory=pin,
                         persistent_workers=cfg.workers > 0)
    # shuffle=False: the sampler shuffles (DataLoader refuses shuffle=True with a sampler).
    train_loader = DataLoader(train_ds, sampler=train_sampler, shuffle=False,
                              drop_last=False, **loader_kwargs)
    val_loader = DataLoader(val_ds, sampler=val_sampler, shuffle=False, **loader_kwargs)

    derived = derived_values(cfg, env.world_size)
    if len(train_loader) != derived["steps_per_epoch"]:
        raise RuntimeError(f"steps per epoch: loader has {len(train_loader)}, expected "
                           f"{derived['steps_per_epoch']} = ceil(ceil({cfg.num_train}/"
                           f"{env.world_size})/{cfg.batch_size})")
    print0(f"world_size {env.world_size}  backend {env.backend} ({env.reason})  "
           f"device {device.type}", env=env)
    print0(f"batch per rank {cfg.batch_size}  global batch {derived['global_batch']} "
           f"(= {cfg.batch_size} x {env.world_size})  steps per epoch "
           f"{derived['steps_per_epoch']}  samples per epoch {derived['samples_per_epoch']} "
           f"({derived['samples_per_rank']} per rank)", env=env)

    model = build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width).to(device)
    if env.distributed:
        # device_ids only for CUDA (one GPU per process); None for CPU modules.
        # No find_unused_parameters: every parameter gets a gradient each step, and the flag
        # would make DDP walk the autograd graph after every forward to look for ones that do not.
        ddp_kwargs = {"device_ids": [env.local_rank]} if device.type == "cuda" else {}
        model = DistributedDataParallel(model, **ddp_kwargs)
    module = model.module if isinstance(model, DistributedDataParallel) else model
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)

    history = []
    train_seconds, train_samples = 0.0, 0.0
    for epoch in range(cfg.epochs):
        loss_sum, batches, samples, seconds = train_one_epoch(
            model, train_loader, train_sampler, criterion, optimizer, epoch, cfg, env, device)
        # Mean over ALL ranks' batches: sum and count reduced together, then divided.
        loss_sum, batches, samples = _sum_over_ranks([loss_sum, batches, samples])
        train_loss = loss_sum / batches
        train_seconds += seconds  # rank 0's clock; every rank steps in lockstep with DDP
        train_samples += samples
        # Evaluate the bare module: DDP's forward may sync buffers, a collective, and ranks
        # hold different numbers of validation batches.
        _sync_buffers(module)
        cm = all_reduce_confusion(evaluate(module, val_loader, NUM_CLASSES, device))
        miou, per_class, pixel_acc = miou_from_confusion(cm)
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "val_miou": miou,
                        "val_pixel_accuracy": pixel_acc})
        print0(f"epoch {epoch + 1}/{cfg.epochs}  train_loss {train_loss:.4f}  "
               f"val_mIoU {miou:.4f}  pixel_acc {pixel_acc:.4f}", env=env)

    summary = {
        "world_size": env.world_size,
        "backend": env.backend,
        "backend_reason": env.reason,
        "device": device.type,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "global_batch": derived["global_batch"],
        "steps_per_epoch": len(train_loader),
        "samples_per_epoch": derived["samples_per_epoch"],
        "final_train_loss": _finite_or_none(history[-1]["train_loss"]),
        "val_miou": _finite_or_none(history[-1]["val_miou"]),
        "val_pixel_accuracy": _finite_or_none(history[-1]["val_pixel_accuracy"]),
        "per_class_iou": [_finite_or_none(v) for v in per_class.tolist()],
        "history": [{k: _finite_or_none(v) if isinstance(v, float) else v for k, v in h.items()}
                    for h in history],
        "samples_per_s": train_samples / train_seconds if train_seconds > 0 else None,
        "wall_s": time.perf_counter() - wall_start,
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    if env.is_main:
        path = os.path.join(cfg.out, "summary.json")
        _write_json_atomic(path, summary)
        print0(f"wrote {path}", env=env)
    dist_env.cleanup()
    return summary


if __name__ == "__main__":
    main()
