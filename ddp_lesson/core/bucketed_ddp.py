"""BucketedDDP: gradients averaged in buckets, while backward is still running.

``ddp_lesson.core.naive_ddp`` sends one message per parameter, and only after backward. Two
ideas from torch's DDP fix both costs:

* **Buckets.** Parameters are grouped into buckets of about ``bucket_cap_mb``; a bucket's
  gradients are copied into one flat tensor and all-reduced as one message, so the
  per-message latency is paid once per bucket. The buckets follow torch's rule
  (:func:`ddp_lesson.core.buckets.ddp_buckets`): filled from the last layer, whose gradients
  backward makes first.
* **Overlap.** The hook that completes a bucket launches its all-reduce at once,
  asynchronously, and backward goes on computing earlier layers while it travels. The callback
  at the end of backward only waits for what is in flight and copies the averages into
  ``.grad``.

Buckets are launched strictly in bucket order on every rank: collectives are matched by the
order the ranks issue them, so if rank 0 issued bucket 3 while rank 1 issued bucket 2 the two
would be summed together.

Sources: S. Li et al., "PyTorch Distributed", VLDB 2020 (arXiv:2006.15704), section 3.2.3;
torch 2.13's ``torch/nn/parallel/distributed.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from .buckets import MB, assign_buckets, bucket_size_limits, ddp_buckets
from .naive_ddp import NaiveDDP

__all__ = ["MB", "assign_buckets", "bucket_size_limits", "ddp_buckets", "BucketedDDP"]


class BucketedDDP(NaiveDDP):
    """Wrap ``module`` so that backward all-reduces buckets of gradients as they fill up.

    Args: as :class:`NaiveDDP`, and ``bucket_cap_mb``, the bucket size in MiB as torch (None:
    1 MiB for the first bucket, 25 for the others); ``overlap=False`` holds every bucket until
    backward ends (to measure what overlap buys). ``bucket_indices``: the buckets in launch
    order, as indices into the trainable parameters. Raises as :class:`NaiveDDP`, and
    ValueError for a negative or infinite ``bucket_cap_mb``.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 process_group=None, comm_hook=None, recorder=None, overlap: bool = True):
        bucket_size_limits(bucket_cap_mb)  # a bad cap fails before any collective
        super().__init__(module, process_group, comm_hook, recorder)
        self.overlap = overlap
        self.bucket_indices = ddp_buckets(
            [p.numel() * p.element_size() for p in self._params], bucket_cap_mb,
            [(p.dtype, p.device) for p in self._params])  # one flat tensor: one dtype, device
        self._bucket_of = {i: b for b, bucket in enumerate(self.bucket_indices) for i in bucket}
        self._reset_buckets()

    def _on_grad_ready(self, index: int) -> None:
        super()._on_grad_ready(index)  # the first queues the end-of-backward callback
        if self._sync_this_backward:
            self._grad_ready(index)

    def _grad_ready(self, index: int) -> None:
        """One more gradient of its bucket is final; launch every bucket now complete."""
        self._pending[self._bucket_of[index]] -= 1
        if self.overlap:
            self._launch_in_order()

    def _launch_in_order(self, everything: bool = False) -> None:
        """Launch complete buckets (all with ``everything``), strictly in bucket order."""
        while self._next_bucket < len(self.bucket_indices) and (
                everything or self._pending[self._next_bucket] == 0):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into one flat tensor and start averaging it (async)."""
        params = [self._params[i] for i in self.bucket_indices[b]]
        self._flat[b] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                   .reshape(-1) for p in params])  # a copy: .grad waits
        self._work[b] = self._send(self._flat[b], b, self.bucket_indices[b])

    def _after_backward(self) -> None:
        """Autograd has finished: wait for every bucket, copy the averages back into .grad."""
        if self.recorder is not None:
            self.recorder.backward_end()
        self._launch_in_order(everything=True)  # buckets holding a gradient that never came
        for b, indices in enumerate(self.bucket_indices):
            self._wait(self._work[b])
            offset = 0
            for i in indices:
                p = self._params[i]
                average = self._flat[b][offset:offset + p.numel()].view_as(p)
                p.grad = average.clone() if p.grad is None else p.grad.copy_(average)
                offset += p.numel()
        self._reset_buckets()
        if self.recorder is not None:
            self.recorder.finish()

    def _reset_buckets(self) -> None:
        """Ready for the next backward: every bucket waits for all its gradients again."""
        self._pending = [len(bucket) for bucket in self.bucket_indices]
        self._flat: list = [None] * len(self.bucket_indices)
        self._work: list = [None] * len(self.bucket_indices)
        self._next_bucket = 0  # the next bucket to launch: they go strictly in order
        self._callback_queued = False
