"""ZeRO-1 checkpoints with ``torch.distributed.checkpoint`` (DCP), for
:class:`ddp_lesson.core.zero1.Zero1Optimizer` (the one ZeRO-1 implementation; notebook 08).

Each rank writes only the state it owns, under keys that name the parameter by its global
index and never the rank or R (``optim.state.<i>.<name>``): a checkpoint written at R ranks
loads at any R', each new owner reading the entries of the parameters it owns now.
"""
from __future__ import annotations

import json

import torch

from .core.zero1 import Zero1Optimizer

__all__ = ["dcp_save", "dcp_load"]


def _sharded_entries(optimizer: Zero1Optimizer) -> dict:
    """This rank's shard as flat entries (no communication)."""
    entries = {}
    for i, state in torch.optim.Optimizer.state_dict(optimizer)["state"].items():  # my shard
        for name, value in state.items():
            entries[f"optim.state.{i}.{name}"] = value
    # one string (DCP would flatten a list of dicts into one entry per hyperparameter)
    entries["optim.param_groups"] = json.dumps(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    return entries


def dcp_save(path, model: torch.nn.Module, optimizer: Zero1Optimizer) -> None:
    """Save ``model`` (replicated: written once) and this rank's optimizer shard to the folder
    ``path`` with ``torch.distributed.checkpoint.save``. A collective: every rank of the
    optimizer's group calls it (DCP plans together, rank 0 writes the metadata). Pass the bare
    model, not its DDP wrapper (keys without ``module.``).
    """
    import torch.distributed.checkpoint as dcp

    entries = {f"model.{k}": v for k, v in model.state_dict().items()}
    entries.update(_sharded_entries(optimizer))
    dcp.save(entries, checkpoint_id=str(path), process_group=optimizer.process_group)


def dcp_load(path, model: torch.nn.Module, optimizer: Zero1Optimizer) -> None:
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
