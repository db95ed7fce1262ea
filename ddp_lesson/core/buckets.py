"""torch's bucket rule: which gradients share a message, in the order backward launches them.

:class:`ddp_lesson.core.bucketed_ddp.BucketedDDP` groups its parameters with
:func:`ddp_buckets`. The buckets are those torch's DDP uses from its second iteration on: the
parameters walked in the order backward makes their gradients ready (the last layer's first),
each bucket closed once it holds its limit, so the first bucket (launched first) is complete
early in backward. Without ``bucket_cap_mb`` torch caps that first bucket at
``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) and the others at 25 MiB; an explicit cap holds for
every bucket.

torch itself starts differently (``_ddp_init_helper``, ``Reducer::should_rebuild_buckets``):
its first iteration sends one bucket, and it rebuilds the buckets once, in the ready order it
recorded, before the second forward (the third with ``static_graph``); with
``find_unused_parameters=True`` it never rebuilds and keeps buckets filled in registration
order, launched reversed. The series builds the steady-state buckets at once, assuming the
gradients become ready in reverse registration order. On the series' DeepLab torch's buckets
hold the same parameters, but its Reducer records a convolution's or BatchNorm's weight before
its bias, so the order inside a bucket differs; a model whose forward uses its modules in
another order gets other buckets.

Sources: torch 2.13's ``torch/nn/parallel/distributed.py`` (``_BucketCapacityConfig``,
``_ddp_init_helper``, ``_pre_forward``) and
``torch.distributed._compute_bucket_assignment_by_size`` (the rule).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["MB", "DEFAULT_CAP_MB", "bucket_size_limits", "assign_buckets", "ddp_buckets"]

#: Bytes in one "MB" of ``bucket_cap_mb`` (torch counts 1024 * 1024).
MB = 1024 * 1024
#: torch's cap without ``bucket_cap_mb`` (``_DEFAULT_BUCKET_CAP_MB`` in ``distributed.py``).
DEFAULT_CAP_MB = 25


def bucket_size_limits(bucket_cap_mb: float | None = None) -> list[int]:
    """torch's bucket size limits in bytes, as ``_BucketCapacityConfig`` computes them.

    None (torch's default): ``[dist._DEFAULT_FIRST_BUCKET_BYTES, 25 MiB]``, read now (1 MiB
    unless changed): the first bucket closes early. An explicit cap: ``[cap]`` for every
    bucket. Raises ValueError for a negative or non-finite cap (in bytes: 1e308 MiB is too).
    """
    if bucket_cap_mb is not None and not 0 <= bucket_cap_mb * MB < float("inf"):
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0, got {bucket_cap_mb}")
    cap = int((DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MB)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return [first, cap] if first < cap else [cap]


def assign_buckets(nbytes: Sequence[int], limits: int | Sequence[int],
                   keys: Sequence | None = None,
                   order: Sequence[int] | None = None) -> list[list[int]]:
    """Group parameters into buckets: ``torch.distributed._compute_bucket_assignment_by_size``.

    Walks the parameters in ``order`` and appends each to the open bucket of its ``key`` (one
    bucket is one flat tensor: one dtype on one device). A bucket closes as soon as it holds
    **at least** its limit: the n-th bucket of a key gets ``limits[n]``, later ones the last
    limit; it can pass the limit by its last parameter, and a parameter larger than the limit
    gets a bucket of its own. Pure function, no process group.

    Args:
        nbytes: bytes of each parameter's gradient, in registration order.
        limits: bytes, ``>= 0``: one cap, or a list such as :func:`bucket_size_limits`.
        keys: one hashable per parameter, e.g. ``(dtype, device)``; None: all the same.
        order: the order to walk, e.g. the order gradients became ready (torch's rebuild);
            None: registration order, and the buckets are sorted by their smallest index.

    Returns:
        Buckets in fill order, each a list of parameter indices in walking order. Walked in
        ready order they are also launched in fill order: :func:`ddp_buckets`.

    Raises:
        ValueError: a negative limit or size, ``keys`` of the wrong length, or an ``order``
            that is not a permutation of the indices.

    >>> assign_buckets([16, 16, 16, 16, 16], 32)
    [[0, 1], [2, 3], [4]]
    """
    limits = [int(limits)] if isinstance(limits, (int, float)) else [int(x) for x in limits]
    if not limits or min(limits) < 0:
        raise ValueError(f"bucket size limits must be >= 0 bytes, got {limits}")
    keys = [None] * len(nbytes) if keys is None else keys
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys for {len(nbytes)} parameters")
    walk = range(len(nbytes)) if order is None else order
    if sorted(walk) != list(range(len(nbytes))):
        raise ValueError(f"order must list each of the {len(nbytes)} indices once")
    open_buckets: dict = {}  # key -> (indices, bytes so far, buckets of that key closed)
    closed: list[list[int]] = []
    for i in walk:
        if nbytes[i] < 0:
            raise ValueError(f"parameter {i} has a negative size {nbytes[i]}")
        indices, size, n = open_buckets.get(keys[i], ([], 0, 0))
        indices.append(i)
        size += nbytes[i]
        if size >= limits[min(n, len(limits) - 1)]:
            closed.append(indices)
            indices, size, n = [], 0, n + 1
        open_buckets[keys[i]] = (indices, size, n)
    closed.extend(indices for indices, _, _ in open_buckets.values() if indices)
    if order is None:
        closed.sort(key=min)  # torch sorts by the smallest index when no order is given
    return closed


def ddp_buckets(nbytes: Sequence[int], bucket_cap_mb: float | None = None,
                keys: Sequence | None = None) -> list[list[int]]:
    """torch's buckets after its rebuild, in launch order, for gradients ready last layer first.

    :func:`assign_buckets` with :func:`bucket_size_limits`, walking the parameters in reverse
    registration order, as torch's rebuild walks the ready order it recorded
    (``_compute_bucket_assignment_by_size`` in ``Reducer::rebuild_buckets``).

    >>> ddp_buckets([16, 16, 16, 16, 16], 32 / MB)
    [[4, 3], [2, 1], [0]]
    """
    ready = range(len(nbytes) - 1, -1, -1)
    return assign_buckets(nbytes, bucket_size_limits(bucket_cap_mb), keys, order=ready)
