"""NaiveDDP: data parallelism in its simplest correct form.

Every rank holds a full copy of the model and runs forward and backward on its own shard of
the global batch. If every copy starts from the same weights and every rank replaces its
gradients by their mean over the ranks, every copy takes the same optimizer step, and that
step is the one a single process would take on the whole global batch (notebook 01). So a
data-parallel wrapper has two jobs:

1. **Start equal.** At construction, broadcast rank 0's parameters and buffers to every rank.
2. **Average every gradient.** A hook on each parameter
   (``Tensor.register_post_accumulate_grad_hook``) fires inside ``backward()`` once that
   parameter's ``.grad`` is final. The first hook of a backward queues a callback that autograd
   runs when the whole backward has finished; that callback divides each gradient by the world
   size and all-reduces it with SUM, so ``loss.backward()`` returns with averaged gradients.

Why a callback and not the hook itself: a hook sees one parameter; the callback runs once, when
every gradient is final, and before ``backward()`` returns, so the caller needs to call
nothing. Why divide first: torch's DDP does. Its C++ ``Reducer``
(``torch/csrc/distributed/c10d/reducer.cpp``) multiplies each gradient by ``1 / div_factor_``
as it copies it into its bucket (``at::mul_out(bucket_view, grad, wrapped)``), before the
all-reduce; ``div_factor_`` is "Division factor for reduction of gradients. Equal to the
process group size" (``torch/include/torch/csrc/distributed/c10d/reducer.hpp``, installed with
torch). Its default comm hook, ``_allreduce_fut`` in
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``, says "Apply the division
first to avoid overflow, especially for FP16": a SUM over R ranks of float16 gradients near
65,504 overflows to inf, the sum of gradients already divided by R cannot.

It is slow on purpose: one message per parameter (each pays the network's latency), and nothing
is sent until backward has finished. ``ddp_lesson.core.bucketed_ddp`` fixes both.

The drop-in replacement for ``torch.nn.parallel.DistributedDataParallel`` that the trainer
uses is ``ddp_lesson.ddp.NaiveDDP``: this class plus torch's constructor signature, checks that
raise the same clear error on every rank, ``Join``, buffer broadcasts and reentrant
checkpoints.

Source: S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020 (arXiv:2006.15704), section 3.2.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NaiveDDP", "all_reduce_mean_"]


def all_reduce_mean_(tensor: torch.Tensor, process_group=None, async_op: bool = False):
    """Average ``tensor`` over the ranks, in place: divide by the world size, then SUM.

    The one averaging rule of the package, torch's DDP order (dividing first keeps a float16
    sum from overflowing).

    Args:
        tensor: a floating-point tensor, same shape and dtype on every rank.
        process_group: the group to average over (None: the default group).
        async_op: False: return when ``tensor`` holds the mean. True: return at once with the
            all-reduce's ``Work``; ``.wait()`` on it before reading ``tensor``.

    Returns:
        None, or the ``Work`` handle with ``async_op=True``.

    Synchronisation: a collective; every rank of the group must call it, in the same order.
    """
    tensor.div_(dist.get_world_size(process_group))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op)


class NaiveDDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves every gradient averaged over the ranks.

    Args:
        module: the model, already on this rank's device.
        process_group: the group to average over (None: the default group).

    Every trainable parameter must get a gradient in every synchronised backward; one that
    got none on this rank contributes zeros (so every rank issues the same all-reduces). Buffers
    (BatchNorm's running statistics) are broadcast once, at construction.

    Every backward after a synchronised forward averages, not only the first: with several
    forwards, then several backwards (``retain_graph=True``), each averages the whole ``.grad``,
    which before it was already equal on every rank, so each backward's share is averaged.

    Synchronisation: construction (the broadcasts) and every synchronised backward are
    collectives: every rank must do them, together.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        #: False inside ``no_sync()``; read by ``forward``, as in torch's DDP.
        self.require_backward_grad_sync = True
        self._sync_this_backward = False
        self._callback_queued = False
        # parameters() lists a tied (shared) weight once, so it is averaged once; a frozen
        # parameter gets no gradient and is left alone.
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._broadcast_state()
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad_ready(i))

    def forward(self, *inputs, **kwargs):
        # As in torch, forward decides whether the coming backwards average: after a forward
        # run inside no_sync() they only accumulate into .grad. A forward under no_grad builds
        # no graph, so it decides nothing (else the backward of the forward before it would
        # silently stay local).
        if torch.is_grad_enabled():
            self._sync_this_backward = self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    def _on_grad_ready(self, index: int) -> None:
        """The hook of parameter ``index``: its ``.grad`` is final for this backward."""
        if self._sync_this_backward and not self._callback_queued:
            # Not the hook but the end of backward is where every gradient is final; autograd
            # runs a queued callback exactly there, before backward() returns.
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """Autograd has finished: average every gradient, one blocking all-reduce each."""
        self._callback_queued = False
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused on this rank: it contributes zeros
            all_reduce_mean_(p.grad, self.process_group)  # divide by R, then SUM over ranks

    def _broadcast_state(self) -> None:
        """Give every rank rank 0's parameters and buffers (a collective)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.detach(), src=src, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: the backward of a forward run inside skips averaging.

        With ``k`` micro-batches, run the first ``k - 1`` forwards and backwards inside
        ``no_sync()`` and the last one outside: its backward averages the accumulated ``.grad``.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
