"""torch.compile with DDP: DDPOptimizer's split, equal gradients, what a graph break costs
(notebooks/deep/04_torch_compile_and_ddp.ipynb, a deep dive of notebook 04).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.compile_ddp \\
        [--part split|breaks|wrappers|all] [--dims 512,512,512,512,512] [--caps none,1,2] \\
        [--out FILE] [--report model,split,gradients,breaks,wrappers]

Every scenario compiles a tiny model with the ``aot_eager`` backend (AOTAutograd's forward and
backward graphs run by the eager kernels: no C++ toolchain, no code generation) behind a
counting backend, runs two training steps on every rank's own batch, and records what the
second step's backward did, in order: when each compiled part's backward starts, when each
layer's gradients are ready, when DDP sends each bucket (a comm hook that logs, then does the
default all-reduce). Rank 0 prints facts (counts and that order, the same on every machine);
``--out`` writes every number as JSON.

What torch 2.13 does (``torch/_dynamo/backends/distributed.py``, ``DDPOptimizer``;
``torch/_dynamo/convert_frame.py``): a frame run inside a torch ``DistributedDataParallel``'s
forward, with ``torch._dynamo.config.optimize_ddp`` True (the default), goes to
``DDPOptimizer.compile_fn``, which cuts the graph into one subgraph per bucket (the rule:
:func:`predict_parts`) and compiles each with the user's backend; the caps are DDP's
``bucket_bytes_cap`` and, whatever ``bucket_cap_mb`` is, a 1 MiB first cap
(``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), asserted ``<= bucket_bytes_cap``: a cap
under 1 MiB fails the compile with an ``AssertionError``.

Run on its own, ``main`` joins a gloo group on any machine (``init_distributed(backend="gloo")``):
its tensors and models are CPU tensors, which NCCL refuses ("Tensors must be CUDA and dense",
``ProcessGroupNCCL.cpp``); the deep dive's cell says ``--backend gloo`` for the same reason.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP, sum_all_reduce

__all__ = [
    "BAD_CAP_MB", "CAPS_MB", "CountingBackend", "DIMS", "LoopStack", "Stack", "Timeline",
    "compiled_run", "eager_run", "layer_nbytes", "main", "overlapped", "partition", "predict_parts",
    "load", "render", "report", "SECTIONS",
]

#: The model: Linear(512, 512) layers, 1,050,624 bytes each (weight and bias), so that
#: DDPOptimizer's 1 MiB first bucket holds exactly one layer. ``dims`` lists the features
#: between layers: (512,) * 5 makes 4 layers.
DIMS = (512,) * 5
#: The caps of the sweep (bucket_cap_mb; None: DDP's default, 25 MiB with a 1 MiB first bucket).
CAPS_MB = (None, 1, 2)
#: The cap of a second eager DDP run: other buckets, same gradients?
OTHER_CAP_MB = 1
#: A cap under DDPOptimizer's 1 MiB first bucket: the compile fails.
BAD_CAP_MB = 0.5
#: Samples per rank.
BATCH = 8
#: The reason dynamo records for ``torch._dynamo.graph_break()`` (its first line).
DELIBERATE = "Call to `torch._dynamo.graph_break()`"


class Stack(nn.Module):
    """Linear layers ``dims[i] -> dims[i + 1]`` with ReLU between, in two halves
    (``front``, ``back``: ``nn.Sequential``); with ``graph_break=True``,
    ``torch._dynamo.graph_break()`` between the halves.

    The module itself is user-defined: under ``torch.compile(DDP(model))`` dynamo starts a
    frame at the wrapped module's ``forward`` (DDP's own frames are skipped), and frames in
    torch's files (``nn.Sequential.forward``) are in its skip list, so a bare ``nn.Sequential``
    is not compiled at all; an ``nn.Sequential`` called from a traced ``forward`` is inlined.
    """

    def __init__(self, dims=DIMS, graph_break: bool = False, seed: int = 0):
        super().__init__()
        if len(dims) < 3:
            raise ValueError(f"dims {tuple(dims)}: at least 3 sizes (2 layers), one per half")
        torch.manual_seed(seed)
        layers = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
        half = len(layers) // 2
        self.front = nn.Sequential(*_with_relu(layers[:half]), nn.ReLU())
        self.back = nn.Sequential(*_with_relu(layers[half:]))
        self.graph_break = graph_break
        self.dims = tuple(dims)

    def forward(self, x):
        x = self.front(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.back(x)

    def layers(self) -> list[nn.Linear]:
        return [m for m in self.modules() if isinstance(m, nn.Linear)]


def _with_relu(layers: list[nn.Module]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for i, layer in enumerate(layers):
        out += [layer] if i == len(layers) - 1 else [layer, nn.ReLU()]
    return out


class LoopStack(nn.Module):
    """The same layers in an ``nn.ModuleList`` run by a ``for`` loop, with
    ``torch._dynamo.graph_break()`` inside the loop after the second layer."""

    def __init__(self, dims=DIMS, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dims = tuple(dims)

    def forward(self, x):
        for i, layer in enumerate(self.blocks):
            x = layer(x)
            if i < len(self.blocks) - 1:
                x = torch.relu(x)
            if i == 1:
                torch._dynamo.graph_break()
        return x

    def layers(self) -> list[nn.Linear]:
        return list(self.blocks)


def layer_nbytes(model) -> list[int]:
    """Bytes of each layer's trainable parameters, in forward order (what DDPOptimizer adds
    up: ``param.untyped_storage().nbytes()``)."""
    return [sum(p.untyped_storage().nbytes() for p in layer.parameters() if p.requires_grad)
            for layer in model.layers()]


def predict_parts(nbytes: list[int], bucket_bytes_cap: int,
                  first_bucket_cap: int | None = None) -> list[list[int]]:
    """The subgraphs DDPOptimizer cuts a chain of layers into, as lists of layer indices in
    forward order (``[[0, 1, 2], [3]]``: layers 0-2 in the first part, layer 3 alone).

    ``DDPOptimizer.compile_fn``'s rule for a chain (each layer one node that uses its
    parameters, each feeding the next): walk the layers from the last; before adding a layer,
    start a new bucket if the open one holds at least ``bucket_bytes_cap`` bytes, or, while it
    is the first, at least ``first_bucket_cap``. A last bucket with no parameter bytes is
    merged into the one after it. Pure function.

    Args:
        nbytes: bytes of each layer's parameters, forward order.
        bucket_bytes_cap: DDP's ``bucket_bytes_cap`` (``bucket_cap_mb * 1024 * 1024``).
        first_bucket_cap: None: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB),
            what torch 2.13 passes whatever the cap.

    Raises:
        ValueError: ``first_bucket_cap > bucket_bytes_cap`` (torch asserts the same), or a
            negative size.
    """
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if first_bucket_cap is None else first_bucket_cap
    if first > bucket_bytes_cap:
        raise ValueError(f"first_bucket_cap {first:,} bytes > bucket_bytes_cap "
                         f"{bucket_bytes_cap:,} bytes")
    if any(n < 0 for n in nbytes):
        raise ValueError(f"negative layer size in {list(nbytes)}")
    buckets: list[list[int]] = [[]]  # buckets[0] is the open one (backward order)
    size = 0
    for i in reversed(range(len(nbytes))):
        if buckets[0] and (size >= bucket_bytes_cap or (len(buckets) == 1 and size >= first)):
            buckets.insert(0, [])
            size = 0
        buckets[0].insert(0, i)
        size += nbytes[i]
    if len(buckets) > 1 and sum(nbytes[i] for i in buckets[0]) == 0:
        leading = buckets.pop(0)
        buckets[0][:0] = leading
    return buckets


class CountingBackend:
    """A dynamo backend that counts the graphs it is handed and compiles each with
    ``aot_eager``. Under DDPOptimizer it is handed each subgraph (a *part*)."""

    def __init__(self):
        self.parts = 0
        self._aot_eager = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.parts += 1
        return self._aot_eager(gm, example_inputs)


class Timeline:
    """The order of one backward's events, as tokens: ``[k]`` compiled part k's backward
    starts (parts numbered in forward order), ``lN`` the gradients of layer N (1-based,
    forward order) are all accumulated, ``ARb`` bucket b's all-reduce is launched (its bytes
    in ``sizes``). :meth:`arm` before ``backward()``, :meth:`stop` after it."""

    def __init__(self, model):
        self.tokens: list[str] = []
        self.sizes: list[int] = []
        self.on = False
        self._seen: dict[int, set[str]] = {}
        self._handles: list = []
        for n, layer in enumerate(model.layers(), start=1):
            names = {name for name, _ in layer.named_parameters()}
            for name, p in layer.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda _p, n=n, name=name, names=names: self._grad(n, name, names))

    def _grad(self, n: int, name: str, names: set[str]) -> None:
        if self.on:
            seen = self._seen.setdefault(n, set())
            seen.add(name)
            if seen == names:
                self.tokens.append(f"l{n}")

    def all_reduce(self, nbytes: int, index: int | None = None) -> None:
        """Log a launch (``index`` None: number the launches)."""
        if self.on:
            self.tokens.append(f"AR{len(self.sizes) if index is None else index}")
            self.sizes.append(nbytes)

    def arm(self, loss: torch.Tensor) -> None:
        """Start recording; hook the start of every compiled part's backward in ``loss``'s
        autograd graph (``CompiledFunctionBackward`` nodes, found from the loss: the last
        part first)."""
        self.tokens, self.sizes, self._seen, self.on = [], [], {}, True
        found, seen, queue = [], set(), [loss.grad_fn]
        while queue:
            node = queue.pop(0)
            if node is None or node in seen:
                continue
            seen.add(node)
            if "CompiledFunction" in node.name():
                found.append(node)
            queue.extend(fn for fn, _ in node.next_functions)
        for k, node in enumerate(found):
            label = f"[{len(found) - k}]"
            self._handles.append(node.register_prehook(
                lambda _grads, label=label: self.tokens.append(label) if self.on else None))

    def stop(self) -> list[str]:
        self.on = False
        for h in self._handles:
            h.remove()
        self._handles = []
        return list(self.tokens)


def render(tokens: list[str]) -> list[str]:
    """The timeline as shown: in a run with compiled parts, everything between two part
    starts happens after that part's backward has computed all its gradients and before the
    next part starts, so the hooks' order there says nothing about overlap; it is shown in
    one order: that part's layers (last first), then its all-reduces (in launch order). A
    run with no compiled part (eager) is shown as recorded."""
    if not any(t.startswith("[") for t in tokens):
        return list(tokens)
    out: list[str] = []
    segment: list[str] = []

    def flush():
        layers = sorted((t for t in segment if t.startswith("l")), key=lambda t: -int(t[1:]))
        out.extend(layers + [t for t in segment if t.startswith("AR")])
        segment.clear()

    for t in tokens:
        if t.startswith("["):
            flush()
            out.append(t)
        else:
            segment.append(t)
    flush()
    return out


def overlapped(tokens: list[str]) -> int:
    """All-reduces launched while backward still has compute to do: followed by a compiled
    part's start (``[k]``) or, in a run with no compiled part, by a layer's gradients (an
    eager layer's backward runs just before its gradients arrive)."""
    compiled = any(t.startswith("[") for t in tokens)
    compute = [i for i, t in enumerate(tokens) if t.startswith("[" if compiled else "l")]
    last = compute[-1] if compute else -1
    return sum(1 for i, t in enumerate(tokens) if t.startswith("AR") and i < last)


def partition(tokens: list[str]) -> list[list[int]]:
    """The layers (0-based) whose gradients each compiled part produced, parts in forward
    order: the measured counterpart of :func:`predict_parts`."""
    parts: dict[int, list[int]] = {}
    current = None
    for t in tokens:
        if t.startswith("["):
            current = int(t[1:-1])
            parts[current] = []
        elif t.startswith("l") and current is not None:
            parts[current].append(int(t[1:]) - 1)
    return [sorted(parts[k]) for k in sorted(parts)]


# ------------------------------------------------------------------------------ the runs


def _batch(rank: int, width: int) -> torch.Tensor:
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(100 + rank))


def _two_steps(run, model, timeline: Timeline) -> list[str]:
    """Step 1 (torch's DDP rebuilds its buckets after it), then step 2, recorded."""
    x = _batch(dist.get_rank(), model.dims[0])
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        loss = F.mse_loss(run(x), torch.zeros(BATCH, model.dims[-1]))
        if step == 1:
            timeline.arm(loss)
        loss.backward()
    return timeline.stop()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _summary(tokens: list[str], timeline: Timeline, grads, reference) -> dict:
    return {"timeline": render(tokens), "overlapped": overlapped(tokens),
            "partition": partition(tokens), "bucket_nbytes": list(timeline.sizes),
            "bit_identical": all(torch.equal(a, b) for a, b in zip(grads, reference)),
            "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(grads, reference)),
            "max_abs_grad": max(float(b.abs().max()) for b in reference)}


def _torch_ddp(cap_mb=None):
    """torch's DDP with a comm hook that logs each bucket, then does the default all-reduce
    (``allreduce_hook``: divide by the world size, SUM)."""
    def wrap(model, timeline):
        ddp = DistributedDataParallel(model, **({} if cap_mb is None else
                                                {"bucket_cap_mb": cap_mb}))

        def hook(state, bucket):
            buf = bucket.buffer()
            timeline.all_reduce(buf.numel() * buf.element_size(), bucket.index())
            return default_hooks.allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)
        return ddp
    return wrap


def _ours(cls, **kwargs):
    """The package's NaiveDDP or BucketedDDP, its ``comm_hook`` logging each launch."""
    def wrap(model, timeline):
        def hook(tensor, process_group):
            timeline.all_reduce(tensor.numel() * tensor.element_size())
            return sum_all_reduce(tensor, process_group)
        return cls(model, comm_hook=hook, **kwargs)
    return wrap


def eager_run(make_model, wrap, reference=None) -> dict:
    """Two eager steps of ``wrap(make_model())``; with ``reference`` None the gradients are
    the reference (returned under ``"grads"``). A collective."""
    model = make_model()
    timeline = Timeline(model)
    tokens = _two_steps(wrap(model, timeline), model, timeline)
    grads = _grads(model)
    out = _summary(tokens, timeline, grads, grads if reference is None else reference)
    if reference is None:
        out["grads"] = grads
    return out


def compiled_run(make_model, wrap, reference, optimize_ddp: bool = True) -> dict:
    """Build, wrap, ``torch.compile`` with a :class:`CountingBackend`, run two steps.

    Returns ``dynamo_graphs`` (graphs dynamo captured), ``parts`` (graphs the backend
    compiled: DDPOptimizer's subgraphs), ``graph_breaks`` (each reason's first line -> count)
    and the timeline's summary. A collective.
    """
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        model = make_model()
        timeline = Timeline(model)
        wrapper = wrap(model, timeline)
        backend = CountingBackend()
        tokens = _two_steps(torch.compile(wrapper, backend=backend), model, timeline)
    finally:
        torch._dynamo.config.optimize_ddp = True
    breaks: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = reason.splitlines()[0]
        breaks[key] = breaks.get(key, 0) + n
    return {"dynamo_graphs": counters["stats"]["unique_graphs"], "parts": backend.parts,
            "graph_breaks": breaks, "bucket_bytes_cap": getattr(wrapper, "bucket_bytes_cap", None),
            **_summary(tokens, timeline, _grads(model), reference)}


def split_runs(dims, reference, caps_mb=CAPS_MB) -> list[dict]:
    """torch's DDP compiled at each cap of ``caps_mb``, with ``optimize_ddp=False``, and at
    :data:`BAD_CAP_MB` (the compile fails). A collective."""
    sizes = layer_nbytes(Stack(dims))
    runs = []
    for cap_mb in caps_mb:
        run = compiled_run(lambda: Stack(dims), _torch_ddp(cap_mb), reference)
        run.update(label=f"bucket_cap_mb={cap_mb}", cap_mb=cap_mb,
                   predicted=predict_parts(sizes, run["bucket_bytes_cap"]))
        runs.append(run)
    run = compiled_run(lambda: Stack(dims), _torch_ddp(), reference, optimize_ddp=False)
    run.update(label="optimize_ddp=False", cap_mb=None, predicted=[list(range(len(sizes)))])
    runs.append(run)
    try:
        compiled_run(lambda: Stack(dims), _torch_ddp(BAD_CAP_MB), reference)
        error = None
    except AssertionError as exc:
        error = f"{type(exc).__name__}: {exc}"
    runs.append({"label": f"bucket_cap_mb={BAD_CAP_MB}", "cap_mb": BAD_CAP_MB, "error": error})
    return runs


def break_runs(dims, reference) -> dict:
    """What a graph break costs: one between the two halves, one inside a loop; ``explain``
    on the DDP model; a bare ``nn.Sequential`` under DDP. A collective."""
    sizes = layer_nbytes(Stack(dims))
    half = len(sizes) // 2
    cap = DistributedDataParallel(Stack(dims)).bucket_bytes_cap
    # each dynamo graph is split on its own: the front half in one graph, the back in the next
    predicted = predict_parts(sizes[:half], cap) + [
        [half + i for i in part] for part in predict_parts(sizes[half:], cap)]
    between = compiled_run(lambda: Stack(dims, graph_break=True), _torch_ddp(), reference)
    between["predicted"] = predicted
    out = {"between": between,
           "loop": compiled_run(lambda: LoopStack(dims), _torch_ddp(), reference)}
    torch._dynamo.reset()
    x = _batch(dist.get_rank(), dims[0])
    explained = torch._dynamo.explain(DistributedDataParallel(Stack(dims)))(x)
    out["explain"] = {"graph_count": explained.graph_count,
                      "graph_break_count": explained.graph_break_count,
                      "reasons": sorted({b.reason.splitlines()[0].split(" (")[0]
                                         for b in explained.break_reasons})}
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    seq = nn.Sequential(*Stack(dims).layers())
    backend = CountingBackend()
    torch.compile(DistributedDataParallel(seq), backend=backend)(x).sum().backward()
    out["sequential"] = {"dynamo_graphs": counters["stats"]["unique_graphs"],
                         "parts": backend.parts}
    return out


def wrapper_runs(dims, reference) -> dict:
    """The package's NaiveDDP and BucketedDDP (per-parameter hooks), eager and compiled."""
    out = {}
    for name, wrap in (("NaiveDDP", _ours(NaiveDDP)),
                       ("BucketedDDP", _ours(BucketedDDP, bucket_cap_mb=1))):
        out[name] = {"eager": eager_run(lambda: Stack(dims), wrap, reference),
                     "compiled": compiled_run(lambda: Stack(dims), wrap, reference)}
    return out


def run(dims=DIMS, parts=("split", "breaks", "wrappers"), caps_mb=CAPS_MB) -> dict:
    """Every scenario of ``parts`` in this process group (a collective: call on every rank)."""
    # dynamo warns once per process that DDP's record_function "will be ignored"
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    eager = eager_run(lambda: Stack(dims), _torch_ddp())
    reference = eager.pop("grads")
    # the same eager DDP with other buckets: does the bucket layout alone change the bits?
    eager["other_buckets"] = eager_run(lambda: Stack(dims), _torch_ddp(OTHER_CAP_MB), reference)
    result = {"world_size": dist.get_world_size(), "dims": list(dims),
              "layer_nbytes": layer_nbytes(Stack(dims)),
              "first_bucket_cap": dist._DEFAULT_FIRST_BUCKET_BYTES, "eager": eager}
    if "split" in parts:
        result["split"] = split_runs(dims, reference, caps_mb)
    if "breaks" in parts:
        result["breaks"] = break_runs(dims, reference)
    if "wrappers" in parts:
        result["wrappers"] = wrapper_runs(dims, reference)
    return result


# ------------------------------------------------------------------------------ the report


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _runs_line(run: dict) -> str:
    return f"{_n(len(run['bucket_nbytes']), 'all-reduce')}, {run['overlapped']} overlapped"


def _timeline_lines(run: dict) -> list[str]:
    return ["  " + " ".join(run["timeline"]),
            "  sizes (bytes): " + " ".join(f"{n:,}" for n in run["bucket_nbytes"])]


def _compared(res: dict) -> list[dict]:
    """Every run whose gradients were compared with eager torch DDP's."""
    runs = [r for r in res.get("split", []) if "error" not in r]
    if "breaks" in res:
        runs += [res["breaks"]["between"], res["breaks"]["loop"]]
    for pair in res.get("wrappers", {}).values():
        runs += [pair["eager"], pair["compiled"]]
    return runs


def report_model(res: dict) -> list[str]:
    """The model, DDPOptimizer's first cap, the timeline's legend, eager DDP's backward."""
    sizes = res["layer_nbytes"]
    return [f"model: {len(sizes)} Linear layers, features {'-'.join(map(str, res['dims']))};"
            f" aot_eager; {res['world_size']} ranks",
            "bytes per layer: " + " ".join(f"{n:,}" for n in sizes),
            f"DDPOptimizer's first bucket: {res['first_bucket_cap']:,} bytes, any bucket_cap_mb",
            "backward of step 2: [k] part k starts, lN layer N's grads, ARb all-reduce b sent",
            f"eager DDP: no parts; {_runs_line(res['eager'])}", *_timeline_lines(res["eager"])]


def report_split(res: dict) -> list[str]:
    """Each cap: parts (and DDPOptimizer's rule's prediction), all-reduces, the timeline."""
    lines = []
    for run in res["split"]:
        if "error" in run:
            kind, _, message = run["error"].partition(": ")
            lines += [f"{run['label']}: the compile fails, {kind} in DDPOptimizer",
                      f'  "{message}"']
            continue
        predicted = "" if run["label"].startswith("optimize") else (
            f" (predicted {len(run['predicted'])})")
        lines += [f"{run['label']}: {_n(run['parts'], 'part')}{predicted}; {_runs_line(run)}",
                  *_timeline_lines(run)]
    return lines


def report_gradients(res: dict) -> list[str]:
    """Every other run's gradients against eager torch DDP's, bit for bit."""
    runs = _compared(res)
    same = sum(r["bit_identical"] for r in runs)
    worst = max(r["max_abs_diff"] for r in runs)
    other = res["eager"]["other_buckets"]
    return [f"gradients vs eager DDP's: bit-identical in {same} of {len(runs)} runs, "
            f"max |diff| = {worst:.1e}",
            f"eager DDP, bucket_cap_mb={OTHER_CAP_MB} "
            f"({_n(len(other['bucket_nbytes']), 'bucket')}): bit-identical "
            f"{other['bit_identical']}, max |diff| = {other['max_abs_diff']:.1e}"]


def report_wrappers(res: dict) -> list[str]:
    """The package's wrappers, eager and compiled."""
    lines = []
    for name, pair in res["wrappers"].items():
        e, c = pair["eager"], pair["compiled"]
        lines += [f"{name} eager: {_runs_line(e)}", "  " + " ".join(e["timeline"]),
                  f"{name} compiled: {_n(c['dynamo_graphs'], 'dynamo graph')}, "
                  f"{_n(sum(c['graph_breaks'].values()), 'graph break')}, "
                  f"{_n(c['parts'], 'part')}; {_runs_line(c)}", "  " + " ".join(c["timeline"])]
    return lines


def report_breaks(res: dict) -> list[str]:
    """What a graph break costs, in counts."""
    b = res["breaks"]
    base = next(r for r in res.get("split", [b["loop"]]) if "graph_breaks" in r)
    own = sum(n for reason, n in base["graph_breaks"].items() if reason != DELIBERATE)
    between, loop, ex, seq = b["between"], b["loop"], b["explain"], b["sequential"]
    deliberate = between["graph_breaks"].get(DELIBERATE, 0)
    return [
        f"DDP's own forward: {_n(own, 'graph break')} (no tensor op there: no graph)",
        f"break between the halves: {_n(between['dynamo_graphs'], 'dynamo graph')}, "
        f"{_n(between['parts'], 'part')} (predicted {len(between['predicted'])}), "
        f"{_n(deliberate, 'deliberate break')}",
        *_timeline_lines(between),
        f"break inside a loop: {_n(loop['dynamo_graphs'], 'dynamo graph')}, "
        f"{_n(loop['parts'], 'part')} (frame skipped, run eagerly)",
        "  " + " ".join(loop["timeline"]),
        f"explain(DDP model): graph_count {ex['graph_count']}, "
        f"graph_break_count {ex['graph_break_count']}",
        *(f"  reason: {r}" for r in ex["reasons"]),
        f"DDP(nn.Sequential): {_n(seq['dynamo_graphs'], 'dynamo graph')}, "
        f"{_n(seq['parts'], 'part')} (nothing compiled)",
    ]


#: The report's sections, in order; each needs the parts of :func:`run` it names.
SECTIONS = {"model": report_model, "split": report_split, "gradients": report_gradients,
            "breaks": report_breaks, "wrappers": report_wrappers}


def report(res: dict, sections=None) -> list[str]:
    """Rank 0's lines: facts and counts, the same on every machine, each at most 91
    characters (``[rank 0] `` makes 100). ``sections``: names of :data:`SECTIONS` (None: each
    one whose results ``res`` holds)."""
    if sections is None:
        sections = [k for k in SECTIONS if k in ("model", "gradients") or k in res]
    return [line for name in sections for line in SECTIONS[name](res)]


def load(path) -> dict:
    """The results :func:`main` wrote with ``--out``."""
    return json.loads(Path(path).read_text())


def _number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() else value


def main(argv=None) -> dict:
    """Parse options, run, print rank 0's lines, write ``--out`` (rank 0)."""
    from ddp_lesson.env import init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default=",".join(map(str, DIMS)),
                   help="features between layers, comma-separated (at least 3)")
    p.add_argument("--caps", default=",".join(str(c).lower() for c in CAPS_MB),
                   help="bucket_cap_mb values of the sweep, comma-separated ('none': default)")
    p.add_argument("--part", choices=("split", "breaks", "wrappers", "all"), default="all")
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0)")
    p.add_argument("--report", default=None,
                   help=f"comma-separated sections to print, of {', '.join(SECTIONS)} "
                        "(default: every one the run has)")
    args = p.parse_args(argv)
    dims = tuple(int(d) for d in args.dims.split(","))
    caps = tuple(None if c == "none" else _number(c) for c in args.caps.split(","))
    owns_group = not dist.is_initialized()
    if owns_group:
        init_distributed(backend="gloo", announce=False)
    parts = ("split", "breaks", "wrappers") if args.part == "all" else (args.part,)
    res = run(dims, parts, caps)
    if dist.get_rank() == 0:
        for line in report(res, None if args.report is None else args.report.split(",")):
            print(line, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res))
    gc.collect()  # the DDP wrappers hold the process group: free them before it goes
    if owns_group:
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
