"""ZeRO stage 1 as a torch drop-in: each rank keeps optimizer state only for its shard.

The algorithm, short enough to print whole, is :mod:`ddp_lesson.core.zero1`
(:class:`~ddp_lesson.core.zero1.Zero1Optimizer` and :func:`partition_parameters`): partition
the parameters over the ranks, build the real optimizer over this rank's shard only, and after
each update broadcast every parameter from its owner. :class:`ShardedOptimizer` is that core
made a drop-in for torch's ``torch.distributed.optim.ZeroRedundancyOptimizer`` (the
``optimizer_class`` + ``**defaults`` signature, the same partition, the same values): the
gradients come averaged from DDP, the groups' hyperparameters stay in step both ways (a
learning-rate scheduler works on :attr:`param_groups`), ``add_param_group`` keeps earlier
owners, and checkpoints go through ``consolidate_state_dict`` / ``state_dict`` /
``load_state_dict`` in torch's format. Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", stage ``P_os``.

Rule for an even split: the partition is by whole tensors, so the per-rank share is close to
``1/R`` only when no single tensor is a large part of the model (the largest tensor bounds the
imbalance).
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from .core.zero1 import Zero1Optimizer, partition_parameters

__all__ = ["partition_parameters", "ShardedOptimizer", "optimizer_state_bytes", "dcp_save",
           "dcp_load"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in ``optimizer.state`` (e.g. Adam's ``exp_avg``, ``exp_avg_sq``,
    ``step``)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


class ShardedOptimizer(Zero1Optimizer):
    """ZeRO-1: a ``torch.optim.Optimizer`` whose state is sharded: each rank holds its part only.

    Built like torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``:
    :attr:`param_groups` are the model's groups, with every parameter of every rank (set
    ``lr`` there; learning-rate schedulers such as ``LambdaLR`` work on it), ``zero_grad``
    clears every gradient, and :meth:`step` copies the groups' hyperparameters into the local
    optimizer, which updates this rank's shard, then broadcasts every parameter from its
    owner. Equal to torch's ``ZeroRedundancyOptimizer`` (same partition, same values).

    Args:
        params: an iterable of tensors or of param-group dicts (as for any torch optimizer).
            Every rank must pass the same parameters in the same order, with the same values.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (None: the default group).
        **defaults: passed to ``optimizer_class`` (``lr=..., weight_decay=...``).

    Attributes:
        param_groups: the global groups (all parameters), as the model's code built them.
        params: all parameters, in order.
        owner: ``owner[i]`` = the rank that updates parameter ``i``.
        optim: the local ``optimizer_class`` over this rank's parameters: one local group per
            global group (empty where this rank owns none of it).
        state: the local optimizer's state (this rank's shard only).

    ``step()`` is a synchronisation point (one broadcast per parameter); so is
    :meth:`consolidate_state_dict`. Construction and :meth:`add_param_group` are local (no
    communication) but must happen on every rank alike: every rank computes the same
    partition on its own.

    Left out, compared with torch's: ``parameters_as_bucket_view``, ``overlap_with_ddp``,
    and ``Join`` support (a rank out of inputs cannot shadow ``step``'s broadcasts).

    Raises:
        ValueError: no parameters.
    """

    #: DDP has averaged the gradients already (torch's ZeroRedundancyOptimizer's contract).
    average_gradients = False

    def __init__(self, params, optimizer_class, process_group=None, **defaults):
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        self._ready = False  # add_param_group from Optimizer.__init__: no local optimizer yet
        super().__init__(groups, optimizer_class, process_group, **defaults)
        self._sync_groups(self.optim.param_groups, self.param_groups)  # the class's defaults
        self._ready = True
        self._consolidated: dict | None = None

    @staticmethod
    def _sync_groups(src: list[dict], dst: list[dict]) -> None:
        """Copy every hyperparameter (all keys but ``params``) from ``src`` to ``dst`` groups."""
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (on every rank, in the same order): partitioned like the others.

        The partition goes group by group, so the earlier parameters keep their owners and
        their optimizer state; the new group's parameters are spread over the ranks.
        """
        super().add_param_group(param_group)
        if self._ready:
            self.partition()
            self.optim.add_param_group(self.local_group(len(self.param_groups) - 1))
            self._sync_groups(self.optim.param_groups[-1:], self.param_groups[-1:])

    # ------------------------------------------------------------------ training
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of *all* parameters (every rank computes all of them)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self, closure=None):
        """Update this rank's shard, then broadcast every parameter from its owner
        (:meth:`Zero1Optimizer.step` without the gradient average, which DDP did).

        The global groups' hyperparameters (``lr`` set by hand or by a scheduler) are copied
        into the local optimizer first, and back afterwards. A synchronisation point (one
        broadcast per parameter tensor, in parameter order). Returns what the local
        optimizer's ``step`` returns.
        """
        loss = super().step(closure)
        self._sync_groups(self.optim.param_groups, self.param_groups)
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (:func:`optimizer_state_bytes`)."""
        return optimizer_state_bytes(self.optim)

    # ------------------------------------------------------------------ checkpoints
    def _local_state(self) -> dict:
        by_id = {id(p): i for i, p in enumerate(self.params)}
        state = {by_id[id(p)]: s for p, s in self.optim.state.items()}
        return {"state": state}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on rank ``to`` (a synchronisation
        point).

        Afterwards :meth:`state_dict` works on rank ``to``. Every rank must call it.
        """
        local = self._local_state()
        # copies, so later steps do not change a consolidated dict (``.cpu()`` alone aliases)
        local["state"] = {k: {n: (t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t)
                              for n, t in v.items()}
                          for k, v in local["state"].items()}
        gathered = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=self.global_ranks[to], group=self.process_group)
        if self.rank != to:
            self._consolidated = None
            return
        state = {}
        for part in gathered:
            state.update(part["state"])
        param_groups, start = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            param_groups.append(d)
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def state_dict(self) -> dict:
        """The full optimizer state in torch's format, keys = global parameter indices.

        Only on the rank that called :meth:`consolidate_state_dict` last (torch's rule).

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called on this rank.
        """
        if self._consolidated is None:
            raise RuntimeError(f"rank {self.rank} has no consolidated state: call "
                               "consolidate_state_dict(to=rank) on every rank first")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (every rank passes the full dict; each keeps its shard).

        The groups' hyperparameters go to :attr:`param_groups` and the local optimizer. Not a
        synchronisation point.

        Raises:
            ValueError: the parameter or group count differs.
        """
        n = sum(len(g["params"]) for g in state_dict["param_groups"])
        if n != len(self.params):
            raise ValueError(f"state dict has {n} parameters, this optimizer {len(self.params)}")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state dict has {len(state_dict['param_groups'])} param groups, "
                             f"this optimizer {len(self.param_groups)}")
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        by_id = {id(p): i for i, p in enumerate(self.params)}
        local = {"state": {}, "param_groups": []}
        pos = 0
        for g_local, g in zip(self.optim.param_groups, self.param_groups):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(pos, pos + len(g_local["params"])))
            for k, p in enumerate(g_local["params"]):
                gi = by_id[id(p)]
                saved = state_dict["state"].get(gi, state_dict["state"].get(str(gi)))
                if saved is not None:
                    local["state"][pos + k] = saved
            pos += len(g_local["params"])
            local["param_groups"].append(d)
        self.optim.load_state_dict(local)
        self.state = self.optim.state


# ---------------------------------------------------------------- torch.distributed.checkpoint
# Each rank writes only the state it owns, under keys that name the parameter by its global
# index and never the rank or R ("optim.state.<i>.<name>"): a checkpoint written at R ranks
# loads at any R', each new owner reading the entries of the parameters it owns now.

def _sharded_entries(optimizer: ShardedOptimizer) -> dict:
    """This rank's shard as flat entries (no communication)."""
    entries = {}
    for i, state in optimizer._local_state()["state"].items():
        for name, value in state.items():
            entries[f"optim.state.{i}.{name}"] = value
    # one string (DCP would flatten a list of dicts into one entry per hyperparameter)
    entries["optim.param_groups"] = json.dumps(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return entries


def dcp_save(path, model: torch.nn.Module, optimizer: ShardedOptimizer) -> None:
    """Save ``model`` (replicated: written once) and this rank's optimizer shard to the
    directory ``path`` with ``torch.distributed.checkpoint.save``.

    A collective: every rank of the optimizer's group calls it (DCP plans the write together
    and rank 0 writes the metadata). Pass the bare model, not its DDP wrapper (keys without
    ``module.``). Each rank writes only the parameters' state it owns.
    """
    import torch.distributed.checkpoint as dcp

    entries = {f"model.{k}": v for k, v in model.state_dict().items()}
    entries.update(_sharded_entries(optimizer))
    dcp.save(entries, checkpoint_id=str(path), process_group=optimizer.process_group)


def dcp_load(path, model: torch.nn.Module, optimizer: ShardedOptimizer) -> None:
    """Load a :func:`dcp_save` checkpoint, written at any world size, into ``model`` (every
    rank, in place) and into ``optimizer``'s current shard (each rank reads the state of the
    parameters it owns under *this* world size's partition).

    A collective: every rank calls it. Raises ``ValueError`` naming the counts when the
    checkpoint's model keys or parameter count differ from ``model``'s and ``optimizer``'s.
    """
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entries = {f"model.{k}": v for k, v in model.state_dict().items()}
    saved_model = sorted(k for k in meta if k.startswith("model."))
    if saved_model != sorted(entries):
        missing = sorted(set(entries) - set(saved_model))
        extra = sorted(set(saved_model) - set(entries))
        raise ValueError(f"checkpoint {path} holds {len(saved_model)} model entries, the model "
                         f"{len(entries)}: missing {missing[:3]}, unexpected {extra[:3]}")
    indices = {int(k.split(".")[2]) for k in meta if k.startswith("optim.state.")}
    if indices and max(indices) >= len(optimizer.params):
        raise ValueError(f"checkpoint {path} has optimizer state for parameter {max(indices)}, "
                         f"the optimizer has {len(optimizer.params)} parameters")
    for key, m in meta.items():
        if key.startswith("optim.state.") and \
                optimizer.owner[int(key.split(".")[2])] == optimizer.rank:
            entries[key] = torch.empty(m.size, dtype=m.properties.dtype)
    entries["optim.param_groups"] = ""
    dcp.load(entries, checkpoint_id=str(path), process_group=optimizer.process_group)
    saved_groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}
                    for g in json.loads(entries["optim.param_groups"])]  # betas: a tuple
    state: dict = {}
    for key, value in entries.items():
        if key.startswith("optim.state."):
            _, _, i, name = key.split(".", 3)
            state.setdefault(int(i), {})[name] = value
    groups, start = [], 0
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {path} has {len(saved_groups)} param groups, the "
                         f"optimizer {len(optimizer.param_groups)}")
    for g, saved in zip(optimizer.param_groups, saved_groups):
        groups.append({**saved, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
