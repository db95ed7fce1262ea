"""torch's own DDP seen from inside: real buckets, pre-division, comm hooks, static_graph and
gradient_as_bucket_view (notebooks/deep/04_inside_torchs_ddp.ipynb, a deep dive of notebook 04).

    torchrun --standalone --nproc-per-node 2 -m ddp_lesson.labs.torch_reducer \\
        [--part reducer|hooks|all] [--out FILE]

Each function below is one scenario run under torch's ``DistributedDataParallel`` on the
current process group (gloo on CPU; every tensor here is a CPU tensor, so it also runs
unchanged on a GPU machine through gloo). Every function is a collective: call it on every
rank, in the same order. ``main`` prints rank 0's facts (rounded, so the output is the same
on every machine) and, with ``--out``, writes every number as JSON for the tests.

Sources (torch 2.13): ``torch/nn/parallel/distributed.py`` (``_BucketCapacityConfig``: one
bucket in the first iteration unless ``find_unused_parameters``; ``register_comm_hook``;
``_check_comm_hook``'s bf16 refusal), ``torch/csrc/distributed/c10d/reducer.hpp``
(``div_factor_``, ``kDefaultFirstBucketBytes``), and
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` ("Apply the division first
to avoid overflow, especially for FP16").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddp_lesson.core.bucketed_ddp import MB, assign_buckets, bucket_size_limits

__all__ = [
    "HOOKS",
    "bf16_build_supports",
    "bf16_refusal",
    "bucket_view_run",
    "comm_hooks_run",
    "division_overflow",
    "main",
    "make_stack",
    "real_buckets",
    "static_graph_run",
]

#: The stack of deep dive 04 · inside torch's DDP: 8 Linear(256, 256) layers, 16 parameter
#: tensors, 2,105,344 bytes.
STACK_LAYERS, STACK_WIDTH = 8, 256
#: The bucket cap of that deep dive's run (MB as torch counts them: 1024 * 1024 bytes).
CAP_MB = 0.5
#: A float16 gradient value whose SUM over 2 ranks (80,000) passes float16's largest
#: finite number, 65,504.
BIG_FP16 = 40000.0


def make_stack(
    layers: int = STACK_LAYERS, width: int = STACK_WIDTH, seed: int = 0
) -> nn.Sequential:
    """``layers`` Linear(width, width) with ReLU between them; 2 parameter tensors per layer."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _parse_sizes(text) -> list[int] | None:
    """torch's logger stores lists as text: ``"526336, 526336"`` -> ``[526336, 526336]``."""
    return None if text is None else [int(v) for v in str(text).split(",")]


def _parse_indices(text) -> list[list[int]] | None:
    """``"15 14 13 12, 11 10 9 8"`` -> ``[[15, 14, 13, 12], [11, 10, 9, 8]]``."""
    return None if text is None else [[int(v) for v in b.split()] for b in str(text).split(",")]


def real_buckets(bucket_cap_mb: float = CAP_MB, iterations: int = 3) -> dict:
    """Read torch's buckets from ``DistributedDataParallel._get_ddp_logging_data()``.

    Wraps :func:`make_stack` with ``bucket_cap_mb`` and runs ``iterations`` forward and
    backward passes (a collective). In torch 2.13 the first iteration uses **one** bucket
    (without ``find_unused_parameters`` the initial limit is ``sys.maxsize``: see
    ``_BucketCapacityConfig.compute_bucket_size_limits``); the Reducer records the order in
    which gradients arrived and rebuilds its buckets with the cap before the second
    iteration's forward (``DistributedDataParallel._pre_forward`` calls
    ``reducer._rebuild_buckets()``); the logger reports the rebuilt ones from the third
    iteration on. ``ours`` is :func:`assign_buckets` walked in that ready order with
    :func:`bucket_size_limits`, as the rebuild does.

    Returns:
        ``{"iterations": [{"bucket_sizes": [bytes...], "rebuilt_bucket_sizes": [bytes...] or
        None, "rebuilt_per_bucket_param_indices": [[index...]...] or None,
        "grad_ready_order": [index...] or None}, ...], "ours": assign_buckets(...) (lists of
        indices), "ours_sizes": [bytes...], "num_tensors": int, "cap_bytes": int}``.
    """
    model = make_stack()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    per_iter = []
    for _ in range(iterations):
        ddp(torch.randn(4, STACK_WIDTH, generator=g)).sum().backward()
        d = ddp._get_ddp_logging_data()
        ready = d.get("prev_iteration_grad_ready_order_indices")  # "15, 14, ..." like sizes
        per_iter.append(
            {
                "bucket_sizes": _parse_sizes(d.get("bucket_sizes")),
                "rebuilt_bucket_sizes": _parse_sizes(d.get("rebuilt_bucket_sizes")),
                "rebuilt_per_bucket_param_indices": _parse_indices(
                    d.get("rebuilt_per_bucket_param_indices")
                ),
                "grad_ready_order": _parse_sizes(ready),
            }
        )
    nbytes = [p.numel() * p.element_size() for p in model.parameters()]
    cap = int(bucket_cap_mb * MB)
    ready = per_iter[-1]["grad_ready_order"] or list(range(len(nbytes)))[::-1]
    ours = assign_buckets(nbytes, bucket_size_limits(bucket_cap_mb), order=ready)
    return {"iterations": per_iter, "ours": ours,
            "ours_sizes": [sum(nbytes[i] for i in b) for b in ours],
            "num_tensors": len(nbytes), "cap_bytes": cap}


class _Scale(nn.Module):
    """``forward(x) = w * x`` with one float16 weight ``w = 1``: d(out.sum())/dw = sum(x)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones((), dtype=torch.float16))

    def forward(self, x):
        return self.w * x


def division_overflow(value: float = BIG_FP16) -> dict:
    """Sum vs pre-divided sum of a float16 gradient ``value`` on every rank (a collective).

    Returns:
        ``{"world_size": R, "value": value, "sum": SUM all-reduce of value (inf for R=2),
        "post_divided": that sum / R (still inf), "pre_divided": SUM of value / R (= value),
        "torch_ddp": the gradient torch's DDP gives a float16 weight whose local gradient is
        value on every rank (no hook: the Reducer's own path)}``.
    """
    R = dist.get_world_size()
    t = torch.full((4,), value, dtype=torch.float16)
    summed = t.clone()
    dist.all_reduce(summed)                       # SUM, then divide (post-division)
    post = summed / R
    pre = t / R
    dist.all_reduce(pre)                          # divide, then SUM (pre-division)
    model = _Scale()
    ddp = DistributedDataParallel(model)
    ddp(torch.tensor(value, dtype=torch.float16)).backward()
    return {"world_size": R, "value": value, "sum": summed[0].item(),
            "post_divided": post[0].item(), "pre_divided": pre[0].item(),
            "torch_ddp": model.w.grad.item()}


class _CheckpointedTwice(nn.Module):
    """Layer ``l`` applied twice, each use in a reentrant checkpoint; ``unused`` never used.

    Each reentrant checkpoint runs a backward of its own inside the outer one, and ``l``'s
    gradient hook fires once per checkpointed use: twice per iteration here (one checkpointed
    use would fire it once); ``unused`` never gets a gradient. Without ``static_graph``
    torch's DDP stops at the second hook ("Expected to mark a variable ready only once").
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        x = checkpoint(self.l, x, use_reentrant=True)
        return checkpoint(self.l, x, use_reentrant=True)


def _global_batch(step: int, n: int, features: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, features, generator=g)


def static_graph_run(iterations: int = 2) -> dict:
    """:class:`_CheckpointedTwice` under torch's DDP without and with ``static_graph=True``.

    A collective. Each rank uses its own 2 rows of a global batch of ``2 * R`` rows.

    Returns:
        ``{"default_error": first sentence of the RuntimeError without the flag (or None),
        "static_ok": iterations finished with the flag, "static_max_diff": largest |Δ| between
        the flagged run's last ``l.weight.grad`` and the exact average of the ranks' local
        gradients, "unused_grad_is_none": whether ``unused.weight.grad`` stayed None}``.
    """
    rank, R = dist.get_rank(), dist.get_world_size()

    def local_x(step):
        return _global_batch(step, 2 * R, 8)[2 * rank:2 * rank + 2].requires_grad_()

    error = None
    ddp = DistributedDataParallel(_CheckpointedTwice())
    try:
        for step in range(iterations):
            ddp(local_x(step)).sum().backward()
    except RuntimeError as exc:  # raised on every rank at the same hook, before any bucket is sent
        error = str(exc).split(". ")[0] + "."
    del ddp
    model = _CheckpointedTwice()
    ddp = DistributedDataParallel(model, static_graph=True)
    done = 0
    for step in range(iterations):
        model.zero_grad(set_to_none=True)
        ddp(local_x(step)).sum().backward()
        done += 1
    reference = _CheckpointedTwice()            # the same weights: same seed, no updates
    reference(local_x(iterations - 1)).sum().backward()
    exact = reference.l.weight.grad.clone()
    dist.all_reduce(exact)
    exact /= R
    return {"default_error": error, "static_ok": done,
            "static_max_diff": (model.l.weight.grad - exact).abs().max().item(),
            "unused_grad_is_none": model.unused.weight.grad is None}


def bucket_view_run(iterations: int = 3) -> dict:
    """Where ``.grad`` lives, with ``gradient_as_bucket_view`` False and True (a collective).

    Wraps :func:`make_stack` (cap :data:`CAP_MB`), runs ``iterations`` steps (past the bucket
    rebuild), and records every bucket's flat buffer in the last one through a comm hook that
    is torch's own ``allreduce_hook`` plus a note of ``bucket.buffer()``'s address range.

    Returns:
        ``{False: info, True: info}`` with ``info = {"grads_in_buckets": how many of the
        parameters' .grad start inside a bucket buffer's address range, "num_grads": 16,
        "grad_bytes": bytes of the separate .grad storages (those not inside a bucket),
        "bucket_bytes": bytes of all bucket buffers, "max_diff_vs_copy": largest |Δ| between
        the two settings' gradients (0 when identical)}``.
    """
    out, grads = {}, {}
    for view in (False, True):
        model = make_stack()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=view)
        buffers: dict[int, tuple[int, int]] = {}

        def hook(state, bucket, buffers=buffers):
            b = bucket.buffer()
            buffers[bucket.index()] = (b.data_ptr(), b.numel() * b.element_size())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        for _ in range(iterations):
            buffers.clear()
            model.zero_grad(set_to_none=False)  # keep .grad (a bucket view stays a view)
            ddp(torch.randn(4, STACK_WIDTH, generator=g)).sum().backward()
        ranges = list(buffers.values())
        inside = [
            any(lo <= p.grad.data_ptr() < lo + n for lo, n in ranges) for p in model.parameters()
        ]
        separate = sum(p.grad.numel() * p.grad.element_size()
                       for p, ins in zip(model.parameters(), inside) if not ins)
        out[view] = {"grads_in_buckets": sum(inside), "num_grads": len(inside),
                     "grad_bytes": separate, "bucket_bytes": sum(n for _, n in ranges)}
        grads[view] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        del ddp
    out[True]["max_diff_vs_copy"] = (grads[True] - grads[False]).abs().max().item()
    return out


def bf16_refusal() -> str | None:
    """torch's answer to ``register_comm_hook(None, bf16_compress_hook)`` on this process group.

    Not a collective. Returns ``"TypeError: <torch's message>"`` when torch refuses, None when
    it accepts. Which it is depends on the build, not the backend (:func:`bf16_build_supports`):
    a CPU build refuses, a CUDA build with NCCL 2.10+ accepts, even on gloo.
    """
    ddp = DistributedDataParallel(nn.Linear(4, 4))
    try:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as exc:
        return f"TypeError: {exc}"
    return None


def bf16_build_supports() -> bool:
    """Whether this torch *build* passes the test that ``_check_comm_hook`` applies to
    ``bf16_compress_hook`` (``DistributedDataParallel._check_comm_hook``,
    ``torch/nn/parallel/distributed.py``): CUDA or ROCm with NCCL 2.10 or later, or XCCL with
    an XPU. The backend of the process group is not part of it. Local; no communication.
    """
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return (cuda and nccl) or xccl


# --------------------------------------------------------------------------- comm hooks

#: The hooks compared: name -> (torch's hook, PowerSGD rank or None).
HOOKS = {"allreduce_hook": (default_hooks.allreduce_hook, None),
         "fp16_compress_hook": (default_hooks.fp16_compress_hook, None),
         "PowerSGD rank 1": (powerSGD_hook.powerSGD_hook, 1),
         "PowerSGD rank 4": (powerSGD_hook.powerSGD_hook, 4)}
#: PowerSGD runs plain all-reduces before this step (torch's minimum with error feedback: 2).
POWERSGD_START = 2


class _ByteCounter:
    """Counts the bytes handed to ``dist.all_reduce`` while active (payload per rank)."""

    def __init__(self):
        self.nbytes = 0
        self._orig = dist.all_reduce

    @contextlib.contextmanager
    def active(self):
        def counting(tensor, *args, **kwargs):
            self.nbytes += tensor.numel() * tensor.element_size()
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = counting      # torch's hooks call dist.all_reduce at call time
        try:
            yield self
        finally:
            dist.all_reduce = self._orig


def _hook_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))


def _regression_batch(step: int, n: int):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(n, 32, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5]
    return x, y


def comm_hooks_run(steps: int = 20, per_rank: int = 16, lr: float = 0.1) -> list[dict]:
    """Train the same small MLP with each of :data:`HOOKS` under torch's DDP (a collective).

    Every hook sees the same data and start. A wrapper around the hook first computes the
    exact average of the bucket (an uncounted float32 all-reduce of a copy) and, when the
    hook's future completes, the relative error ``||approx - exact|| / ||exact||`` over the
    whole step; the bytes the hook hands to ``dist.all_reduce`` are counted per step.

    Returns:
        One dict per hook: ``{"hook", "bytes_first": bytes in step 0, "bytes_last": bytes in
        the last step, "grad_bytes": float32 gradient bytes, "rel_error_last": relative error
        of the averaged gradient in the last step, "loss_first" / "loss_last": mean loss over
        the global batch in the first / last step (before its update)}``.
    """
    rank, R = dist.get_rank(), dist.get_world_size()
    orig_all_reduce = dist.all_reduce  # uncounted: the exact reference and the loss
    results = []
    for name, (hook, matrix_rank) in HOOKS.items():
        model = _hook_model()
        ddp = DistributedDataParallel(model)
        if matrix_rank is None:
            state = None
        else:
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=matrix_rank,
                start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True,
                random_seed=0)
        errs: dict[str, float] = {"num": 0.0, "den": 0.0}
        counter = _ByteCounter()

        def measured(state, bucket, hook=hook, errs=errs):
            exact = bucket.buffer().clone()
            orig_all_reduce(exact)
            exact /= R

            def note(fut):
                value = fut.value()
                errs["num"] += (value - exact).pow(2).sum().item()
                errs["den"] += exact.pow(2).sum().item()
                return value

            return hook(state, bucket).then(note)

        ddp.register_comm_hook(state, measured)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        per_step_bytes, losses = [], []
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for step in range(steps):
            x, y = _regression_batch(step, per_rank * R)
            xs, ys = x[mine], y[mine]
            errs["num"] = errs["den"] = 0.0
            before = counter.nbytes
            opt.zero_grad()
            loss = F.mse_loss(ddp(xs), ys)
            with counter.active():
                loss.backward()
            per_step_bytes.append(counter.nbytes - before)
            opt.step()
            mean_loss = loss.detach().clone()
            orig_all_reduce(mean_loss)
            losses.append(mean_loss.item() / R)
        results.append({"hook": name, "bytes_first": per_step_bytes[0],
                        "bytes_last": per_step_bytes[-1],
                        "grad_bytes": sum(p.numel() * 4 for p in model.parameters()),
                        "rel_error_last": math.sqrt(errs["num"] / errs["den"]),
                        "loss_first": losses[0], "loss_last": losses[-1]})
        del ddp
    return results


# --------------------------------------------------------------------------- main

def _say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _fmt_sizes(sizes) -> str:
    return "[" + ", ".join(f"{s:,}" for s in sizes) + "]"


def report_reducer(res: dict) -> None:
    """Print the facts of :func:`real_buckets`, :func:`division_overflow`,
    :func:`static_graph_run`, :func:`bucket_view_run` (rank 0)."""
    b = res["buckets"]
    first, last = b["iterations"][0], b["iterations"][-1]
    _say(f"buckets: {b['num_tensors']} parameter tensors, bucket_cap_mb = {CAP_MB:g} "
         f"({b['cap_bytes']:,} bytes)")
    _say(f"  iteration 1: bucket_sizes = {_fmt_sizes(first['bucket_sizes'])} "
         f"({len(first['bucket_sizes'])} bucket)")
    _say(f"  iteration {len(b['iterations'])}: rebuilt_bucket_sizes = "
         f"{_fmt_sizes(last['rebuilt_bucket_sizes'])}")
    _say("  rebuilt_per_bucket_param_indices = "
         + str(last["rebuilt_per_bucket_param_indices"]).replace(" ", ""))
    _say(f"  our assign_buckets:               {str(b['ours']).replace(' ', '')}")
    _say(f"  same buckets: {b['ours'] == last['rebuilt_per_bucket_param_indices']}, same sizes: "
         f"{b['ours_sizes'] == last['rebuilt_bucket_sizes']}")
    d = res["division"]
    _say(f"float16 gradient {d['value']:,.0f} on each of {d['world_size']} ranks "
         f"(float16 max 65,504):")
    _say(f"  SUM all-reduce = {d['sum']}, then / {d['world_size']} = {d['post_divided']}")
    _say(f"  / {d['world_size']} first, then SUM = {d['pre_divided']:,.0f}")
    _say(f"  torch's DDP on a float16 weight: grad = {d['torch_ddp']:,.0f}")
    s = res["static_graph"]
    _say("static_graph: one layer twice under reentrant checkpointing, one layer unused")
    _say(f"  default:           {s['default_error']}")
    _say(f"  static_graph=True: {s['static_ok']} iterations; l.weight.grad = exact average "
         f"(|Δ| < 1e-06): {s['static_max_diff'] < 1e-6}")
    _say(f"                     unused.weight.grad is None: {s['unused_grad_is_none']}")
    v = res["bucket_view"]
    for view in (False, True):
        i = v[view]
        _say(f"gradient_as_bucket_view={view!s:<5}: {i['grads_in_buckets']:2d} of {i['num_grads']} "
             f".grad inside a bucket, .grad memory {i['grad_bytes']:,} B")
    same_buckets = v[False]["bucket_bytes"] == v[True]["bucket_bytes"]
    _say(f"  buckets {v[True]['bucket_bytes']:,} B either way: {same_buckets}; bytes saved: "
         f"{v[False]['grad_bytes'] - v[True]['grad_bytes']:,}; same gradients: "
         f"{v[True]['max_diff_vs_copy'] < 1e-6}")


def error_order(x: float) -> str:
    """``x``'s order of magnitude, ``"~1e-04"`` for 3.5e-04 (``"0"`` for 0). The digits below
    it vary from machine to machine (seen: 3.5e-04 and 3.6e-04 for the fp16 hook), the order
    does not."""
    return "0" if x == 0 else f"~1e{math.floor(math.log10(x)):+03d}"


def report_hooks(res: dict) -> None:
    """Print :func:`comm_hooks_run` and whether :func:`bf16_refusal` follows
    :func:`bf16_build_supports` (rank 0; torch's own answer to stderr)."""
    rows = res["hooks"]
    steps = res["steps"]
    _say(f"{'hook':<19} {'bytes/step':>10} {'vs fp32':>7} {'grad error':>10} "
         f"{'loss @ 1':>8} {f'loss @ {steps}':>9}")
    for r in rows:
        _say(f"{r['hook']:<19} {r['bytes_last']:>10,} {r['bytes_last'] / r['grad_bytes']:>7.3f} "
             f"{error_order(r['rel_error_last']):>10} {r['loss_first']:>8.4f} "
             f"{r['loss_last']:>9.4f}")
    _say(f"(PowerSGD sent plain all-reduces for its first {POWERSGD_START} steps: "
         f"{rows[2]['bytes_first']:,} bytes in step 1)")
    # Whether torch refuses, and its words, depend on the build (a CPU build refuses, a CUDA
    # build accepts): the printed fact holds on every build; torch's answer goes to stderr.
    _say("bf16_compress_hook on gloo/CPU:")
    _say(f"  refused exactly where the build lacks CUDA+NCCL and XPU+XCCL: "
         f"{(res['bf16'] is not None) != res['bf16_build']}")
    if dist.get_rank() == 0:
        print(f"bf16_compress_hook: {res['bf16'] or 'accepted'}", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("reducer", "hooks", "all"), default="all")
    p.add_argument("--steps", type=int, default=20, help="training steps per comm hook")
    p.add_argument("--out", default=None, help="write every number as JSON here (rank 0)")
    args = p.parse_args(argv)
    owns_group = not dist.is_initialized()
    if owns_group:
        from ddp_lesson.env import init_distributed
        init_distributed(backend="gloo", announce=False)
    res: dict = {}
    if args.part in ("reducer", "all"):
        res["buckets"] = real_buckets()
        res["division"] = division_overflow()
        res["static_graph"] = static_graph_run()
        res["bucket_view"] = bucket_view_run()
        report_reducer(res)
    if args.part in ("hooks", "all"):
        res["steps"] = args.steps
        res["hooks"] = comm_hooks_run(args.steps)
        res["bf16"] = bf16_refusal()
        res["bf16_build"] = bf16_build_supports()
        report_hooks(res)
    if args.out and dist.get_rank() == 0:
        from pathlib import Path
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, default=str)
    if owns_group:
        dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
