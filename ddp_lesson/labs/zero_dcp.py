"""ZeRO-1's sharded optimizer state saved with ``torch.distributed.checkpoint`` at R ranks and
loaded at another world size R' (notebook 08's deep dive, ``tests/zero/test_zero_dcp.py``).

    torchrun --nproc-per-node 2 -m ddp_lesson.labs.zero_dcp --steps 6 --save-at 3 --save D
    torchrun --nproc-per-node 1 -m ddp_lesson.labs.zero_dcp --steps 3 --load D --out W

Every rank trains the same :class:`ddp_lesson.gpt.TinyGPT` (seed 0) in torch's
``DistributedDataParallel`` with :class:`ddp_lesson.core.zero1.Zero1Optimizer`, ``--steps``
AdamW steps on its ``G / R`` rows of the same ``G = 8`` sequences per step (R = 1, 2, 4, 8
see the same data). ``--save D`` writes the model and each rank's shard
(:func:`ddp_lesson.zero.dcp_save`), after ``--save-at K`` steps if given; ``--load D`` reads
them at this R (:func:`ddp_lesson.zero.dcp_load`) and goes on from the saved step. Each rank
prints one JSON line (``{"rank", "world_size", "step", "owned", "state_tensors"}``);
``--out W``: rank 0 writes the final weights (from the CPU); ``--dump-loaded F``: the state as
loaded (consolidated on rank 0, torch's format). Tensors are built on the CPU, then moved
to ``env.device``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.cli import plain
from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.gpt import TinyGPT, get_batch, load_corpus
from ddp_lesson.labs.zero_check import zero1_behind_ddp
from ddp_lesson.zero import dcp_load, dcp_save

GLOBAL_BATCH = 8
BLOCK_SIZE = 32


def save(path, model, opt, step: int, env) -> None:
    """The DCP checkpoint (a collective), then rank 0 writes the step it stands at."""
    dcp_save(path, model, opt)
    if env.rank == 0:
        with open(os.path.join(path, "step.json"), "w") as f:
            json.dump({"step": step, "world_size": env.world_size}, f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--steps", type=int, required=True, help="steps to train in this run")
    parser.add_argument("--save", help="directory: write a DCP checkpoint at the end")
    parser.add_argument("--save-at", type=int, help="save after this many of the steps")
    parser.add_argument("--load", help="directory: start from this DCP checkpoint")
    parser.add_argument("--dump-loaded", help="file: the loaded optimizer state (rank 0)")
    parser.add_argument("--out", help="file: rank 0 writes the final weights (torch.save)")
    args = parser.parse_args(argv)
    env = init_distributed(timeout=60)
    if GLOBAL_BATCH % env.world_size:
        raise SystemExit(f"world_size {env.world_size} does not divide the global batch "
                         f"{GLOBAL_BATCH}")
    corpus = load_corpus()
    torch.manual_seed(0)
    # built on the CPU (the same weights on any machine), then on this rank's device:
    # cuda:LOCAL_RANK under NCCL, which refuses CPU tensors, else cpu
    model = TinyGPT(vocab_size=corpus.vocab_size).to(env.device)
    ddp = DistributedDataParallel(model)
    opt = zero1_behind_ddp(model)
    start = 0
    if args.load:
        dcp_load(args.load, model, opt)
        with open(os.path.join(args.load, "step.json")) as f:
            start = json.load(f)["step"]
        if args.dump_loaded:
            opt.consolidate_state_dict(to=0)
            if env.rank == 0:
                torch.save(opt.state_dict(), args.dump_loaded)
    per_rank = GLOBAL_BATCH // env.world_size
    rows = slice(env.rank * per_rank, (env.rank + 1) * per_rank)
    save_at = args.steps if args.save_at is None else args.save_at
    for step in range(start, start + args.steps):
        if args.save and step == start + save_at:
            save(args.save, model, opt, step, env)
        x, y = get_batch(corpus.data, GLOBAL_BATCH, BLOCK_SIZE,
                         torch.Generator().manual_seed(1000 + step))
        _, loss = ddp(x[rows].to(env.device), y[rows].to(env.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    owned = [i for i, r in enumerate(opt.owner) if r == env.rank]
    print(json.dumps({"rank": env.rank, "world_size": env.world_size,
                      "step": start + args.steps, "owned": len(owned),
                      "of": len(opt.params), "state_tensors": len(opt.optim.state)}),
          flush=True)
    if args.save and save_at == args.steps:
        save(args.save, model, opt, start + args.steps, env)
    if args.out and env.rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                   args.out)
    dist.barrier()
    cleanup()


def compare(resumed, uninterrupted, tolerance: float = 1e-4) -> dict:
    """Final weights of two runs (``--out`` files): prints and returns whether the largest
    ``|Δw|`` is below ``tolerance`` and whether every tensor is bit-identical. Local.

    Raises:
        ValueError: the files hold different numbers of tensors.
    """
    a, b = torch.load(resumed), torch.load(uninterrupted)
    if a.keys() != b.keys():
        raise ValueError(f"{resumed} has {len(a)} tensors, {uninterrupted} {len(b)}")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    facts = {f"max |dw| below {tolerance:g}": worst < tolerance,
             "bit-identical": all(torch.equal(a[k], b[k]) for k in a)}
    for k, v in facts.items():
        print(f"{k}: {v}")
    return facts


if __name__ == "__main__":
    main()
