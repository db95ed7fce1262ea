"""Reference solutions of the checkable exercises, one per exercise id.

Spoilers, kept out of the notebooks on purpose: try the exercise first, then compare.
Each is small and written the way the lesson explains it. Where the lesson's idea has a
teaching core, the reference *is* that core (02.1: :mod:`ddp_lesson.core.sampler`, 03.6:
:mod:`ddp_lesson.core.ring`, 04.3, 04.4 and 08.5: the DDP and ZeRO-1 cores), and where torch
has it, torch's (04.2: its ``fp16_compress_hook``), and where the package has it, the
package's (02.4: :func:`ddp_lesson.evaluation.exact_accuracy`), not a second copy.
``ddp_lesson.exercises.reference(ID)`` returns the one for an id.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

# 04.2's reference: torch's own hook (default_hooks._compress_hook: the bucket cast to float16
# and divided by the group's size, state None meaning the default group, SUM-all-reduced
# asynchronously, the future's value copied back into the float32 bucket)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    fp16_compress_hook as fp16_compress_hook,
)

from ..core.bucketed_ddp import BucketedDDP as BucketedDDP  # 04.4's reference
from ..core.naive_ddp import NaiveDDP as NaiveDDP  # 04.3's reference
from ..core.naive_ddp import all_reduce_mean_
from ..core.ring import ring_all_reduce as ring_all_reduce  # 03.6's reference
from ..core.sampler import DistributedSampler as DistributedSampler  # 02.1's reference
from ..core.zero1 import Zero1Optimizer as Zero1Optimizer  # 08.5's reference
from ..evaluation import exact_accuracy as exact_accuracy  # 02.4's reference
from ..memory import per_rank_bytes


def local_rank_from_rank(rank: int, nproc_per_node: int) -> int:
    """00.3: GPU index of global ``rank`` when every node runs ``nproc_per_node`` processes."""
    return rank % nproc_per_node


def weighted_average_gradient(grad: torch.Tensor, count: int) -> torch.Tensor:
    """01.4: Σ n_r g_r / Σ n_r over the ranks; every rank returns the same tensor. A collective."""
    pair = torch.cat([grad.detach().double().reshape(-1) * count,
                      torch.tensor([float(count)], dtype=torch.float64)])
    dist.all_reduce(pair)  # one message: the weighted sum and the total count
    return (pair[:-1] / pair[-1]).to(grad.dtype).reshape(grad.shape)


def average_gradients(model: torch.nn.Module) -> None:
    """01.5: After ``loss.backward()``: replace every ``.grad`` by its mean over the ranks.

    Each gradient is divided by the world size, then SUM-all-reduced: the package's one
    averaging rule (:func:`ddp_lesson.core.naive_ddp.all_reduce_mean_`, torch's DDP order).
    A collective."""
    for p in model.parameters():
        if p.grad is not None:
            all_reduce_mean_(p.grad)


def check_same_seed_epoch(seed: int, epoch: int) -> None:
    """02.3: Raise on every rank, naming the ranks, unless all ranks have the same (seed, epoch)."""
    mine = torch.tensor([seed, epoch], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    pairs = [tuple(t.tolist()) for t in everyone]
    if len(set(pairs)) > 1:
        shown = ", ".join(f"rank {r}: seed {s} epoch {e}" for r, (s, e) in enumerate(pairs))
        raise RuntimeError(f"ranks disagree on the sampler's (seed, epoch): {shown}")


def tree_beats_ring_below(alpha_s: float, beta_s_per_byte: float, world_size: int) -> float:
    """03.3: bytes below which the tree all-reduce beats the ring; 0 if never.

    tree 2L(α + nβ) < ring 2(R-1)α + 2(R-1)/R·nβ, with L = ⌈log2 R⌉, solved for n.
    """
    levels = math.ceil(math.log2(world_size))
    latency_saved = (world_size - 1 - levels) * alpha_s
    extra_per_byte = (levels - (world_size - 1) / world_size) * beta_s_per_byte
    if latency_saved <= 0:
        return 0.0
    return latency_saved / extra_per_byte


def global_count_loss(sums: list, counts: list) -> torch.Tensor:
    """06.5: The step's loss: every micro-batch's token sum times R over the global valid count.

    The global count comes from one all_reduce of this rank's count; the rule is the token-loss
    lab's ``normalised("global token count", ...)`` (:mod:`ddp_lesson.labs.token_loss`), whose
    factor R undoes DDP's division by the world size. A collective."""
    from ..labs.token_loss import normalised

    n_rank = sum(counts)
    total = torch.tensor([float(n_rank)], dtype=torch.float64)
    dist.all_reduce(total)  # before any backward: every rank's valid tokens
    R, k = dist.get_world_size(), len(sums)
    return sum(normalised("global token count", s, n, n_rank, int(total.item()), k, 0, 0, R)
               for s, n in zip(sums, counts))


def effective_lr(base_lr: float, base_batch: int, per_rank_batch: int, world_size: int,
                 grad_accum_steps: int = 1, rule: str = "linear") -> float:
    """06.4: the learning rate for the global batch per_rank_batch × R × grad_accum_steps."""
    ratio = per_rank_batch * world_size * grad_accum_steps / base_batch
    return {"linear": base_lr * ratio, "sqrt": base_lr * math.sqrt(ratio), "none": base_lr}[rule]


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """07.5: torchrun's global RANK of process ``local_rank`` on node ``node_rank``."""
    return node_rank * nproc_per_node + local_rank


def stuck_rank(dumps: dict) -> tuple[int, int, str] | None:
    """07.6: (rank, sequence id, op) of the collective that diverged in the default group,
    from every rank's flight record (:func:`ddp_lesson.flight.first_divergence`): a rank that never
    issued it, else the rank whose op, shape or dtype is the minority's. None: all match."""
    from collections import Counter

    from ..flight import first_divergence

    found = first_divergence(dumps)
    if found is None:
        return None
    seq, have, missing = found
    if missing:
        return missing[0], seq, next(iter(have.values())).op
    votes = Counter(c.signature() for c in have.values())
    rank = min(have, key=lambda r: (votes[have[r].signature()], r))
    return rank, seq, have[rank].op


def min_ranks_zero3(num_params: float, gpu_bytes: float) -> int:
    """08.1: Fewest ranks on which ZeRO-3's 16 bytes/parameter (mixed-precision Adam) fit in
    ``gpu_bytes``."""
    return max(1, math.ceil(16 * num_params / gpu_bytes))


bytes_per_rank = per_rank_bytes  # 08.6's reference: the package's own rule


def gather_flat(shard: torch.Tensor, total_numel: int) -> torch.Tensor:
    """08.4: the flat tensor split by ``tensor_split`` over the ranks, by one all_gather."""
    world = dist.get_world_size()
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(total_numel), world)]
    padded = torch.zeros(max(sizes), dtype=shard.dtype)
    padded[:shard.numel()] = shard  # all_gather needs equal sizes: pad, gather, trim
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)])


def train_ddp(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """05.1: The DDP version of notebook 05's ``train_single``: each rank trains on its share,
    ``batch_size`` per rank; returns each epoch's mean loss over all ranks. A collective."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset)  # rank and world size from the process group
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    ddp = DDP(model)  # CPU: device_ids=None; on GPU rank r: DDP(model, device_ids=[r])
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()  # the gradients come back averaged over the ranks
            opt.step()
            total, steps = total + loss.item(), steps + 1
        mean = torch.tensor([total, steps], dtype=torch.float64)
        dist.all_reduce(mean)  # every rank: the sum over the ranks of both
        losses.append((mean[0] / mean[1]).item())
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)  # the plain model's keys
    dist.barrier()  # nobody reads the checkpoint before it is complete
    return losses
