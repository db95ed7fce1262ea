"""ZeRO stage 1: each rank keeps optimizer state for its own shard of the parameters only.

Under plain data parallelism every rank holds the whole optimizer state (for Adam two fp32
tensors per parameter, ``exp_avg`` and ``exp_avg_sq``) and computes the very same update from
the same averaged gradients: R copies of one computation. ZeRO-1 (S. Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, stage
``P_os``) gives each parameter one owner and keeps its state on that rank alone:

1. **Partition** the parameters over the R ranks (:func:`partition_parameters`: whole tensors,
   largest first, each to the least-loaded rank). Every rank computes the same partition on its
   own, so nothing is sent.
2. **A local optimizer over the shard.** The real optimizer (``torch.optim.AdamW``, ...) is
   built over this rank's parameters only, so it holds about ``1/R`` of the state.
3. **Step** = average the gradients over the ranks (an all-reduce, as DDP does), update the
   shard with the local optimizer, then **broadcast** every parameter from its owner, so every
   rank holds the whole updated model again.

The updated values equal unsharded training's up to the order of the gradient sum: an
element-wise update such as Adam's does not depend on which rank computes it. torch's own
version is ``torch.distributed.optim.ZeroRedundancyOptimizer`` (its partition rule, its
``optimizer_class, **defaults`` signature); it leaves the gradient average to DDP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Zero1Optimizer", "partition_parameters"]


class Zero1Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over every parameter whose state lives on one rank each.

    Args:
        params: tensors or param-group dicts, the same (same order, same values) on every rank.
        optimizer_class: the local optimizer class, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (None: the default group).
        **defaults: hyperparameters for ``optimizer_class`` (``lr=..., weight_decay=...``).

    Attributes: ``param_groups`` (every parameter, as the model's code built them: set ``lr``
    here, or let a scheduler), ``params`` (all parameters in order), ``owner[i]`` (the rank
    that updates parameter ``i``), ``optim`` (the local optimizer over this rank's shard),
    ``state`` (its state), ``average_gradients`` (set False behind torch's DDP).

    :meth:`step` and :meth:`consolidate_state_dict` are collectives every rank must call;
    construction and :meth:`add_param_group` are local but must happen alike on every rank.
    Checkpoints as torch's: ``consolidate_state_dict(to=0)``, then ``state_dict()`` on rank
    0; ``load_state_dict(full)`` on every rank.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` class.
        ValueError: no parameters (torch's own check).
    """

    #: Average the gradients in :meth:`step`. False where they arrive averaged (after DDP).
    average_gradients = True

    def __init__(self, params, optimizer_class, process_group=None, **defaults):
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, not {optimizer_class!r}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        group = dist.group.WORLD if process_group is None else process_group
        self.global_ranks = dist.get_process_group_ranks(group)   # broadcast takes global ranks
        super().__init__(params, defaults)       # self.param_groups: every parameter
        self.partition()
        self.optim = optimizer_class(
            [self.local_group(gi) for gi in range(len(self.param_groups))], **defaults)
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in local.items() if k != "params"})  # class defaults
        self.state = self.optim.state            # this rank's shard of the state, only
        self.consolidated = None

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients, update this rank's shard, broadcast each parameter from its
        owner. Returns what the local optimizer's ``step`` returns."""
        if self.average_gradients:
            for p in self.params:
                if p.grad is not None:           # every rank must have the same grads
                    p.grad /= self.world_size    # divide first, then sum: torch's DDP order
                    dist.all_reduce(p.grad, group=self.process_group)
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})  # lr, by a scheduler
        loss = self.optim.step(closure)          # only the owned parameters change here
        for p, r in zip(self.params, self.owner):
            dist.broadcast(p.data, src=self.global_ranks[r], group=self.process_group)
        return loss

    def partition(self):
        """Give every parameter an owner: ``self.owner[i]``, the same on every rank (local)."""
        self.params = [p for g in self.param_groups for p in g["params"]]
        owned = partition_parameters([p.numel() for p in self.params], self.world_size,
                                     [len(g["params"]) for g in self.param_groups])
        self.owner = [0] * len(self.params)
        for r, indices in enumerate(owned):
            for i in indices:
                self.owner[i] = r

    def local_group(self, gi):
        """Param group ``gi`` cut to this rank's parameters (all its hyperparameters kept)."""
        start = sum(len(g["params"]) for g in self.param_groups[:gi])
        group = self.param_groups[gi]
        mine = [p for k, p in enumerate(group["params"]) if self.owner[start + k] == self.rank]
        return {**{k: v for k, v in group.items() if k != "params"}, "params": mine}

    def add_param_group(self, param_group):
        """Add a group on every rank alike; the earlier parameters keep their owners (local)."""
        super().add_param_group(param_group)
        if hasattr(self, "optim"):               # not while Optimizer.__init__ adds the groups
            self.partition()
            self.optim.add_param_group(self.local_group(len(self.param_groups) - 1))

    def consolidate_state_dict(self, to=0):
        """Gather every rank's shard of the state (CPU copies) on rank ``to``: a collective."""
        mine = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}  # any GPU's
                for i, s in super().state_dict()["state"].items()}  # torch's format, my shard
        shards = [None] * self.world_size if self.rank == to else None
        dist.gather_object(mine, shards, dst=self.global_ranks[to], group=self.process_group)
        self.consolidated = shards and dict(sorted(kv for s in shards for kv in s.items()))

    def state_dict(self):
        """The whole state in torch's format, where :meth:`consolidate_state_dict` put it."""
        if self.consolidated is None:
            raise RuntimeError(f"rank {self.rank} has no consolidated state: call "
                               "consolidate_state_dict(to=rank) on every rank first")
        return {**super().state_dict(), "state": self.consolidated}

    def load_state_dict(self, state_dict):
        """Load a whole state dict (every rank the same); each rank keeps its shard (local)."""
        super().load_state_dict(state_dict)      # torch checks the groups; all the state
        mine = {p for g in self.optim.param_groups for p in g["params"]}
        self.optim.state.clear()
        self.optim.state.update({p: s for p, s in self.state.items() if p in mine})
        self.state = self.optim.state


def partition_parameters(numels, world_size, group_sizes=None):
    """Greedy size-balanced split of tensors over ranks (longest-processing-time first).

    Group by group (in order), the group's tensors are taken largest first (ties: lower index)
    and each goes to the rank with the fewest elements so far, counting earlier groups (ties:
    lower rank): torch's ``ZeroRedundancyOptimizer._partition_parameters``. Pure and
    deterministic; adding a group at the end leaves the earlier owners unchanged. The split is
    by whole tensors, so the largest tensor bounds how uneven the shares can be.

    Args:
        numels: element count of each parameter, in parameter order.
        world_size: number of ranks R (>= 1).
        group_sizes: how many consecutive parameters each param group holds (None: one group).

    Returns:
        ``owned[r]``: the sorted indices of the parameters rank ``r`` owns.

    Raises:
        ValueError: ``world_size < 1``, or group sizes that do not add up to ``len(numels)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if group_sizes is None:
        group_sizes = [len(numels)]
    if sum(group_sizes) != len(numels):
        raise ValueError(f"group sizes {group_sizes} add up to {sum(group_sizes)}, "
                         f"not to the {len(numels)} parameters")
    loads = [0] * world_size
    owned = [[] for _ in range(world_size)]
    start = 0
    for size in group_sizes:
        for i in sorted(range(start, start + size), key=lambda i: (-numels[i], i)):
            r = min(range(world_size), key=lambda r: (loads[r], r))
            owned[r].append(i)
            loads[r] += numels[i]
        start += size
    return [sorted(o) for o in owned]
