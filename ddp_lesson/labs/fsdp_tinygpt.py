"""FSDP2 (``fully_shard``) on TinyGPT against DDP: same losses, ~1/R of the parameters per rank.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.fsdp_tinygpt

Every rank builds the same :class:`ddp_lesson.gpt.TinyGPT` twice: one in
``DistributedDataParallel``, one with ``fully_shard`` (PyTorch's FSDP2) on each block and then
the model, which makes every parameter a ``DTensor`` sharded on dim 0 (ZeRO-3: parameters,
gradients, AdamW states). Forward all-gathers a block's parameters just before it runs and
frees them after; backward reduce-scatters the gradients. Both train ``--steps`` AdamW steps
on the same batches; printed: the losses (rounded), whether they match, each rank's
parameter bytes. CPU with gloo or GPUs with NCCL. Source:
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html

Then one more step of each is *counted*: FSDP2's collectives (``all_gather_single`` /
``reduce_scatter_single``, called through the module by
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) by wrapping them, DDP's bucket
all-reduces by a comm hook, and the unsharded parameter bytes by a forward pre-hook per
block. Ring model: all-gather and reduce-scatter send ``(R-1)/R`` of the full size,
all-reduce ``2(R-1)/R``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddp_lesson.env import cleanup
from ddp_lesson.gpt import TinyGPT
from ddp_lesson.labs.zero_check import (
    HPARAMS,
    rank_rows,
    say_bytes_per_rank,
    start_lab,
    train_steps,
)
from ddp_lesson.memory import local_bytes

LOSS_TOL = 1e-5


def shard_tinygpt(model: TinyGPT, mesh) -> TinyGPT:
    """``fully_shard`` each block, then the root (embeddings, final norm, head); in place."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


#: The collectives FSDP2 issues, as ``torch.distributed`` attributes: name -> ring factor
#: (bytes one rank sends per byte of the full tensor, times R / (R - 1)).
COUNTED = {"all_gather_single": 1, "reduce_scatter_single": 1,
           "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}


@contextlib.contextmanager
def count_collectives(record: list):
    """Wrap :data:`COUNTED` in ``torch.distributed``; append ``(name, full_bytes)`` per call.

    ``full_bytes``: the largest tensor argument (the unsharded size). Only calls through the
    module attribute are seen (FSDP2's; not DDP's C++ Reducer). Restores them on exit.
    """
    saved = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            record.append((name, max(t.numel() * t.element_size() for t in tensors)))
            return fn(*args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield record
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def counting_allreduce_hook(record: list):
    """A DDP comm hook: record ``("all_reduce", bucket bytes)``, then torch's default hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        buf = bucket.buffer()
        record.append(("all_reduce", buf.numel() * buf.element_size()))
        return allreduce_hook(state, bucket)
    return hook


def unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters currently registered as plain (unsharded) tensors."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))


def traffic(record: list, world_size: int) -> dict:
    """Calls, full-size bytes and ring-model bytes sent per rank, per collective name."""
    out = {}
    for name, nbytes in record:
        d = out.setdefault(name, {"calls": 0, "full_bytes": 0, "sent_bytes": 0})
        d["calls"] += 1
        d["full_bytes"] += nbytes
        d["sent_bytes"] += COUNTED[name] * nbytes * (world_size - 1) // world_size
    return out


def one_step(model, opt, data, step, env):
    """One training step on this rank's slice (no loss averaging: no extra collective)."""
    _, loss = model(*rank_rows(data, step, env))
    loss.backward()
    opt.step()
    opt.zero_grad()


def measure_traffic(say, env, corpus, ref_ddp, ref_opt, model, opt, full_bytes, step):
    """Count one step of DDP and of FSDP2 (module docstring) and print it.

    Returns ``(ddp, fsdp, during)``: :func:`traffic` of each, and the unsharded parameter bytes
    at each block's forward pre-hook. Leaves DDP with a comm hook registered.
    """
    ddp_record, fsdp_record, during = [], [], []
    ref_ddp.register_comm_hook(None, counting_allreduce_hook(ddp_record))
    one_step(ref_ddp, ref_opt, corpus.data, step, env)
    hooks = [b.register_forward_pre_hook(lambda m, a: during.append(unsharded_bytes(model)))
             for b in model.blocks]
    with count_collectives(fsdp_record):
        one_step(model, opt, corpus.data, step, env)
    for h in hooks:
        h.remove()
    ddp, fsdp = traffic(ddp_record, env.world_size), traffic(fsdp_record, env.world_size)
    for what, t in (("DDP ", ddp), ("FSDP", fsdp)):
        for name, d in sorted(t.items()):
            say(f"{what} one step: {d['calls']} x {name}, {d['full_bytes']:,} bytes unsharded, "
                f"{d['sent_bytes']:,} sent per rank")
    ddp_sent = sum(d["sent_bytes"] for d in ddp.values())
    fsdp_sent = sum(d["sent_bytes"] for d in fsdp.values())
    say(f"FSDP / DDP bytes sent per rank: {fsdp_sent / ddp_sent:.2f}")
    say(f"peak unsharded parameter bytes while a block runs: {max(during):,} "
        f"= {max(during) / full_bytes:.3f} of full")
    return ddp, fsdp, during


def main(argv=None):
    steps, env, corpus, say, (ref, ref_ddp, ref_opt) = start_lab(
        __doc__.splitlines()[0], 5, argv)
    full_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=corpus.vocab_size).to(env.device)
    mesh = init_device_mesh("cuda" if env.device.startswith("cuda") else "cpu",
                            (env.world_size,))
    shard_tinygpt(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), **HPARAMS)
    mine = sum(local_bytes(p) for p in model.parameters())   # each DTensor's local shard

    ref_losses = train_steps(ref_ddp, ref_opt, corpus.data, steps, 0, env)
    losses = train_steps(model, opt, corpus.data, steps, 0, env)
    worst = max(abs(a - b) for a, b in zip(ref_losses, losses))
    say(f"parameters are DTensors sharded on dim 0: "
        f"{all(isinstance(p, DTensor) for p in model.parameters())}")
    say("DDP  losses: " + " ".join(f"{v:.3f}" for v in ref_losses))
    say("FSDP losses: " + " ".join(f"{v:.3f}" for v in losses))
    say(f"FSDP losses match DDP within {LOSS_TOL:g}: {worst < LOSS_TOL}")
    gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
    wdiff = max((gathered[n] - q).abs().max().item() for n, q in ref.named_parameters())
    say(f"weights after {steps} steps match DDP within 1e-5: {wdiff < 1e-5}")
    say(f"full parameters (what DDP keeps on every rank): {full_bytes:,} bytes")
    say_bytes_per_rank(say, env, mine, full_bytes, "FSDP parameter shard", "full")
    measure_traffic(say, env, corpus, ref_ddp, ref_opt, model, opt, full_bytes, steps)

    del ref_ddp, ref_opt, opt, model, gathered
    cleanup()


if __name__ == "__main__":
    main()
