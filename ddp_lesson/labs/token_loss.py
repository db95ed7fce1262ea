"""Token-weighted losses across ranks and accumulation steps: only the global token count matches.

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.token_loss [--json]

A language model's loss is the mean over *valid* tokens (targets ``-100``, padding, are
ignored), and micro-batches and ranks hold different numbers of them. Each rank runs K
micro-batches (``no_sync`` on all but the last) of B padded sequences of TinyGPT under torch's
``DistributedDataParallel``, on its slice of one global batch. Four normalisations of a
micro-batch's summed loss ``S_j`` (``n_j`` valid tokens) are compared with one process's
gradient of the mean over every valid token:

* micro-batch mean, ``S_j / n_j / K``: equal when every micro-batch has as many tokens;
* padded positions, ``S_j / (K * B * T)``: equal when there is no padding;
* rank token count, ``S_j / n_rank``: equal when every rank has the same count;
* global token count, ``S_j * R / n_global``: always equal.

``n_global`` is one ``all_reduce`` before the backwards; ``R`` undoes DDP's division by the
world size (the fix of huggingface/transformers#34191, huggingface/trl#3231,
pytorch/torchtune#1875; :func:`ddp_lesson.train.train_step`'s pixel count is the same rule).
And the fp16 rule (docs/pitfalls.md B24): a scaled token-sum gradient overflows float16 when
summed over ranks before the division by the global count, not when divided first.

Rank 0 prints each normalisation's relative gradient error and whether it matches
(``allclose``, rtol 1e-4), the two fp16 orders, and whether every rank found the same;
``--json`` adds one JSON line per rank with every number.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.env import cleanup, init_distributed, print0, reduce_device
from ddp_lesson.gpt import GPTConfig, TinyGPT, load_corpus
from ddp_lesson.labs import gather

METHODS = ("micro-batch mean", "padded positions", "rank token count", "global token count")
IGNORE = -100


def padded_batch(data: torch.Tensor, n: int, block_size: int, seed: int = 0):
    """``n`` sequences of random length 2..T from ``data``, padded to T: ``(x, y)`` both
    ``(n, T)`` int64, targets past a sequence's end set to ``-100`` (ignored by the loss)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - block_size - 1, (n,), generator=g)
    lengths = torch.randint(2, block_size + 1, (n,), generator=g)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    pos = torch.arange(block_size)
    y[pos.expand(n, -1) >= lengths[:, None]] = IGNORE
    return x, y


def token_sum(model, x, y) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the valid tokens of ``(x, y)``, and their count."""
    logits, _ = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, int((y != IGNORE).sum())


def normalised(method: str, s, n_micro: int, n_rank: int, n_global: int, k: int, b: int, t: int,
               world_size: int):
    """One micro-batch's loss ``s`` (summed over its ``n_micro`` valid tokens), normalised."""
    if method == "micro-batch mean":
        return s / n_micro / k
    if method == "padded positions":
        return s / (k * b * t)
    if method == "rank token count":
        return s / n_rank
    return s * world_size / n_global  # DDP divides by world_size: the global mean


def ddp_gradient(base, method: str, micro, world_size: int, k: int, b: int, t: int):
    """This rank's gradient after one DDP step of ``method`` over its ``micro`` batches.

    Synchronises: an all_reduce of the token count, and DDP's gradient all-reduce.
    """
    model = DistributedDataParallel(copy.deepcopy(base))
    counts = [int((y != IGNORE).sum()) for _, y in micro]
    n_rank = sum(counts)
    total = torch.tensor([float(n_rank)], device=reduce_device())
    dist.all_reduce(total)  # the global count, known before any backward
    for j, (x, y) in enumerate(micro):
        last = j == len(micro) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            s, n = token_sum(model, x, y)
            normalised(method, s, n, n_rank, int(total.item()), k, b, t, world_size).backward()
    return torch.cat([p.grad.flatten() for p in model.module.parameters()]), counts


def run(k: int = 2, b: int = 2, block_size: int = 16, seed: int = 0) -> dict:
    """Every method's relative gradient error against one process on the global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus()
    cfg = GPTConfig(vocab_size=corpus.vocab_size, block_size=block_size, n_embd=32, n_head=2,
                    n_layer=1)
    device = reduce_device()  # cuda:LOCAL_RANK under NCCL (CUDA tensors only), else cpu
    torch.manual_seed(seed)
    base = TinyGPT(cfg).to(device)  # built on the CPU: the same weights on any machine
    x, y = (t.to(device) for t in padded_batch(corpus.data, world_size * k * b, block_size, seed))
    # one process, the global batch: the mean over every valid token
    ref = copy.deepcopy(base)
    s, n = token_sum(ref, x, y)
    (s / n).backward()
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])
    # this rank's K micro-batches of B sequences
    mine = [(x[i:i + b], y[i:i + b]) for i in range((rank * k) * b, (rank + 1) * k * b, b)]
    out = {"rank": rank, "tokens_global": n, "methods": {}}
    for method in METHODS:
        g, counts = ddp_gradient(base, method, mine, world_size, k, b, block_size)
        out["tokens_per_micro_batch"] = counts
        rel = float((g - g_ref).norm() / g_ref.norm())
        out["methods"][method] = {"rel_err": rel,
                                  "matches": bool(torch.allclose(g, g_ref, rtol=1e-4, atol=1e-7))}
    out["fp16"] = fp16_order(base, mine, n, g_ref)
    return out


def fp16_order(base, micro, n_global: int, g_ref, scale: float = 2.0 ** 16) -> dict:
    """The fp16 rule: this rank's token-sum gradient times a loss scale (``GradScaler``'s
    default 2^16), all-reduced in float16, once summed then divided by the global count, once
    divided first. Synchronises: two all_reduce calls.
    """
    model = copy.deepcopy(base)
    for x, y in micro:
        token_sum(model, x, y)[0].backward()
    raw = torch.cat([p.grad.flatten() for p in model.parameters()]) * scale
    sum_first = raw.half()
    dist.all_reduce(sum_first)
    divide_first = (raw / n_global).half()
    dist.all_reduce(divide_first)
    got = divide_first.float() / scale
    return {"sum_then_divide_finite": bool(torch.isfinite(sum_first).all()),
            "divide_then_sum_finite": bool(torch.isfinite(divide_first).all()),
            "divide_then_sum_rel_err": float((got - g_ref).norm() / g_ref.norm())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="also one JSON line per rank")
    opts = p.parse_args(argv)
    init_distributed(timeout=60)
    res = run()
    every = gather(res)
    print0(f"valid tokens per micro-batch, by rank: {[r['tokens_per_micro_batch'] for r in every]}")
    print0(f"valid tokens in the global batch: {res['tokens_global']}")
    for method, m in res["methods"].items():
        print0(f"{method:>18}: relative error {m['rel_err']:.2f}, matches: {m['matches']}")
    worst = max(r["methods"]["global token count"]["rel_err"] for r in every)
    print0(f"global token count, relative error below 1e-6 on every rank: {worst < 1e-6}")
    f = res["fp16"]
    print0(f"fp16, scale 2^16, sum then divide: finite {f['sum_then_divide_finite']}")
    print0(f"fp16, scale 2^16, divide then sum: finite {f['divide_then_sum_finite']}")
    print0(f"divide then sum within fp16 precision (< 1e-3): {f['divide_then_sum_rel_err'] < 1e-3}")
    # DDP leaves every rank the same gradient: the same errors, verdicts and fp16 results
    same = all((r["tokens_global"], r["methods"], r["fp16"])
               == (res["tokens_global"], res["methods"], res["fp16"]) for r in every)
    print0(f"the same count, errors and fp16 results on every rank: {same}")
    if opts.json:
        print(json.dumps(res))
    cleanup()


if __name__ == "__main__":
    main()
