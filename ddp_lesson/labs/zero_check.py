"""ZeRO-1 from scratch against DDP + AdamW and torch's ZeroRedundancyOptimizer (notebook 08).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.zero_check

Every rank builds the same :class:`ddp_lesson.gpt.TinyGPT` three times, each in torch's
``DistributedDataParallel``, and trains ``--steps`` AdamW steps on its slice of the same
global batches with: ``torch.optim.AdamW`` (unsharded baseline);
:class:`ddp_lesson.core.zero1.Zero1Optimizer` (ours, the core notebook 08 prints; DDP has
averaged the gradients: ``average_gradients = False``); torch's
``torch.distributed.optim.ZeroRedundancyOptimizer``.

Printed as ``key: value`` lines for the tests: weights equal (``allclose``, rtol 1e-6), each
rank's optimizer-state bytes against the unsharded figure, and a save/load round trip of the
consolidated state dict.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.core.zero1 import Zero1Optimizer
from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.gpt import TinyGPT, get_batch, load_corpus
from ddp_lesson.labs import gather
from ddp_lesson.memory import optimizer_state_bytes

RTOL = 1e-6
HPARAMS = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def global_batch(data, step: int, batch_per_rank: int, block_size: int, world_size: int):
    """The step's global batch ``(B * R, T)`` of inputs and targets, equal on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return get_batch(data, batch_per_rank * world_size, block_size, g)


def rank_rows(data, step: int, env, batch_per_rank: int = 4, block_size: int = 32):
    """This rank's ``(B, T)`` rows of the step's global batch, inputs and targets, on its
    device (local)."""
    x, y = global_batch(data, step, batch_per_rank, block_size, env.world_size)
    rows = slice(env.rank * batch_per_rank, (env.rank + 1) * batch_per_rank)
    return x[rows].to(env.device), y[rows].to(env.device)


def make_ddp(env, vocab_size):
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=vocab_size).to(env.device)
    ids = [env.local_rank] if env.device.startswith("cuda") else None
    return model, DistributedDataParallel(model, device_ids=ids)


def train_steps(ddp, opt, data, steps, start, env, batch_per_rank=4, block_size=32):
    """``steps`` steps from step ``start``; returns the losses averaged over ranks (floats)."""
    losses = []
    for step in range(start, start + steps):
        _, loss = ddp(*rank_rows(data, step, env, batch_per_rank, block_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / env.world_size)
    return losses


def same(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, float]:
    """(all parameters allclose with rtol 1e-6, max |Δ|)."""
    ok, worst = True, 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        ok &= torch.allclose(p, q, rtol=RTOL, atol=0.0)
        worst = max(worst, (p - q).abs().max().item())
    return ok, worst


def zero1_behind_ddp(model) -> Zero1Optimizer:
    """The core's ZeRO-1 over ``model``'s parameters; DDP averages the gradients (local)."""
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, **HPARAMS)
    opt.average_gradients = False
    return opt


def start_lab(description: str, default_steps: int, argv=None):
    """What the ZeRO and FSDP labs share: ``--steps``, the process group, the corpus, a rank-0
    printer and their baseline, DDP + AdamW. Synchronises (the group's join).

    Returns ``(steps, env, corpus, say, (ref, ref_ddp, ref_opt))``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=default_steps)
    args = parser.parse_args(argv)
    env = init_distributed(timeout=60)
    corpus = load_corpus()
    say = print if env.rank == 0 else (lambda *a, **k: None)
    ref, ref_ddp = make_ddp(env, corpus.vocab_size)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HPARAMS)
    return args.steps, env, corpus, say, (ref, ref_ddp, ref_opt)


def say_bytes_per_rank(say, env, mine: int, full: int, what: str, of: str) -> list[int]:
    """All-gather each rank's byte count (a collective) and print it against ``full``."""
    all_bytes = gather(mine)
    for r, b in enumerate(all_bytes):
        say(f"rank {r} {what}: {b:,} bytes = {b / full:.3f} of {of} "
            f"(x world_size: {b * env.world_size / full:.3f})")
    return all_bytes


def main(argv=None):
    steps, env, corpus, say, (ref, ref_ddp, ref_opt) = start_lab(
        __doc__.splitlines()[0], 10, argv)
    ours, ours_ddp = make_ddp(env, corpus.vocab_size)
    ours_opt = zero1_behind_ddp(ours)
    tz, tz_ddp = make_ddp(env, corpus.vocab_size)
    tz_opt = ZeroRedundancyOptimizer(tz.parameters(), optimizer_class=torch.optim.AdamW,
                                     **HPARAMS)

    ref_losses = train_steps(ref_ddp, ref_opt, corpus.data, steps, 0, env)
    ours_losses = train_steps(ours_ddp, ours_opt, corpus.data, steps, 0, env)
    train_steps(tz_ddp, tz_opt, corpus.data, steps, 0, env)

    ok_ours, d_ours = same(ours, ref)
    ok_tz, d_tz = same(tz, ref)
    ok_both, _ = same(ours, tz)
    say(f"model: TinyGPT, {ref.num_params():,} parameters in "
        f"{len(list(ref.parameters()))} tensors; world_size={env.world_size}")
    say(f"loss step 1 -> {steps} (DDP+AdamW): {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}")
    losses_same = all(abs(a - b) <= RTOL * abs(a) for a, b in zip(ours_losses, ref_losses))
    say(f"same losses as DDP+AdamW: {losses_same}")
    say(f"ours: {type(ours_opt).__module__}.{type(ours_opt).__name__}")
    say(f"Zero1Optimizer == DDP+AdamW (rtol 1e-6): {ok_ours}")
    say(f"ZeroRedundancyOptimizer == DDP+AdamW (rtol 1e-6): {ok_tz}")
    say(f"Zero1Optimizer == ZeroRedundancyOptimizer (rtol 1e-6): {ok_both}")
    say(f"max |delta| below 1e-6: {max(d_ours, d_tz) < 1e-6}")

    full = optimizer_state_bytes(ref_opt)
    mine = optimizer_state_bytes(ours_opt)
    say(f"unsharded optimizer state per rank: {full:,} bytes")
    all_bytes = say_bytes_per_rank(say, env, mine, full, "optimizer state", "unsharded")
    say(f"sum over ranks == unsharded: {sum(all_bytes) == full}")

    # consolidated state dict: equal to the unsharded AdamW's, and a save/load round trip
    ours_opt.consolidate_state_dict(to=0)
    path_box = [None]
    if env.rank == 0:
        sd = ours_opt.state_dict()
        ref_sd = ref_opt.state_dict()
        equal = all(torch.equal(sd["state"][i][k].cpu(), ref_sd["state"][i][k].cpu())
                    for i in ref_sd["state"] for k in ("exp_avg", "exp_avg_sq", "step"))
        equal = equal and sd["state"].keys() == ref_sd["state"].keys()
        say(f"consolidated state == AdamW state: {equal}")
        tmp = tempfile.mkdtemp(prefix="zero_ckpt_")
        path_box[0] = os.path.join(tmp, "optim.pt")
        torch.save(sd, path_box[0])
    dist.broadcast_object_list(path_box, src=0)
    loaded_sd = torch.load(path_box[0], weights_only=False)
    # Continue 3 steps with the live optimizer, then rewind the weights, load the saved state
    # into a fresh Zero1Optimizer and redo the 3 steps through the same DDP wrapper (a new
    # wrapper would bucket gradients differently, and with 3 ranks the all-reduce would then
    # add them in another order).
    snapshot = [p.detach().clone() for p in ours.parameters()]
    train_steps(ours_ddp, ours_opt, corpus.data, 3, steps, env)
    live = [p.detach().clone() for p in ours.parameters()]
    with torch.no_grad():
        for p, q in zip(ours.parameters(), snapshot):
            p.copy_(q)
    del ours_opt
    ours_opt = zero1_behind_ddp(ours)
    ours_opt.load_state_dict(loaded_sd)
    train_steps(ours_ddp, ours_opt, corpus.data, 3, steps, env)
    train_steps(ref_ddp, ref_opt, corpus.data, 3, steps, env)
    reloaded = all(torch.equal(p, q) for p, q in zip(ours.parameters(), live))
    say(f"reloaded optimizer continues identically: {reloaded}")
    say(f"still equal to DDP+AdamW after 3 more steps: {same(ours, ref)[0]}")
    dist.barrier()
    if env.rank == 0:
        os.remove(path_box[0])
        os.rmdir(os.path.dirname(path_box[0]))

    del ref_ddp, ours_ddp, tz_ddp, ref_opt, ours_opt, tz_opt
    cleanup()


if __name__ == "__main__":
    main()
