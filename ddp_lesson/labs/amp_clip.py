"""Mixed precision and gradient clipping on many ranks.

Shown in ``notebooks/deep/06_scaling_and_mixed_precision.ipynb``, section 2.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.amp_clip [--out FILE]

Three scenarios on the trainer's own step (:func:`ddp_lesson.train.train_step`, a
:class:`ddp_lesson.train.Precision`) under torch's ``DistributedDataParallel``, the ``tiny``
segmentation net, a fixed global batch of synthetic scenes (each rank its slice); each is a
collective:

1. :func:`precision_runs`: 6 steps in fp32, bf16 autocast, fp16 with a GradScaler: the
   losses follow one another closely, not bit for bit.
2. :func:`scaler_run`: fp16 with a small ``GradScaler`` (1024, doubling after 2 good steps);
   at step 5 ONE rank's backward makes an inf. DDP all-reduces the gradients *before* the
   scaler looks, so every rank finds the inf, skips the step and halves its scale: the ranks
   stay identical without a word about it.
3. :func:`clip_run`: clipping after ``scaler.unscale_``: the scaled norm is exactly
   ``scale`` times the true one, and the norm before clipping is bit-identical on every rank
   (checked with an all_gather).

``main`` prints rounded facts (the same on every machine): scenarios 1 and 3 on rank 0, 2 on
every rank; ``--out``: rank 0 writes every number as JSON. Sources:
``torch/amp/grad_scaler.py`` (``unscale_``, ``step`` skips when ``found_inf``, ``update``),
``torch/nn/utils/clip_grad.py``. ``main`` joins a gloo group on any machine: its tensors are
CPU tensors, which NCCL refuses ("Tensors must be CUDA and dense", ``ProcessGroupNCCL.cpp``).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.data import NUM_CLASSES, make_datasets
from ddp_lesson.labs import gather
from ddp_lesson.models import build_model
from ddp_lesson.train import Precision, sum_over_ranks, train_step

__all__ = ["GLOBAL_BATCH", "INJECT_RANK", "INJECT_STEP", "SCALER", "STEPS", "clip_run",
           "main", "precision_runs", "scaler_run"]

#: Scenes in the global batch (each of R ranks takes ``GLOBAL_BATCH // R`` of them).
GLOBAL_BATCH = 8
#: Steps per run.
STEPS = 6
#: The GradScaler of scenario 2: small initial scale, doubling after 2 steps without inf.
SCALER = {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 2}
#: Scenario 2: the rank whose backward produces an inf, and the (1-based) step.
INJECT_RANK, INJECT_STEP = 1, 5
#: Scenario 2 runs this many steps.
SCALER_STEPS = 8
#: Scenario 3: the clipping threshold (below the norms of the first steps).
CLIP = 0.25
_SIZE = (32, 64)
#: Scenario 1: bf16 and fp16 losses stay this close to fp32's (measured: about 1e-4).
TOL = 0.001


def _batch():
    """This rank's slice of the fixed global batch:
    ``[(images (b, 3, 32, 64), target (b, 32, 64))]``."""
    r, R = dist.get_rank(), dist.get_world_size()
    train, _ = make_datasets(GLOBAL_BATCH, 1, _SIZE, seed=0)
    per = GLOBAL_BATCH // R
    items = [train[i] for i in range(r * per, (r + 1) * per)]
    return [(torch.stack([x for x, _ in items]), torch.stack([t for _, t in items]))]


def _model():
    """The tiny net, seeded (the same on every rank), in torch's DDP, and SGD."""
    torch.manual_seed(0)
    module = build_model("tiny", num_classes=NUM_CLASSES, width=8)
    ddp = DistributedDataParallel(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    return module, ddp, opt


def _global_loss(loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    total = sum_over_ranks(torch.stack([loss_sum.double(), count.double()]).cpu())
    return float(total[0] / total[1])


def _same_on_every_rank(values: list[float]) -> bool:
    """True when every rank holds exactly these values (an all_gather; a collective)."""
    gathered = gather([float(v) for v in values])
    return all(g == gathered[0] for g in gathered)


def precision_runs(steps: int = STEPS) -> dict:
    """The same training in fp32, bf16 and fp16 (+ GradScaler) (a collective).

    Returns:
        ``{"fp32": [loss per step], "bf16": [...], "fp16": [...]}``, each the mean over the
        global batch's labelled pixels (the same on every rank).
    """
    batch = _batch()
    out = {}
    for amp in ("off", "bf16", "fp16"):
        _, ddp, opt = _model()
        precision = Precision(amp, "cpu")
        losses = []
        for _ in range(steps):
            s, c = train_step(ddp, opt, batch, dist.get_world_size(), precision=precision)
            losses.append(_global_loss(s, c))
        out["fp32" if amp == "off" else amp] = losses
    return out


def scaler_run(steps: int = SCALER_STEPS, inject_rank: int = INJECT_RANK,
               inject_step: int = INJECT_STEP) -> dict:
    """fp16 with a small GradScaler; one rank's backward makes an inf at ``inject_step``.

    A tensor hook writes the inf into the classifier's weight gradient on ``inject_rank``, in
    that rank's backward, before DDP's all_reduce. A collective.

    Returns this rank's view: ``{"rank", "scale_before", "scale_after", "skipped",
    "local_finite" (own gradient, before the all_reduce), "reduced_finite" (after it),
    "losses"}``, each a list per step, and ``"weights_same"`` (all ranks, at the end).
    """
    rank = dist.get_rank()
    batch = _batch()
    module, ddp, opt = _model()
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    precision = Precision("fp16", "cpu", scaler=scaler)
    state = {"step": 0, "local_finite": None}
    weight = module.classifier.weight

    def hook(grad):
        state["local_finite"] = bool(torch.isfinite(grad).all())
        if rank == inject_rank and state["step"] == inject_step:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")  # an fp16 overflow in this rank's backward
            state["local_finite"] = False
        return grad

    weight.register_hook(hook)
    res = {"rank": rank, "scale_before": [], "scale_after": [], "skipped": [],
           "local_finite": [], "reduced_finite": [], "losses": []}
    reduced = {}

    real_step = precision.step

    def step_and_look(optimizer, parameters):
        # the gradient every rank holds after the all_reduce, still scaled
        reduced["finite"] = bool(torch.isfinite(weight.grad).all())
        real_step(optimizer, parameters)

    precision.step = step_and_look
    for i in range(1, steps + 1):
        state["step"] = i
        res["scale_before"].append(scaler.get_scale())
        s, c = train_step(ddp, opt, batch, dist.get_world_size(), precision=precision)
        res["losses"].append(_global_loss(s, c))
        res["scale_after"].append(scaler.get_scale())
        res["skipped"].append(precision.skipped)
        res["local_finite"].append(state["local_finite"])
        res["reduced_finite"].append(reduced["finite"])
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double()
    res["weights_same"] = _same_on_every_rank(flat.tolist())
    return res


def clip_run(steps: int = 4, max_norm: float = CLIP) -> dict:
    """fp16 + GradScaler + clipping written out: scale, backward, unscale_, clip (a collective).

    Returns:
        Per step ``"scaled_norms"``, ``"norms"`` (after unscale_, before clipping),
        ``"scales"``, ``"clipped_norms"``; ``"same_on_every_rank"`` (the norms, bit for bit);
        ``"max_norm"``.
    """
    batch = _batch()
    module, ddp, opt = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    precision = Precision("fp16", "cpu", scaler=scaler)
    params = list(module.parameters())
    res = {"scaled_norms": [], "norms": [], "scales": [], "clipped_norms": [],
           "max_norm": max_norm}
    images, target = batch[0]
    count = sum_over_ranks(torch.tensor([float((target != 255).sum())],
                                        dtype=torch.float64))[0].item()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with precision.autocast():
            logits = ddp(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=255,
                                                 reduction="sum") * dist.get_world_size() / count
        scaler.scale(loss).backward()            # DDP all-reduces the *scaled* gradients
        res["scales"].append(scaler.get_scale())
        res["scaled_norms"].append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in params])))
        scaler.unscale_(opt)                     # now the true gradients
        res["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        res["clipped_norms"].append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in params])))
        scaler.step(opt)                         # skips if inf/NaN (already unscaled: no twice)
        scaler.update()
    res["same_on_every_rank"] = _same_on_every_rank(res["norms"])
    return res


# --------------------------------------------------------------------------- report

def report(res: dict, rank: int) -> None:
    """Print the rounded facts: scenarios 1 and 3 on rank 0, 2 on every rank (lines under 92
    characters: the launcher adds ``[rank N] ``).
    """
    R = res["world_size"]
    if rank == 0:
        p = res["precision"]
        print(f"1. one model, global batch {GLOBAL_BATCH} on {R} ranks, {STEPS} steps, "
              "in three precisions")
        for name in ("fp32", "bf16", "fp16"):
            losses = p[name]
            line = f"  {name}: loss {losses[0]:.2f} -> {losses[-1]:.2f}"
            if name != "fp32":
                d = max(abs(a - b) for a, b in zip(losses, p["fp32"]))
                line += (f"  max |loss - fp32| < {TOL}: {d < TOL}  "
                         f"bit-identical to fp32: {losses == p['fp32']}")
            print(line)
    s = res["scaler"]
    skipped = [i + 1 for i, x in enumerate(s["skipped"]) if x]
    if rank == 0:
        print(f"2. fp16, GradScaler(init_scale={SCALER['init_scale']:g}, growth_interval="
              f"{SCALER['growth_interval']}); an inf on rank {INJECT_RANK} at step {INJECT_STEP}")
    print("  scale after each step: " + " ".join(f"{v:g}" for v in s["scale_after"]))
    k = INJECT_STEP - 1
    print(f"  step {INJECT_STEP}: own gradient finite {s['local_finite'][k]}, after all_reduce "
          f"{s['reduced_finite'][k]}; skipped steps {skipped}")
    if rank == 0:
        print(f"  weights identical on all {R} ranks after {len(s['skipped'])} steps: "
              f"{s['weights_same']}")
        c = res["clip"]
        ratios = [a / b for a, b in zip(c["scaled_norms"], c["norms"])]
        print(f"3. fp16 (scale {c['scales'][0]:g}), clip to {c['max_norm']:g} after unscale_")
        print("  norm of scaled grads / true norm: " + ", ".join(f"{x:g}" for x in ratios))
        print("  total norm before clipping: " + ", ".join(f"{x:.3g}" for x in c["norms"]))
        print(f"  after clipping, at most {c['max_norm']:g}: "
              f"{all(x <= c['max_norm'] * (1 + 1e-6) for x in c['clipped_norms'])}")
    print(f"  norms before clipping bit-identical on every rank: "
          f"{res['clip']['same_on_every_rank']}")


def main(argv=None) -> dict:
    """Run the three scenarios (a collective), print the facts, write ``--out`` (rank 0)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0)")
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()
    if owns_group:
        from ddp_lesson.env import init_distributed
        init_distributed(backend="gloo", announce=False)
    torch.set_num_threads(1)
    res = {"world_size": dist.get_world_size(), "precision": precision_runs(),
           "scaler": scaler_run(), "clip": clip_run()}
    report(res, dist.get_rank())
    res["scaler_by_rank"] = gather(res["scaler"])
    if args.out and dist.get_rank() == 0:
        from pathlib import Path
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, allow_nan=False)
    if owns_group:
        import gc
        gc.collect()  # free the DDP wrappers before the group goes
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
