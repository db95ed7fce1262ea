"""NaiveDDP: data parallelism in its simplest correct form.

Every rank holds a full copy of the model and runs forward and backward on its own shard of the
global batch. If the copies start equal and every rank replaces each gradient by its mean over
the ranks, every copy takes the step one process would take on the whole batch (notebook 01).

1. **Start equal.** At construction, broadcast rank 0's parameters and buffers.
2. **Average every gradient.** A hook on each parameter fires inside ``backward()`` once its
   ``.grad`` is final; the first queues a callback that autograd runs when backward has
   finished. It divides each gradient by the world size R, then SUM-all-reduces it.

Divide first, as torch's Reducer does (``reducer.cpp``: ``at::mul_out(bucket_view, grad,
1 / div_factor_)``; ``_allreduce_fut`` in ``ddp_comm_hooks/default_hooks.py``: "Apply the
division first to avoid overflow, especially for FP16"). Slow on purpose: one message per
parameter, all after backward; ``ddp_lesson.core.bucketed_ddp`` fixes both.

Source: S. Li et al., "PyTorch Distributed", VLDB 2020 (arXiv:2006.15704), section 3.2.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NaiveDDP", "all_reduce_mean_", "sum_all_reduce"]


def all_reduce_mean_(tensor: torch.Tensor, process_group=None, async_op: bool = False):
    """Average ``tensor`` over the ranks in place: divide by the world size, then SUM.

    Returns None, or the all-reduce's ``Work`` with ``async_op=True`` (``.wait()`` before
    reading ``tensor``). A collective: every rank of the group calls it, in the same order.
    """
    tensor.div_(dist.get_world_size(process_group))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group, async_op=async_op)


def sum_all_reduce(tensor: torch.Tensor, process_group=None):
    """The default ``comm_hook``: start a SUM all-reduce of ``tensor``; returns its ``Work``."""
    return dist.all_reduce(tensor, group=process_group, async_op=True)


class NaiveDDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves every gradient averaged over the ranks.

    Args:
        module: the model, on this rank's device. process_group: None (the default group).
        comm_hook: ``hook(tensor, process_group) -> Work``, a SUM all-reduce (default
            :func:`sum_all_reduce`; a ``commsim.SimulatedLink`` fits). recorder: a
            ``commsim.Recorder`` told when gradients, messages and backward end, or None.

    Raises RuntimeError without a process group; ValueError, on every rank, without a trainable
    parameter or for parameters that differ between ranks. Construction and every backward of a
    forward outside ``no_sync()`` are collectives.
    """

    def __init__(self, module: nn.Module, process_group=None, comm_hook=None, recorder=None):
        super().__init__()
        name = type(self).__name__
        if not dist.is_initialized():
            raise RuntimeError(f"{name} needs a process group: call init_process_group first")
        self.module, self.process_group, self.recorder = module, process_group, recorder
        self.comm_hook = comm_hook or sum_all_reduce
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True  # False inside no_sync(); read by forward
        self._sync_this_backward = self._callback_queued = False
        # a tied weight is listed once; a frozen one is left alone
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names, self._params = [n for n, _ in named], [p for _, p in named]
        self._broadcast_state()  # a collective check first: every rank raises together
        if not named:
            raise ValueError(f"{name}: the module has no parameter with requires_grad=True, "
                             "so there is nothing to synchronise")
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad_ready(i))

    def forward(self, *inputs, **kwargs):
        # as torch, forward decides if the coming backward averages (a no_grad one: nothing)
        if torch.is_grad_enabled():
            self._sync_this_backward = self.require_backward_grad_sync
            if self._sync_this_backward and self.recorder is not None:
                self.recorder.begin(dist.get_rank(self.process_group))
        return self.module(*inputs, **kwargs)

    def _on_grad_ready(self, index: int) -> None:
        """The hook of parameter ``index``: its ``.grad`` is final for this backward."""
        if self.recorder is not None:
            self.recorder.grad_ready(self.param_names[index])
        if self._sync_this_backward and not self._callback_queued:
            # all gradients are final at the end of backward: autograd runs the callback there
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """Autograd has finished: average every gradient, one blocking all-reduce each."""
        self._callback_queued = False
        if self.recorder is not None:
            self.recorder.backward_end()
        for i, p in enumerate(self._params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused on this rank: it contributes zeros
            self._wait(self._send(p.grad, i, [i]))
        if self.recorder is not None:
            self.recorder.finish()

    def _send(self, tensor: torch.Tensor, index: int, params: list[int]):
        """Start averaging ``tensor`` in place: ÷ R, then SUM through ``comm_hook``."""
        tensor.div_(self.world_size)  # divide first: a float16 sum cannot overflow
        work = self.comm_hook(tensor, self.process_group)
        event = None if self.recorder is None else self.recorder.comm_start(
            index, tensor.numel() * tensor.element_size(),
            [self.param_names[i] for i in params], work)
        return work, event

    def _wait(self, handle) -> None:
        """Block until the all-reduce :meth:`_send` started has finished."""
        work, event = handle
        work.wait()
        if self.recorder is not None:
            self.recorder.comm_end(event)

    def _broadcast_state(self) -> None:
        """Check every rank holds the same parameters, then broadcast rank 0's state."""
        shapes = [(n, tuple(p.shape), p.requires_grad) for n, p in self.module.named_parameters()]
        every = [None] * self.world_size
        dist.all_gather_object(every, shapes, group=self.process_group)
        for r, theirs in enumerate(every):
            if theirs != every[0]:
                a, b = next(((a, b) for a, b in zip(every[0], theirs) if a != b),
                            (f"{len(every[0])} parameters", f"{len(theirs)}"))
                raise ValueError(f"{type(self).__name__}: the model differs between ranks: "
                                 f"rank 0 has {a}, rank {r} has {b}. Build the same model "
                                 "on every rank")
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.detach(), src=src, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate locally: the backward of a forward run inside does not average."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
