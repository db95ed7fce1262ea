"""FSDP2 (``fully_shard``) on TinyGPT against DDP: same losses, ~1/R of the parameters per rank.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.fsdp_tinygpt

Every rank builds the same :class:`ddp_lesson.gpt.TinyGPT` twice from the same seed. One copy
is wrapped in ``DistributedDataParallel``; on the other, ``fully_shard`` (PyTorch's FSDP2,
``torch.distributed.fsdp``) is applied to each transformer block and then to the whole model,
which turns every parameter into a ``DTensor`` sharded along dimension 0 across the ranks
(ZeRO stage 3: parameters, gradients and AdamW states all sharded). Forward all-gathers a
block's parameters just before it runs and frees them after; backward reduce-scatters the
gradients. Both train for ``--steps`` AdamW steps on the same batches; the lab prints the
losses (rounded), whether they match, and each rank's measured parameter bytes. Works on CPU
with gloo and on GPUs with NCCL. Source: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddp_lesson.env import cleanup
from ddp_lesson.gpt import TinyGPT
from ddp_lesson.labs.zero_check import HPARAMS, say_bytes_per_rank, start_lab, train_steps

LOSS_TOL = 1e-5


def local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds (the local shard of each DTensor)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def shard_tinygpt(model: TinyGPT, mesh) -> TinyGPT:
    """``fully_shard`` each block, then the root (embeddings, final norm, head); in place."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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
    mine = local_param_bytes(model)

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

    del ref_ddp, ref_opt, opt, model, gathered
    cleanup()


if __name__ == "__main__":
    main()
