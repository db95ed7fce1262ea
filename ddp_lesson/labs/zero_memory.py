"""Bytes per rank, measured: DDP, ZeRO-1 and FSDP2 on TinyGPT (notebook 08's deep dive).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.zero_memory

TinyGPT, fp32 AdamW, three ways from the same seed: DDP + ``torch.optim.AdamW``; DDP +
:class:`ddp_lesson.core.zero1.Zero1Optimizer` (ZeRO-1); ``fully_shard`` on each block and the
root (FSDP2 = ZeRO-3). After one step, gradients kept, each rank measures the parameters,
gradients and optimizer state it holds (a DTensor's local shard,
:func:`ddp_lesson.memory.local_bytes`); rank 0 prints the largest rank's bytes against
:func:`ddp_lesson.memory.memory_per_rank` (4 + 4 + 8 bytes per parameter, plus AdamW's 4-byte
``step`` per tensor, which the ZeRO paper leaves out). ZeRO-2 is the formula's row only.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from ddp_lesson.env import cleanup
from ddp_lesson.gpt import TinyGPT
from ddp_lesson.labs import gather
from ddp_lesson.labs.fsdp_tinygpt import shard_tinygpt
from ddp_lesson.labs.zero_check import HPARAMS, make_ddp, rank_rows, start_lab, zero1_behind_ddp
from ddp_lesson.memory import local_bytes, memory_per_rank, optimizer_state_bytes


def measured(model, opt, data, env) -> list[int]:
    """One step on this rank's rows, gradients kept; ``[params, grads, optimizer]`` bytes
    this rank holds, each the largest over the ranks (a collective)."""
    model(*rank_rows(data, 0, env))[1].backward()
    opt.step()
    params = list(model.parameters())
    mine = [sum(local_bytes(p) for p in params), sum(local_bytes(p.grad) for p in params),
            optimizer_state_bytes(opt)]
    every = gather(mine)
    return [max(r[i] for r in every) for i in range(3)]


def row(label: str, nbytes: list) -> str:
    """``label``, then params, grads, optimizer and their total, in bytes."""
    return f"{label:24s} " + " ".join(f"{b:>9,.0f}" for b in nbytes) + f" {sum(nbytes):>10,.0f}"


def main(argv=None):
    _, env, corpus, say, (ref, ref_ddp, ref_opt) = start_lab(__doc__.splitlines()[0], 1, argv)
    n, tensors, R = ref.num_params(), len(list(ref.parameters())), env.world_size
    ours, ours_ddp = make_ddp(env, corpus.vocab_size)
    torch.manual_seed(0)
    fsdp = TinyGPT(vocab_size=corpus.vocab_size).to(env.device)
    shard_tinygpt(fsdp, init_device_mesh(env.device.split(":")[0], (R,)))
    runs = {0: (ref_ddp, ref_opt), 1: (ours_ddp, zero1_behind_ddp(ours)),
            3: (fsdp, torch.optim.AdamW(fsdp.parameters(), **HPARAMS))}
    say(f"TinyGPT: {n:,} parameters in {tensors} tensors; world_size={R}; fp32 AdamW")
    say(f"{'bytes, largest rank':24s} {'params':>9s} {'grads':>9s} {'optimizer':>9s} "
        f"{'total':>10s}")
    for stage, name in ((0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "FSDP")):
        m = memory_per_rank(n, R, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        formula = [m.params_bytes, m.grads_bytes, m.optimizer_bytes + 4 * tensors]
        if stage in runs:
            got = measured(*runs[stage], corpus.data, env)
            say(row(f"{name} measured", got))
        say(row(f"{name} formula", formula))
    del runs, ref_ddp, ours_ddp
    cleanup()


if __name__ == "__main__":
    main()
