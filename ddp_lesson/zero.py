"""ZeRO stage 1 from scratch: each rank keeps optimizer state only for its shard of the parameters.

Under DDP every rank holds the full optimizer state (for Adam, two fp32 tensors per
parameter: ``exp_avg`` and ``exp_avg_sq``), although every rank computes exactly the same
update from the same averaged gradients. ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", ``P_os``) removes that
redundancy:

1. the parameters are partitioned across the ``R`` ranks (:func:`partition_parameters`:
   whole tensors, largest first, each to the least-loaded rank — deterministic, the same on
   every rank);
2. each rank builds the real optimizer (e.g. ``torch.optim.AdamW``) over *its* parameters
   only, so it holds ~``1/R`` of the optimizer state;
3. ``step()``: each rank updates its own parameters (the gradients are already averaged by
   DDP), then every parameter is broadcast from the rank that owns it, so every rank again
   holds the full, updated parameters.

The result equals unsharded training bit for bit up to floating-point summation order (the
element-wise Adam update does not depend on which rank computes it). torch's own version is
``torch.distributed.optim.ZeroRedundancyOptimizer`` (which this mirrors, with the
``optimizer_class`` + ``**defaults`` signature). Rule for an even split: the partition is by
whole tensors, so the per-rank share is close to ``1/R`` only when no single tensor is a large
part of the model (the largest tensor bounds the imbalance).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["partition_parameters", "ShardedOptimizer", "optimizer_state_bytes"]


def partition_parameters(numels: list[int], world_size: int) -> list[list[int]]:
    """Greedy size-balanced split of tensors across ranks (longest-processing-time first).

    Tensors are taken largest first (ties: lower index first) and each goes to the rank with
    the fewest elements so far (ties: lower rank). Pure and deterministic.

    Args:
        numels: element count of each parameter, in parameter order.
        world_size: number of ranks R (>= 1).

    Returns:
        ``owned[r]`` = sorted indices of the parameters rank ``r`` owns.

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += numels[i]
    return [sorted(o) for o in owned]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in ``optimizer.state`` (e.g. Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


class ShardedOptimizer:
    """ZeRO-1: wrap ``optimizer_class`` so each rank holds the state of its parameter shard only.

    Args:
        params: an iterable of tensors or of param-group dicts (as for any torch optimizer).
            Every rank must pass the same parameters in the same order, with the same values.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (None: the default group).
        **defaults: passed to ``optimizer_class`` (``lr=..., weight_decay=...``).

    Attributes:
        params: all parameters, in order.
        owner: ``owner[i]`` = the rank that updates parameter ``i``.
        optim: the local ``optimizer_class`` over this rank's parameters.

    Use it like an optimizer: ``loss.backward()`` (gradients averaged by DDP), then
    ``step()``, then ``zero_grad()``. ``step()`` is a synchronisation point (one broadcast
    per parameter); so is :meth:`consolidate_state_dict`. Construction is local (no
    communication): every rank computes the same partition on its own.

    Raises:
        ValueError: no parameters, or a rank would own none (more ranks than tensors).
    """

    def __init__(self, params, optimizer_class, process_group=None, **defaults):
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.params: list[torch.Tensor] = []
        self._group_of: list[int] = []
        for gi, g in enumerate(groups):
            ps = list(g["params"])
            self.params += ps
            self._group_of += [gi] * len(ps)
        owned = partition_parameters([p.numel() for p in self.params], self.world_size)
        empty = [r for r, o in enumerate(owned) if not o]
        if empty:
            raise ValueError(f"{len(self.params)} parameter tensors cannot be shared by "
                             f"{self.world_size} ranks: ranks {empty} would own none")
        self.owner = [0] * len(self.params)
        for r, idx in enumerate(owned):
            for i in idx:
                self.owner[i] = r
        self.local_indices = owned[self.rank]
        local_groups = []
        self._local_group_global_index: list[int] = []
        for gi, g in enumerate(groups):
            mine = [self.params[i] for i in self.local_indices if self._group_of[i] == gi]
            if mine:
                local_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                     "params": mine})
                self._local_group_global_index.append(gi)
        self._num_groups = len(groups)
        self.optim = optimizer_class(local_groups, **defaults)
        self._global_ranks = (list(range(self.world_size)) if process_group is None
                              else dist.get_process_group_ranks(process_group))
        self._consolidated: dict | None = None

    # ------------------------------------------------------------------ training
    @property
    def param_groups(self):
        """The local optimizer's param groups (this rank's parameters; set ``lr`` here)."""
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of *all* parameters (every rank computes all of them)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then broadcast every parameter from its owner.

        A synchronisation point (one broadcast per parameter tensor, in parameter order).
        Returns what the local optimizer's ``step`` returns.
        """
        loss = self.optim.step(closure)
        for p, r in zip(self.params, self.owner):
            dist.broadcast(p.data, src=self._global_ranks[r], group=self.process_group)
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (:func:`optimizer_state_bytes`)."""
        return optimizer_state_bytes(self.optim)

    # ------------------------------------------------------------------ checkpoints
    def _local_state(self) -> dict:
        sd = self.optim.state_dict()
        # local position -> global parameter index
        local_params = [p for g in self.optim.param_groups for p in g["params"]]
        pos_to_global = {}
        by_id = {id(p): i for i, p in enumerate(self.params)}
        for pos, p in enumerate(local_params):
            pos_to_global[pos] = by_id[id(p)]
        state = {pos_to_global[k]: v for k, v in sd["state"].items()}
        groups = {}
        for gi, g in zip(self._local_group_global_index, sd["param_groups"]):
            groups[gi] = {k: v for k, v in g.items() if k != "params"}
        return {"state": state, "groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on rank ``to`` (a synchronisation point).

        Afterwards :meth:`state_dict` works on rank ``to``. Every rank must call it.
        """
        local = self._local_state()
        # copies, so later steps do not change a consolidated dict (``.cpu()`` alone aliases)
        local["state"] = {k: {n: (t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t)
                              for n, t in v.items()}
                          for k, v in local["state"].items()}
        gathered = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=self._global_ranks[to], group=self.process_group)
        if self.rank != to:
            self._consolidated = None
            return
        state, groups = {}, {}
        for part in gathered:
            state.update(part["state"])
            groups.update(part["groups"])
        param_groups = []
        for gi in range(self._num_groups):
            g = dict(groups.get(gi, {}))
            g["params"] = [i for i in range(len(self.params)) if self._group_of[i] == gi]
            param_groups.append(g)
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def state_dict(self) -> dict:
        """The full optimizer state in torch's format, keys = global parameter indices.

        Only on the rank that called :meth:`consolidate_state_dict` last.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called on this rank.
        """
        if self._consolidated is None:
            raise RuntimeError(f"rank {self.rank} has no consolidated state: call "
                               "consolidate_state_dict(to=rank) on every rank first")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (every rank passes the full dict; each keeps its shard).

        Not a synchronisation point. Raises ValueError when the parameter count differs.
        """
        n = sum(len(g["params"]) for g in state_dict["param_groups"])
        if n != len(self.params):
            raise ValueError(f"state dict has {n} parameters, this optimizer {len(self.params)}")
        local_params = [p for g in self.optim.param_groups for p in g["params"]]
        by_id = {id(p): i for i, p in enumerate(self.params)}
        local = {"state": {}, "param_groups": []}
        for pos, p in enumerate(local_params):
            gi = by_id[id(p)]
            if gi in state_dict["state"]:
                local["state"][pos] = state_dict["state"][gi]
        pos = 0
        for g_local, gi in zip(self.optim.param_groups, self._local_group_global_index):
            g = {k: v for k, v in state_dict["param_groups"][gi].items() if k != "params"}
            g["params"] = list(range(pos, pos + len(g_local["params"])))
            pos += len(g_local["params"])
            local["param_groups"].append(g)
        self.optim.load_state_dict(local)
