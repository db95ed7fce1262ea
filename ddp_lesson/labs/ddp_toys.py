"""Tiny models and data for the DDP lessons, each toy isolating one thing a gradient-averaging
wrapper must get right: a frozen layer, a tied weight, an unused branch, BatchNorm's buffers,
a layer used on some calls only (docs/pitfalls.md B1).

Data: :func:`toy_batch`, the same global batch on every rank for a step; :func:`shard`, one
rank's contiguous rows. Deterministic under a seed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FrozenToy", "TiedToy", "UnusedToy", "BatchNormToy", "TwoLayer", "TOYS",
           "IN_FEATURES", "NUM_CLASSES", "toy_batch", "shard"]

IN_FEATURES = 4
NUM_CLASSES = 3


class FrozenToy(nn.Module):
    """``Linear(4, 8) -> ReLU -> frozen Linear(8, 8) -> ReLU -> Linear(8, 3)``;
    ``(B, 4) -> (B, 3)``. The frozen layer gets no gradient: never all-reduced nor waited for.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.frozen(F.relu(self.inp(x)))))


class TiedToy(nn.Module):
    """``inp -> mid1 -> mid2 -> head``, ``mid2.weight`` *is* ``mid1.weight``; ``(B, 4) -> (B, 3)``.

    As tied embeddings: autograd sums both uses into one ``.grad``, to reduce *once*;
    ``named_parameters()`` lists it once, as ``mid1.weight``.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 8)
        self.mid1 = nn.Linear(8, 8)
        self.mid2 = nn.Linear(8, 8)
        self.mid2.weight = self.mid1.weight  # tied: one Parameter, two uses
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.mid2(torch.tanh(self.mid1(F.relu(self.inp(x)))))))


class UnusedToy(nn.Module):
    """``trunk -> head``, plus a branch ``aux`` that forward never calls; ``(B, 4) -> (B, 3)``.
    It needs ``find_unused_parameters=True`` (or an error that names it).
    """

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, 8)
        self.aux = nn.Linear(8, 8)  # registered between trunk and head, never used
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.trunk(x)))


class BatchNormToy(nn.Module):
    """``Linear(4, 8) -> BatchNorm1d(8) -> ReLU -> Linear(8, 3)``; ``(B, 4) -> (B, 3)``, B >= 2.
    The running statistics are *buffers*: broadcast from rank 0, never averaged.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.inp(x))))


class TwoLayer(nn.Module):
    """Layers ``a`` (always used) and ``b`` (used only when ``use_b``): ``(B, 4) -> (B, 4)``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN_FEATURES, IN_FEATURES)
        self.b = nn.Linear(IN_FEATURES, IN_FEATURES)

    def forward(self, x, use_b: bool = False):
        y = self.a(x)
        return y + self.b(x) if use_b else y


#: name -> (class, needs find_unused_parameters=True)
TOYS: dict[str, tuple[type[nn.Module], bool]] = {
    "frozen": (FrozenToy, False),
    "tied": (TiedToy, False),
    "unused": (UnusedToy, True),
    "batchnorm": (BatchNormToy, False),
}


def toy_batch(step: int, global_batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``x`` ``(global_batch, 4)``, class ids ``y``
    ``(global_batch,)``; the same on every rank (a generator seeded ``seed * 1000 + step``).
    """
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(global_batch, IN_FEATURES, generator=g)
    y = torch.randint(0, NUM_CLASSES, (global_batch,), generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the first dimension (its length must divide evenly).

    Raises:
        ValueError: the length is not a multiple of ``world_size``, or the rank is out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size - 1}]")
    if t.shape[0] % world_size:
        raise ValueError(f"{t.shape[0]} rows do not split evenly over {world_size} ranks")
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]
