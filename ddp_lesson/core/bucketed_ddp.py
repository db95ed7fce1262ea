"""BucketedDDP: gradients averaged in buckets, while backward is still running.

``ddp_lesson.core.naive_ddp`` sends one message per parameter, and only after backward. Two
ideas from torch's DDP fix both costs:

* **Buckets.** Parameters are grouped into buckets of about ``bucket_cap_mb``; a bucket's
  gradients are copied into one flat tensor and all-reduced as one message, so the network's
  per-message latency is paid once per bucket, not once per parameter.
* **Overlap.** Backward produces gradients from the last layer to the first, so the buckets
  are launched from the last layer's to the first's: the first bucket is complete early in
  backward. The gradient hook that completes a bucket launches its all-reduce at once,
  asynchronously (``async_op=True``), and backward goes on computing the earlier layers while
  it travels. The callback queued for the end of backward only waits for what is still in
  flight and copies the averages back into ``.grad``, before ``backward()`` returns.

The buckets are those torch's DDP uses from its second iteration on: the parameters walked in
the order backward makes their gradients ready (the last layer's first), each bucket closed
once it holds its limit, so the first bucket (launched first) is complete early. Without
``bucket_cap_mb`` torch caps that first bucket at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB)
and the others at 25 MiB; an explicit cap holds for every bucket. torch itself starts
differently (``_ddp_init_helper``, ``Reducer::should_rebuild_buckets``): its first iteration
sends one bucket, and it rebuilds the buckets once, in the ready order it recorded, before the
second forward (the third with ``static_graph``); with ``find_unused_parameters=True`` it
never rebuilds and keeps buckets filled in registration order, launched reversed. The series
builds the steady-state buckets at once, assuming the gradients become ready in reverse
registration order. On the series' DeepLab torch's buckets hold the same parameters, but its
Reducer records a convolution's or BatchNorm's weight before its bias, so the order inside a
bucket differs; a model whose forward uses its modules in another order gets other buckets.

Buckets are launched strictly in bucket order on every rank: collectives are matched by the
order in which the ranks issue them, so if rank 0 issued bucket 3 while rank 1 issued bucket 2,
the two would be summed together. Each bucket is averaged as in the naive core: divided by the
world size, then SUM-all-reduced (:func:`ddp_lesson.core.naive_ddp.all_reduce_mean_`), on the
flat copy, so ``.grad`` is untouched until the average arrives.

``no_sync()``: the backward of a forward run inside it launches nothing; ``.grad`` just
accumulates, and the next synchronised backward averages the accumulated gradients. Every
backward after a synchronised forward averages (several backwards of retained graphs too):
the buckets are reset at the end of each.

The drop-in replacement for torch's DDP that the trainer uses is ``ddp_lesson.ddp.BucketedDDP``:
this class plus torch's signature, the checks that name ranks and parameters, unused
parameters, ``Join``, buffer broadcasts, comm hooks and a recorder.

Sources: S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020 (arXiv:2006.15704), section 3.2.3 (bucketing, overlap, ``no_sync``);
torch 2.13's ``torch/nn/parallel/distributed.py`` (``_BucketCapacityConfig``,
``_ddp_init_helper``, ``_pre_forward``) and ``torch.distributed._compute_bucket_assignment_by_size``
(the rule).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .naive_ddp import all_reduce_mean_

__all__ = ["MB", "DEFAULT_CAP_MB", "bucket_size_limits", "assign_buckets", "ddp_buckets",
           "BucketedDDP"]

#: Bytes in one "MB" of ``bucket_cap_mb`` (torch counts 1024 * 1024).
MB = 1024 * 1024
#: torch's cap without ``bucket_cap_mb`` (``_DEFAULT_BUCKET_CAP_MB`` in ``distributed.py``).
DEFAULT_CAP_MB = 25


def bucket_size_limits(bucket_cap_mb: float | None = None) -> list[int]:
    """torch's bucket size limits in bytes, as ``_BucketCapacityConfig`` computes them.

    None (torch's default): ``[dist._DEFAULT_FIRST_BUCKET_BYTES, 25 MiB]``, read now (1 MiB
    unless changed): the first bucket closes early. An explicit cap: ``[cap]`` for every
    bucket. Raises ValueError for a negative or non-finite cap.
    """
    if bucket_cap_mb is not None and not 0 <= bucket_cap_mb < float("inf"):
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


class BucketedDDP(nn.Module):
    """Wrap ``module`` so that backward all-reduces buckets of gradients as they fill up.

    Args:
        module: the model, already on this rank's device.
        bucket_cap_mb: bucket size in MiB (1024**2 bytes), as in torch; None (default):
            torch's default, 1 MiB for the first bucket and 25 MiB for the others.
        process_group: the group to average over (None: the default group).

    Attributes:
        bucket_indices: the buckets, in launch order, as lists of indices into the trainable
            parameters (registration order): :func:`ddp_buckets`.

    As in the naive core: rank 0's parameters and buffers are broadcast at construction, and
    a parameter that got no gradient on this rank contributes zeros (its bucket then waits for
    the end of backward).

    Synchronisation: construction and every synchronised backward are collectives.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        #: False inside ``no_sync()``; read by ``forward``, as in torch's DDP.
        self.require_backward_grad_sync = True
        self._sync_this_backward = False
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._broadcast_state()
        self.bucket_indices = ddp_buckets(
            [p.numel() * p.element_size() for p in self._params], bucket_cap_mb,
            [(p.dtype, p.device) for p in self._params])
        self._bucket_of = {i: b for b, bucket in enumerate(self.bucket_indices) for i in bucket}
        self._reset_buckets()
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad_ready(i))

    def forward(self, *inputs, **kwargs):
        # forward decides, as in torch: the backwards after a forward inside no_sync() only
        # accumulate into .grad, and the next synchronised backward averages the sum. A forward
        # under no_grad decides nothing (it builds no graph).
        if torch.is_grad_enabled():
            self._sync_this_backward = self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    def _on_grad_ready(self, index: int) -> None:
        """The hook of parameter ``index``: its ``.grad`` is final for this backward."""
        if not self._sync_this_backward:
            return  # inside no_sync(): nothing travels
        if not self._callback_queued:
            # The wait belongs at the end of backward, not in a hook: waiting here would stall
            # backward until the bucket arrived and undo the overlap.
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        self._grad_ready(index)

    def _grad_ready(self, index: int) -> None:
        """One more gradient of its bucket is final; launch every bucket now complete."""
        self._pending[self._bucket_of[index]] -= 1
        self._launch_in_order()

    def _launch_in_order(self, everything: bool = False) -> None:
        """Launch complete buckets (all of them with ``everything``), strictly in bucket order.

        Every rank must issue its all-reduces in the same order, so a bucket that is complete
        early waits for the ones before it.
        """
        while self._next_bucket < len(self.bucket_indices) and (
                everything or self._pending[self._next_bucket] == 0):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into one flat tensor and start averaging it (async)."""
        params = [self._params[i] for i in self.bucket_indices[b]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])  # a copy: .grad stays as it is until the average
        self._flat[b] = flat
        # async_op=True: the hook returns at once and backward goes on computing earlier
        # layers while this bucket travels (divided by R first, then SUM, as torch).
        self._work[b] = all_reduce_mean_(flat, self.process_group, async_op=True)

    def _after_backward(self) -> None:
        """Autograd has finished: wait for every bucket, copy the averages back into .grad."""
        self._launch_in_order(everything=True)  # buckets holding a gradient that never came
        for b, indices in enumerate(self.bucket_indices):
            self._work[b].wait()
            self._unflatten(b, indices)
        self._reset_buckets()

    def _unflatten(self, b: int, indices: list[int]) -> None:
        """Write bucket ``b``'s averaged flat tensor back into its parameters' ``.grad``."""
        offset = 0
        for i in indices:
            p = self._params[i]
            average = self._flat[b][offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
            offset += p.numel()

    def _reset_buckets(self) -> None:
        """Ready for the next backward: every bucket waits for all its gradients again."""
        self._pending = [len(bucket) for bucket in self.bucket_indices]
        self._flat: list[torch.Tensor | None] = [None] * len(self.bucket_indices)
        self._work: list = [None] * len(self.bucket_indices)
        self._next_bucket = 0  # the next bucket to launch: they go strictly in order
        self._callback_queued = False

    def _broadcast_state(self) -> None:
        """Give every rank rank 0's parameters and buffers (a collective)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.detach(), src=src, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: the backward of a forward run inside launches nothing."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
