"""The torch drop-ins: the cores of notebook 04 with ``DistributedDataParallel``'s signature.

:class:`NaiveDDP` and :class:`BucketedDDP` subclass :mod:`ddp_lesson.core.naive_ddp` and
:mod:`ddp_lesson.core.bucketed_ddp` (the classes notebook 04 prints and its labs run) and add
what code written for torch's DDP needs: torch's signature (NotImplementedError naming each
option they leave out), a construction check that every rank holds the same model, a small check
table all-reduced after each synchronised backward (every rank raises the same error where torch
hangs or lets ranks diverge), ``find_unused_parameters``, buffer broadcasts before forwards,
``Join``, reentrant checkpoints and sparse gradients. The trainer's ``--ddp naive|bucketed``
uses them; ``notebooks/deep/04_ddp_dropin_edge_cases.ipynb`` runs each case and
``tests/programs/ddp_dropin.py`` checks it against torch. Averaging is the cores': ÷ R, then
SUM. Design: S. Li et al., "PyTorch Distributed", VLDB 2020 (arXiv:2006.15704), 3.2-3.3, and
``torch/csrc/distributed/c10d/reducer.cpp``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .commsim import Recorder
from .core import bucketed_ddp as _bucketed_core
from .core import naive_ddp as _naive_core
from .core.bucketed_ddp import MB, assign_buckets
from .env import group_active

__all__ = [
    "MB", "assign_buckets", "NaiveDDP", "BucketedDDP", "walk_autograd_graph",
]


# =========================================================================== the drop-ins


def _find_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside a (nested) tuple/list/dict output."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    return []


def walk_autograd_graph(outputs) -> tuple[int, set[int]]:
    """Walk the autograd graph back from ``outputs``: ``(nodes visited, ids of leaves reached)``.

    Follows ``grad_fn.next_functions`` from every tensor in ``outputs`` (nested
    tuples/lists/dicts are searched); a leaf shows up as an ``AccumulateGrad`` node whose
    ``.variable`` is the parameter, so ``id(p) in leaves`` says whether ``p`` took part in
    computing ``outputs``. This walk, after every forward, is what
    ``find_unused_parameters=True`` costs (torch's DDP does the same in C++). No
    synchronisation.

    Returns:
        ``(number of autograd nodes visited, {id(leaf tensor), ...})``.
    """
    stack = [t.grad_fn for t in _find_tensors(outputs) if t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return len(seen), found


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, process_group) -> None:
    """Overwrite ``tensors`` with ``src``'s copies: one broadcast per (dtype, device).

    A collective (synchronises ranks). Flattening many tensors into one message avoids paying
    the per-message latency once per tensor, the same reason gradients go in buckets.
    """
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=process_group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


#: torch's DDP keyword arguments these wrappers accept only at their default value:
#: ``name -> default``. Any other value raises NotImplementedError naming the feature.
_UNSUPPORTED = {
    "dim": 0, "check_reduction": False, "gradient_as_bucket_view": False,
    "static_graph": False, "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None, "mixed_precision": None, "device_mesh": None,
    "skip_all_reduce_unused_params": False, "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
}

# Codes in the per-step table every rank all-reduces after a synchronised backward.
_GOT = 1    # the parameter's gradient arrived in this synchronised backward
_USED = 2   # it got a gradient since the last synchronisation (no_sync passes included)
_LATE = 4   # it got a gradient after the graph walk had counted it unused (zeros already sent)
# extra columns after the P parameter columns
_COL_JOINED, _COL_FORWARDS, _COL_UNSYNCED, _COL_BACKWARDS = 0, 1, 2, 3
_EXTRA_COLUMNS = 4


def _signature(module: nn.Module, with_buffers: bool) -> list[tuple]:
    """What must be equal on every rank for the broadcast and the all-reduces to line up."""
    sig = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in module.named_parameters()]
    if with_buffers:
        sig += [("buffer", n, tuple(b.shape), str(b.dtype), False)
                for n, b in module.named_buffers()]
    return sig


def _first_difference(signatures: list[list[tuple]]) -> str | None:
    """The first way rank ``r``'s signature differs from rank 0's, in words; None if equal."""
    ref = signatures[0]
    for r, sig in enumerate(signatures[1:], start=1):
        for i, (a, b) in enumerate(zip(ref, sig)):
            if a == b:
                continue
            what = f"{a[0]} {i} ({a[1]!r} on rank 0, {b[1]!r} on rank {r})"
            if a[0] != b[0] or a[1] != b[1]:
                return (f"{what}: different names; shapes {a[2]} on rank 0 and {b[2]} on "
                        f"rank {r}")
            if a[2] != b[2]:
                return f"{what}: shape {a[2]} on rank 0 but {b[2]} on rank {r}"
            if a[3] != b[3]:
                return f"{what}: dtype {a[3]} on rank 0 but {b[3]} on rank {r}"
            return (f"{what}: requires_grad={a[4]} on rank 0 but {b[4]} on rank {r}, so the "
                    "ranks would synchronise different parameter lists")
        if len(ref) != len(sig):
            def count(s):
                trainable = sum(1 for e in s if e[0] == "parameter" and e[4])
                return (f"{sum(1 for e in s if e[0] == 'parameter')} parameters "
                        f"({trainable} trainable) and {sum(1 for e in s if e[0] == 'buffer')} "
                        "buffers")
            return f"rank 0 has {count(ref)}, rank {r} has {count(sig)}"
    return None


def _move_to(obj, device: torch.device):
    """``obj`` with every tensor inside (nested tuple/list/dict) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj


class _WrapperJoinHook(JoinHook):
    """A rank out of inputs inside ``Join``: ``main_hook`` runs once per handshake of the ranks
    still training (:meth:`_DropIn._join_handshake`) and issues the same collectives in the same
    order (flags, buffers if asked, zeros for each gradient message and a "joined" table row);
    ``post_hook`` broadcasts the final state from the highest rank among the last to join, as
    torch does.
    """

    def __init__(self, ddp: _DropIn, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        flags = torch.zeros(4, device=ddp._device)
        dist.all_reduce(flags, group=ddp.process_group)
        if flags[3].item() != 0:
            raise _repeated_backward_under_join(type(ddp).__name__, ddp.world_size,
                                                int(flags[3].item()))
        shadow, buffers_now, buffers_due = (bool(v != 0) for v in flags[:3].tolist())
        ddp._buffers_need_sync = buffers_due
        if buffers_now:
            ddp._broadcast_buffers(joined=True)
        if shadow:
            ddp._shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = ddp._common_rank(is_last_joiner)
        tensors = [p.detach() for p in ddp.module.parameters()]
        if ddp.broadcast_buffers:
            tensors += list(ddp.module.buffers())
        _broadcast_coalesced(tensors, src, ddp.process_group)


def _repeated_backward_under_join(name: str, world_size: int, active: int) -> RuntimeError:
    """The error every rank raises for a second backward after one forward inside ``Join``
    once a rank has joined, with ``divide_by_initial_world_size=True`` (``active`` ranks left)."""
    return RuntimeError(
        f"{name}: a second backward after one forward inside Join, with {world_size - active} "
        f"of {world_size} ranks joined and divide_by_initial_world_size=True: it would average "
        "the whole .grad with zeros from the joined ranks, dividing the share the first "
        "backward averaged once more. Sum the losses and run one backward per forward inside "
        "Join, or pass divide_by_initial_world_size=False.")


def _refuse_torch_only_options(name: str, torch_kwargs: dict) -> None:
    """Raise for a keyword torch's DDP has and the from-scratch wrappers leave out (TypeError for
    an unknown keyword, NotImplementedError naming torch's DDP for a left-out feature)."""
    for key, value in torch_kwargs.items():
        if key not in _UNSUPPORTED:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
        if value is not _UNSUPPORTED[key] and value != _UNSUPPORTED[key]:
            raise NotImplementedError(
                f"{name} does not support {key}={value!r}; use torch's "
                "DistributedDataParallel")


def _sparse_gradient_parameters(module: nn.Module) -> list[str]:
    """Names of the trainable parameters that get sparse gradients: those of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True``, torch's test
    (``produces_sparse_gradient`` in ``DistributedDataParallel._build_params_for_reducer``,
    torch/nn/parallel/distributed.py). Local; no communication."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, m in module.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
            for name, p in m.named_parameters(recurse=False) if p.requires_grad]


def _buffer_sync_rule(broadcast_buffers: bool | None,
                      forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's buffer flags as ``(sync before forwards, sync at construction)``.

    Follows ``DistributedDataParallel.__init__`` (torch/nn/parallel/distributed.py):
    ``broadcast_buffers`` is deprecated (default None; passing it warns ``FutureWarning``)
    and, when False, turns off both syncs; its replacement ``forward_sync_buffers`` sets the
    sync before forwards only (construction always syncs). Neither given: both True. Local;
    no communication.
    """
    if broadcast_buffers is not None:
        warnings.warn(
            "`broadcast_buffers` is deprecated (torch 2.13); its value is ignored when "
            "`forward_sync_buffers` is given" if forward_sync_buffers is not None else
            "`broadcast_buffers` is deprecated (torch 2.13): use `forward_sync_buffers`, "
            "which, unlike `broadcast_buffers=False`, still syncs buffers at construction",
            FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _check_same_model_everywhere(name: str, module, broadcast_buffers: bool, world_size: int,
                                 process_group) -> None:
    """Exchange every rank's parameter signature (all_gather_object: synchronises the ranks)
    and raise the same ValueError on every rank naming the first difference."""
    signatures: list = [None] * world_size
    dist.all_gather_object(signatures, _signature(module, broadcast_buffers),
                           group=process_group)
    diff = _first_difference(signatures)
    if diff is not None:
        raise ValueError(f"{name}: the model differs between ranks, so its "
                         f"gradients cannot be averaged: {diff}. Build the same "
                         "model on every rank before wrapping it.")


class _DropIn:
    """What the drop-ins add to their cores, mixed in before a core class. It overrides the
    core's ``_broadcast_state``, ``forward``, ``_on_grad_ready`` and final callback; subclasses
    implement ``_grad_ready``, ``_after_backward`` and ``_shadow_backward`` (a joined rank's
    matching collectives with zeros).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, *,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None, forward_sync_buffers: bool | None = None,
                 find_unused_parameters: bool = False, comm_hook: Callable | None = None,
                 recorder: Recorder | None = None, torch_kwargs: dict | None = None,
                 core_kwargs: dict | None = None):
        name = type(self).__name__
        _refuse_torch_only_options(name, torch_kwargs or {})
        if not group_active():
            raise RuntimeError(f"{name} needs a process group: call "
                               "ddp_lesson.env.init_distributed() (or "
                               "torch.distributed.init_process_group) first")
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the process group it was given")
        self.device_ids, self.output_device = self._check_devices(module, device_ids,
                                                                  output_device)
        # read by _broadcast_state, which the core's constructor calls
        self.broadcast_buffers, self._init_sync_buffers = _buffer_sync_rule(
            broadcast_buffers, forward_sync_buffers)
        self._init_sync = init_sync
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        super().__init__(module, process_group=process_group, comm_hook=comm_hook,
                         recorder=recorder, **(core_kwargs or {}))
        Joinable.__init__(self)
        self.find_unused_parameters = find_unused_parameters
        self._param_ids = {id(p) for p in self._params}
        self._device = self._params[0].device
        self._init_sync_state()

    def _broadcast_state(self) -> None:
        """The core's construction broadcast with the drop-in's check first: every rank's
        parameter list exchanged, so a model that differs is the same ValueError everywhere
        (torch raises on that rank only), then one coalesced broadcast (buffers unless
        ``broadcast_buffers=False``, torch's rule). ``init_sync=False`` skips both.
        """
        if self._init_sync:
            _check_same_model_everywhere(type(self).__name__, self.module,
                                         self._init_sync_buffers, self.world_size,
                                         self.process_group)
            tensors = [p.detach() for p in self.module.parameters()]
            if self._init_sync_buffers:
                tensors += list(self.module.buffers())
            _broadcast_coalesced(tensors, self._src, self.process_group)

    def _init_sync_state(self) -> None:
        """The per-parameter bookkeeping of a synchronised backward (local; no communication)."""
        P = len(self._params)
        self._used = [False] * P        # got a gradient since the last sync
        self._got = [False] * P         # got it in this synchronised backward
        self._ready = [False] * P       # counted ready (got it, or unused per the graph walk)
        self._late = [False] * P        # got it after being counted unused
        self._armed = False             # the last forward with grad enabled asked for a sync
        self._backward_begun = False    # a synchronised backward is under way
        self._window = False            # synchronised forwards, and no backward since
        self._backwards = 0             # synchronised backwards since the last one of those
        self._queued_tasks: set[int] = set()
        self._begin_at_output = False   # the last forward's graph reached no parameter
        self._buffers_need_sync = True
        self._warned_no_unused = False
        self._sync_forwards = 0         # synchronised forwards run so far (skipped backward)
        self._forward_serial = 0        # numbers the synchronised forwards
        self._pass_forwards: dict[int, set[int]] = {}  # autograd task -> forwards it reached
        self._input_grad_forwards: set[int] = set()    # reached by input-gradient passes only
        self._divisor = self.world_size
        self._divide_by_initial_world_size = True
        self._unsynced: list[str] = []  # trainable now, but not when wrapped

    def _check_devices(self, module: nn.Module, device_ids, output_device):
        """torch's rule: ``device_ids`` / ``output_device`` only for a single-GPU module."""
        devices = {p.device for p in module.parameters()}
        name = type(self).__name__
        if len(devices) > 1 or all(d.type == "cpu" for d in devices):
            if device_ids or output_device is not None:
                raise ValueError(
                    f"{name}: device_ids and output_device only work with a module on one "
                    f"GPU; got device_ids {device_ids}, output_device {output_device}, and "
                    f"module parameters on {sorted(str(d) for d in devices)}. Pass None "
                    "(as torch's DistributedDataParallel requires)")
            return None, None
        (device,) = devices
        if device_ids:
            ids = [torch.device(d if not isinstance(d, int) else f"{device.type}:{d}")
                   for d in device_ids]
            if len(ids) != 1 or ids[0] != device:
                raise ValueError(f"{name}: device_ids {list(device_ids)} must name the one "
                                 f"device the module is on, {device}")
        if output_device is not None:
            out = torch.device(output_device if not isinstance(output_device, int)
                               else f"{device.type}:{output_device}")
            if out != device:
                raise ValueError(f"{name}: output_device {output_device} differs from the "
                                 f"module's device {device}; {name} returns outputs where "
                                 "the module computes them")
        return (None if not device_ids else [device.index]), (
            None if output_device is None else device.index)

    # ------------------------------------------------------------------ user-facing

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; as torch, forward decides whether the backwards after it
        synchronise (not after one inside :meth:`no_sync`; a ``no_grad`` one decides nothing).
        Every backward after a synchronised forward averages its share (torch: the first only,
        B32). Before a forward that follows a synchronised one, buffers are broadcast from rank
        0 (under ``Join``: the highest rank still training), a collective, hidden from
        autograd's version counters (B33). With ``device_ids``, inputs move to that GPU first.
        """
        if self.device_ids:
            inputs, kwargs = _move_to(inputs, self._device), _move_to(kwargs, self._device)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._divisor = self.world_size
        if self._join_config.enable:
            self._join_handshake(backward=False, buffers_due_after=sync)
        elif self._buffers_due():
            self._broadcast_buffers(joined=False)
        self._buffers_need_sync = sync
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():  # under no_grad nothing can be backwarded
            self._armed = sync
        if sync:
            self._sync_forwards += 1
            self._forward_serial += 1
            if self._backward_begun:  # a backward that failed half-way left its state
                self._end_backward()
            self._backwards = 0
            self._unsynced = [n for n, p in self.module.named_parameters()
                              if p.requires_grad and id(p) not in self._param_ids]
            if self.recorder is not None:
                self.recorder.begin(self.rank)
            reached = (walk_autograd_graph(output)[1] if self.find_unused_parameters
                       else None)
            self._prepare_backward(reached, new_window=not self._window)
            self._window = True
            # A backward that reaches none of the parameters fires none of their hooks; with
            # find_unused_parameters it still averages (zeros here), so it begins at the
            # output's gradient (torch hangs there: its reducer waits for a hook). Not inside
            # a torch.func transform: its passes differentiate for the transform's inputs
            # only (the parameters are not tracked at its level) and never fill a .grad.
            self._begin_at_output = (reached is not None and not reached & self._param_ids
                                     and torch._C._functorch.maybe_current_level() is None)
            # The outer backward's own task gets a final callback even when every parameter
            # sits inside a reentrant checkpoint (whose inner backward is a task of its own).
            for t in _find_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g, n=self._forward_serial: self._on_output_grad(n))
        return output

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with ddp.join():`` is ``with Join([ddp], ...)`` (torch's ``DDP.join``)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``torch.distributed.algorithms.Join`` runs on a rank out of inputs.

        Args:
            divide_by_initial_world_size: True (torch's default): a gradient averaged while
                some ranks have joined is still divided by the initial world size (the joined
                ranks count as zeros). False: divided by the number of ranks still training.
        """
        return _WrapperJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return self.process_group

    def register_comm_hook(self, state, hook):
        raise NotImplementedError(
            f"{type(self).__name__} does not support register_comm_hook(state, hook) (torch's "
            "GradBucket hooks); pass comm_hook=hook(tensor, process_group) -> work when "
            "building it, or use torch's DistributedDataParallel")

    # ------------------------------------------------------------------ hooks

    def _on_grad_ready(self, index: int) -> None:
        """The core's per-parameter hook, keeping the check table's bits."""
        self._used[index] = True
        if not self._armed:
            return  # a no_sync backward: the gradient just accumulates
        self._begin_backward()
        if self.recorder is not None:
            self.recorder.grad_ready(self.param_names[index])
        self._got[index] = True
        if not self._ready[index]:
            self._ready[index] = True
            self._grad_ready(index)
        else:  # counted unused by the graph walk, its zeros may be on the wire already
            self._late[index] = True

    def _on_output_grad(self, forward: int) -> None:
        """A pass through the output began: queue its task's final callback; begin the
        synchronised backward here only if no parameter hook can. As torch, whose reducer is
        driven by the parameters' ``AccumulateGrad`` hooks only (``Reducer::autograd_hook``,
        reducer.cpp), a pass that reaches no parameter (``autograd.grad`` w.r.t. the inputs,
        as in PGD) neither communicates nor counts as a skipped backward (B40).
        """
        if not self._armed:
            return
        self._pass_forwards.setdefault(torch._C._current_graph_task_id(), set()).add(forward)
        if self._begin_at_output:
            self._begin_backward()
        else:
            self._queue_final_callback()

    def _begin_backward(self) -> None:
        if not self._backward_begun:
            self._backward_begun = True
            if self._join_config.enable:  # the joined ranks shadow this very backward
                self._join_handshake(backward=True, buffers_due_after=self._buffers_need_sync)
            if self.recorder is not None and self.recorder._current is None:
                self.recorder.begin(self.rank)  # a second backward after one forward
            self._backward_started()
        self._queue_final_callback()

    def _queue_final_callback(self) -> None:
        """One final callback per autograd task: a reentrant checkpoint runs an inner
        backward (a task of its own) whose end is not the end of the outer one."""
        task = torch._C._current_graph_task_id()
        if task not in self._queued_tasks:
            self._queued_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        forwards = self._pass_forwards.pop(task, set())
        if not self._backward_begun:
            # already done in an inner task's callback, or a pass that reached no
            # parameter's gradient (autograd.grad w.r.t. the inputs): nothing to average,
            # and its forwards were not training forwards whose backward was skipped
            self._queued_tasks.discard(task)
            new = forwards - self._input_grad_forwards
            self._sync_forwards -= len(new)
            self._input_grad_forwards |= new
            return
        nested = torch._C._current_autograd_node() is not None
        if nested and not all(self._ready):
            return  # an inner (reentrant) backward ended; the outer one goes on
        if self.recorder is not None:
            self.recorder.backward_end()
        try:
            self._after_backward()
        finally:
            self._used = [False] * len(self._params)
            self._end_backward()
            if self.recorder is not None:
                self.recorder.finish()

    def _end_backward(self) -> None:
        """Ready for the next synchronised backward, with or without a forward in between
        (local; the wrapper stays armed: every backward after a synchronised forward averages).
        """
        P = len(self._params)
        self._got, self._ready, self._late = [False] * P, [False] * P, [False] * P
        self._backward_begun = False
        self._queued_tasks = set()
        self._window = False  # the next synchronised forward starts a new graph walk
        self._backwards += 1
        self._input_grad_forwards = set()
        self._backward_done()

    # ------------------------------------------------------------------ collectives

    def _common_rank(self, candidate: bool) -> int:
        """The highest global rank among those passing ``candidate=True`` (a MAX all-reduce)."""
        me = (self.rank if self.process_group is None
              else dist.get_global_rank(self.process_group, self.rank))
        t = torch.tensor([me if candidate else -1], device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def _buffers_due(self) -> bool:
        """Broadcast the buffers before this forward: it follows a synchronised one (local)."""
        return bool(self.broadcast_buffers and self._buffers_need_sync
                    and next(iter(self.module.buffers()), None) is not None)

    def _broadcast_buffers(self, joined: bool) -> None:
        """Overwrite every rank's buffers with rank 0's (under ``Join``: the highest rank still
        training), a collective, inside ``torch.autograd._unsafe_preserve_version_counter`` as
        torch's ``_sync_buffers`` (torch/nn/parallel/distributed.py): a forward whose backward
        has not run may have saved a buffer, and a bumped version would fail that backward
        (pytorch/pytorch#22095).
        """
        buffers = list(self.module.buffers())  # afresh: forward may have replaced them
        src = self._common_rank(not joined) if self._join_config.enable else self._src
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            _broadcast_coalesced(buffers, src, self.process_group)

    def _join_handshake(self, backward: bool, buffers_due_after: bool) -> None:
        """Under ``Join``, before a forward and at the start of a synchronised backward: tell
        the joined ranks what comes (collectives): the number still training (the divisor with
        ``divide_by_initial_world_size=False``), then four summed flags: shadow a backward,
        broadcast buffers now, buffers due before the next forward, refuse. Raises RuntimeError
        on every rank for a second backward after one forward once a rank has joined, with
        ``divide_by_initial_world_size=True`` (it would divide the first share again).
        """
        self._divisor = self.world_size
        active = self.world_size
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()
            active = int(work.get_future().value()[0].item())
            if not self._divide_by_initial_world_size:
                self._divisor = active
        refuse = (backward and self._backwards > 0 and active < self.world_size
                  and self._divide_by_initial_world_size)
        flags = torch.tensor([float(backward), float(not backward and self._buffers_due()),
                              float(buffers_due_after), float(refuse)], device=self._device)
        dist.all_reduce(flags, group=self.process_group)
        if flags[3].item() != 0:
            raise _repeated_backward_under_join(type(self).__name__, self.world_size,
                                                int(flags[3].item()))
        if flags[1].item() != 0:
            self._broadcast_buffers(joined=False)

    # ------------------------------------------------------------------ for subclasses

    def _prepare_backward(self, reached: set[int] | None, new_window: bool) -> None:
        """Called after a synchronised forward; ``reached``: ids of the leaves its graph
        reaches (with ``find_unused_parameters``; else None); ``new_window``: no synchronised
        forward since the last synchronised backward (False: a second forward before the
        backward)."""

    def _backward_started(self) -> None:
        """Called at the first gradient of a synchronised backward."""

    def _backward_done(self) -> None:
        """Called at the end of every synchronised backward (after ``_after_backward``)."""

    def _table(self, joined: bool = False) -> torch.Tensor:
        """Row ``rank`` of an ``(R, P + 4)`` int32 table; all-reduced, every rank sees every row.

        Parameter columns hold :data:`_GOT` | :data:`_USED` | :data:`_LATE` bits; then
        "joined", "synchronised forwards so far", "unsynchronised trainable parameters" and
        "synchronised backwards since the last synchronised forward, before this one".
        """
        P = len(self._params)
        table = torch.zeros(self.world_size, P + _EXTRA_COLUMNS, dtype=torch.int32,
                            device=self._device)
        if joined:
            table[self.rank, P + _COL_JOINED] = 1
            self._unsynced = []
            return table
        row = [(_GOT if g else 0) | (_USED if u else 0) | (_LATE if late else 0)
               for g, u, late in zip(self._got, self._used, self._late)]
        unsynced = [n for n in self._unsynced
                    if dict(self.module.named_parameters())[n].grad is not None]
        self._unsynced = unsynced
        row += [0, self._sync_forwards, len(unsynced), self._backwards]
        table[self.rank] = torch.tensor(row, dtype=torch.int32, device=self._device)
        return table

    def _check_table(self, table: torch.Tensor) -> list[bool]:
        """After the table's all-reduce: which parameters to write (used on some rank).

        Raises the same error on every rank (they all hold the same table, and the gather of
        names below is entered by all of them):
            RuntimeError: a trainable parameter the wrapper does not know got a gradient;
                the ranks' synchronised-forward counts differ (a rank ran a forward whose
                backward it skipped); a parameter got a gradient after the graph walk counted
                it unused; without ``find_unused_parameters``, a parameter got no gradient on
                some rank.
        """
        name = type(self).__name__
        P = len(self._params)
        table = table.cpu()
        active = [r for r in range(self.world_size) if not table[r, P + _COL_JOINED]]
        if any(table[r, P + _COL_UNSYNCED] for r in active):
            names: list = [None] * self.world_size
            dist.all_gather_object(names, self._unsynced, group=self.process_group)
            where = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(names) if n)
            raise RuntimeError(
                f"{name}: parameters that were frozen or absent when the wrapper was built "
                f"now get gradients that it does not average, so the ranks would silently "
                f"diverge — {where}. Wrap the model again after changing requires_grad or "
                "adding parameters (torch's DDP does not notice this).")
        counts = {r: int(table[r, P + _COL_FORWARDS]) for r in active}
        backwards = {r: int(table[r, P + _COL_BACKWARDS]) + 1 for r in active}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {r}: {c}" for r, c in counts.items())
            after = ", ".join(f"rank {r}: {c}" for r, c in backwards.items())
            raise RuntimeError(
                f"{name}: the ranks have run different numbers of synchronised forwards "
                f"({said}), so this backward would average gradients of different steps. A "
                "rank ran a forward with gradients enabled and skipped its backward, or ran "
                "more backwards after one forward than the others (this one is backward "
                f"{after} after the last synchronised forward): run evaluation under "
                "torch.no_grad() or on ddp.module, and every training forward and backward "
                "on every rank.")
        late = [i for i in range(P) if any(int(table[r, i]) & _LATE for r in active)]
        if late:
            raise RuntimeError(
                f"{name}: {', '.join(self.param_names[i] for i in late)} got a gradient "
                "although the graph walk after forward found it unused (a reentrant "
                "checkpoint hides parameters from the walk; or this backward runs through "
                "the graph of a forward from before the last synchronised backward), and "
                f"zeros were already sent for it. {name} does not support "
                "find_unused_parameters=True with torch.utils.checkpoint(use_reentrant=True); "
                "use use_reentrant=False, or torch's DistributedDataParallel")
        bit = _USED if self.find_unused_parameters else _GOT
        if not self.find_unused_parameters:
            self._raise_if_a_gradient_is_missing(table, active, max(backwards.values()))
        used = [any(int(table[r, i]) & bit for r in active) for i in range(P)]
        if self.find_unused_parameters and not self._warned_no_unused and self.rank in active:
            self._warned_no_unused = True
            if all(self._got):
                warnings.warn(
                    f"{name}(find_unused_parameters=True): every parameter got a gradient "
                    "in the first synchronised backward on this rank. The flag costs a walk "
                    "of the autograd graph after every forward (and makes buckets wait for "
                    "the end of backward when something is unused); if no step ever leaves "
                    "a parameter out (none skipped by a branch or used only inside "
                    "no_sync()), leave it False.", UserWarning, stacklevel=2)
        return used


    def _raise_if_a_gradient_is_missing(self, table: torch.Tensor, active: list[int],
                                        nth: int) -> None:
        """Without ``find_unused_parameters``: the same RuntimeError on every rank when a
        trainable parameter got no gradient in this backward (``nth`` after the last
        synchronised forward) on some rank, naming each such parameter and rank (local: every
        rank reads the same all-reduced ``table``)."""
        name = type(self).__name__
        P = len(self._params)
        lines, frozen = [], False
        for r in active:
            missing = []
            for i in range(P):
                code = int(table[r, i])
                if not code & _GOT:
                    note = ("; it got its gradient only inside no_sync(), so "
                            "find_unused_parameters=True is needed" if code & _USED else "")
                    if not self._params[i].requires_grad:
                        note += "; frozen after wrapping"
                        frozen = True
                    missing.append(f"{self.param_names[i]} (index {i}{note})")
            if missing:
                lines.append(f"rank {r}: {', '.join(missing)}")
        if lines:
            # A parameter frozen after wrapping is already requires_grad=False: the fix is
            # to wrap again (the wrapper takes its parameter list at construction), not to
            # freeze it.
            advice = ("Wrap the model again after changing requires_grad (the wrapper "
                      "takes its parameters when it is built)" if frozen else
                      "Make every parameter take part in the loss on every rank, freeze "
                      "it (requires_grad=False), or pass find_unused_parameters=True")
            which = "" if nth == 1 else (
                f" (backward {nth} after the last synchronised forward: every backward "
                "after a synchronised forward is averaged, so each must reach every "
                "parameter)")
            raise RuntimeError(
                f"{name}: these parameters received no gradient in this "
                f"backward pass{which}, so their all-reduce could never complete — "
                f"{'; '.join(lines)}. torch's DDP would hang here or fail in the next "
                "iteration with 'Expected to have finished reduction in the prior "
                f"iteration'. {advice}.")

    def _agree_on_used(self, joined: bool = False) -> list[bool]:
        """All-reduce the check table (blocking), then check it."""
        table = self._table(joined)
        dist.all_reduce(table, group=self.process_group)
        return self._check_table(table)

    def _all_reduce(self, tensor: torch.Tensor, index: int, names: list[str]):
        """Issue the SUM all-reduce of ``tensor`` through ``comm_hook``; returns a handle for
        :meth:`_wait`."""
        work = self.comm_hook(tensor, self.process_group)
        event = None
        if self.recorder is not None:
            event = self.recorder.comm_start(index, tensor.numel() * tensor.element_size(),
                                              names, work)
        return work, event

    def _write_grad(self, index: int, value: torch.Tensor) -> None:
        p = self._params[index]
        if p.grad is None:
            p.grad = value.view(p.shape).clone()
        else:
            p.grad.copy_(value.view(p.shape))


class NaiveDDP(_DropIn, _naive_core.NaiveDDP, Joinable):
    """:class:`ddp_lesson.core.naive_ddp.NaiveDDP` as a drop-in for torch's DDP (``--ddp naive``).

    Beyond the core: every rank's parameter list (names, shapes, dtypes, requires_grad; buffers
    with ``broadcast_buffers``) compared at construction, the same ValueError on every rank;
    after each synchronised backward a ``(R, P + 4)`` int32 table all-reduced, so every rank
    raises the same RuntimeError for a parameter with no gradient (without
    ``find_unused_parameters``), a rank that skipped a backward, or a parameter unfrozen after
    wrapping; buffers broadcast before a forward that follows a synchronised one, hidden from
    autograd's version counters as torch (B33); ``Join`` (a rank out of inputs shadows the
    others' all-reduces with zeros); reentrant checkpoints; every backward after a synchronised
    forward averages (torch: the first only, B32); passes that run no parameter's
    ``AccumulateGrad`` communicate nothing, as torch (B40); sparse gradients all-reduced sparse.

    Args:
        module: the model, on this rank's device.
        device_ids, output_device: None on CPU; on one GPU, None or that GPU (torch's rule).
        dim: only 0. init_sync: False skips the construction check and broadcast.
        broadcast_buffers: deprecated as in torch 2.13 (warns); False: buffers never broadcast.
        forward_sync_buffers: broadcast buffers before forwards (construction always does).
        process_group: the group (None: default). bucket_cap_mb: only None.
        find_unused_parameters: False: a missing gradient raises on every rank, naming it;
            True: its rank contributes zeros; unused everywhere keeps ``.grad`` None.
        comm_hook, recorder: as the core.

    Raises:
        RuntimeError: no process group. ValueError: no trainable parameter, a model that
        differs between ranks, bad ``device_ids``/``output_device``. NotImplementedError: a
        left-out torch feature (``gradient_as_bucket_view``, ``static_graph``,
        ``mixed_precision``, ``device_mesh``, ``register_comm_hook``, ...).

    Synchronisation: construction, buffer broadcasts and every synchronised backward are
    collectives.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None,
                 bucket_cap_mb=None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, comm_hook: Callable | None = None,
                 recorder: Recorder | None = None, **torch_kwargs):
        if bucket_cap_mb is not None:
            raise NotImplementedError(
                f"NaiveDDP does not support bucket_cap_mb={bucket_cap_mb!r} (it sends one "
                "message per parameter); use BucketedDDP or torch's DistributedDataParallel")
        torch_kwargs.update(dim=dim, check_reduction=check_reduction,
                            gradient_as_bucket_view=gradient_as_bucket_view,
                            static_graph=static_graph)
        super().__init__(module, device_ids, output_device, broadcast_buffers=broadcast_buffers,
                         forward_sync_buffers=torch_kwargs.pop("forward_sync_buffers", None),
                         init_sync=init_sync, process_group=process_group,
                         find_unused_parameters=find_unused_parameters, comm_hook=comm_hook,
                         recorder=recorder, torch_kwargs=torch_kwargs)
        sparse = set(_sparse_gradient_parameters(module))
        self._sparse = {i for i, n in enumerate(self.param_names) if n in sparse}

    def _zeros(self, index: int) -> torch.Tensor:
        """What a rank without this parameter's gradient contributes: zeros, sparse (no
        entry) for a sparse-gradient embedding, so that every rank's all-reduce is sparse."""
        p = self._params[index]
        if index in self._sparse:
            return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=p.device),
                                           p.new_empty(0, *p.shape[1:]), p.shape)
        return torch.zeros_like(p)

    def _grad_ready(self, index: int) -> None:
        pass  # nothing to do until backward has finished

    def _after_backward(self) -> None:
        used = self._agree_on_used()  # a tiny all-reduce: which rank produced which gradient
        for i, p in enumerate(self._params):
            if not used[i]:
                continue  # unused on every rank: .grad stays as it is (None), like torch
            if p.grad is None:
                p.grad = self._zeros(i)  # unused here, used elsewhere: contributes 0
            p.grad.div_(self._divisor)        # pre-divide (torch's order: no fp16 overflow)
            handle = self._all_reduce(p.grad, i, [self.param_names[i]])  # SUM over ranks
            self._wait(handle)                # one message at a time, after backward

    def _shadow_backward(self) -> None:
        used = self._agree_on_used(joined=True)
        for i in range(len(self._params)):
            if used[i]:
                self._wait(self._all_reduce(self._zeros(i), i, [self.param_names[i]]))


@dataclass
class _Bucket:
    index: int
    params: list[int]                  # parameter indices, in gradient-ready order
    offsets: list[tuple[int, int]]     # their [start, stop) in ``flat``
    flat: torch.Tensor                 # the message: every gradient of the bucket, flattened
    handle: object = None              # the all-reduce in flight


class BucketedDDP(_DropIn, _bucketed_core.BucketedDDP, Joinable):
    """:class:`ddp_lesson.core.bucketed_ddp.BucketedDDP` as a drop-in (``--ddp bucketed``).

    What :class:`NaiveDDP` adds, with buckets: each allocated once and reused; with
    ``find_unused_parameters=True`` torch's construction-time buckets (filled in registration
    order, launched reversed, as torch keeps them), and the parameters the graph walk after
    forward misses counted ready at the start of backward. Differs from torch: the buckets are
    torch's rebuilt ones from the first step (torch's first iteration sends one bucket);
    gradients are copied into the bucket (``gradient_as_bucket_view=False``); one small extra
    all-reduce per step carries the check table.

    Args: as :class:`NaiveDDP`, and ``bucket_cap_mb`` (MiB, as torch; None: 1 MiB first, then
    25) and ``overlap`` (False: every bucket waits for the end of backward).

    Raises: as :class:`NaiveDDP`; ValueError for a negative or infinite ``bucket_cap_mb``;
    NotImplementedError for a trainable ``nn.Embedding(sparse=True)`` (named at construction)
    and RuntimeError for another sparse gradient, naming the parameter (B41).

    Attributes: ``module``, ``bucket_indices`` (lists of indices into ``param_names``).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, overlap: bool = True,
                 comm_hook: Callable | None = None, recorder: Recorder | None = None,
                 **torch_kwargs):
        _bucketed_core.bucket_size_limits(bucket_cap_mb)  # a bad cap fails before any collective
        sparse = _sparse_gradient_parameters(module)
        if sparse:  # before any collective: every rank holds the same model
            raise NotImplementedError(
                f"BucketedDDP does not support sparse gradients: {', '.join(sparse)} "
                "(nn.Embedding/EmbeddingBag with sparse=True) would get a sparse gradient, "
                "which does not fit a flat bucket. Use sparse=False, NaiveDDP (one "
                "all-reduce per gradient, sparse ones included) or torch's "
                "DistributedDataParallel")
        torch_kwargs.update(dim=dim, check_reduction=check_reduction,
                            gradient_as_bucket_view=gradient_as_bucket_view,
                            static_graph=static_graph)
        super().__init__(module, device_ids, output_device, broadcast_buffers=broadcast_buffers,
                         forward_sync_buffers=torch_kwargs.pop("forward_sync_buffers", None),
                         init_sync=init_sync, process_group=process_group,
                         find_unused_parameters=find_unused_parameters, comm_hook=comm_hook,
                         recorder=recorder, torch_kwargs=torch_kwargs,
                         core_kwargs={"bucket_cap_mb": bucket_cap_mb, "overlap": overlap})
        self.bucket_cap_mb = bucket_cap_mb
        if find_unused_parameters:  # torch's construction-time buckets, which it then keeps
            self.bucket_indices = assign_buckets(
                [p.numel() * p.element_size() for p in self._params],
                _bucketed_core.bucket_size_limits(bucket_cap_mb),
                [(p.dtype, p.device) for p in self._params])[::-1]
            self._bucket_of = {i: b for b, ids in enumerate(self.bucket_indices) for i in ids}
            self._reset_buckets()
        # one flat tensor per bucket, allocated once and reused by every backward
        self._buckets: list[_Bucket] = []
        for b, indices in enumerate(self.bucket_indices):
            offsets, start = [], 0
            for i in indices:
                offsets.append((start, start + self._params[i].numel()))
                start += self._params[i].numel()
            first = self._params[indices[0]]
            flat = torch.empty(start, dtype=first.dtype, device=first.device)
            self._buckets.append(_Bucket(b, list(indices), offsets, flat))
        self._unused_in_forward: list[int] = []

    # ------------------------------------------------------------------ backward machinery

    def _prepare_backward(self, reached: set[int] | None, new_window: bool) -> None:
        if reached is not None:
            # Unused: reached by no synchronised forward since the last synchronised backward
            # (several forwards before the backwards: any of their graphs may come first).
            before = set(range(len(self._params))) if new_window else set(self._unused_in_forward)
            self._unused_in_forward = [i for i, p in enumerate(self._params)
                                       if id(p) not in reached and i in before]

    def _backward_done(self) -> None:
        self._reset_buckets()  # the core's: every bucket waits for all its gradients again
        for bucket in self._buckets:
            bucket.handle = None

    def _backward_started(self) -> None:
        # Parameters the forward did not reach will get no gradient: count them as ready
        # now, so that their buckets are not held back until the end (torch does the same).
        for i in self._unused_in_forward:
            if not self._ready[i]:
                self._ready[i] = True
                self._grad_ready(i)

    def _launch(self, b: int) -> None:
        """The core's launch into the bucket's own flat tensor, divided by the Join-aware
        divisor, through ``comm_hook`` and the recorder."""
        bucket = self._buckets[b]
        scale = 1.0 / self._divisor  # pre-divide (torch's order: no fp16 overflow in the sum)
        with torch.no_grad():
            for i, (start, stop) in zip(bucket.params, bucket.offsets):
                grad = self._params[i].grad
                if grad is None:  # no gradient here (unused): contributes zeros
                    bucket.flat[start:stop].zero_()
                elif grad.layout != torch.strided:  # e.g. F.embedding(..., sparse=True)
                    raise RuntimeError(
                        f"BucketedDDP: {self.param_names[i]} got a {grad.layout} gradient, "
                        "which does not fit a flat bucket (the sparse layers it can see are "
                        "refused at construction). Use NaiveDDP, or a dense gradient")
                else:
                    torch.mul(grad.reshape(-1), scale, out=bucket.flat[start:stop])
        bucket.handle = self._all_reduce(bucket.flat, bucket.index,
                                         [self.param_names[i] for i in bucket.params])

    def _after_backward(self) -> None:
        # Issue what is left (everything, without overlap; buckets whose gradients never
        # came, with zeros), then the flags table, then wait: same order on every rank.
        self._launch_in_order(everything=True)
        table = self._table()
        table_work = dist.all_reduce(table, group=self.process_group, async_op=True)
        for bucket in self._buckets:
            self._wait(bucket.handle)
        table_work.wait()
        used = self._check_table(table)
        with torch.no_grad():
            for bucket in self._buckets:
                for i, (start, stop) in zip(bucket.params, bucket.offsets):
                    if used[i]:
                        self._write_grad(i, bucket.flat[start:stop])
                bucket.handle = None

    def _shadow_backward(self) -> None:
        # a joined rank: zeros for every bucket, in bucket order, then a "joined" table row
        handles = []
        for bucket in self._buckets:
            bucket.flat.zero_()
            handles.append(self._all_reduce(bucket.flat, bucket.index, []))
        table = self._table(joined=True)
        table_work = dist.all_reduce(table, group=self.process_group, async_op=True)
        for handle in handles:
            self._wait(handle)
        table_work.wait()
        self._check_table(table)
