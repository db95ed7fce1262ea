"""DDP's edge cases from public bug reports: torch's DDP, and the cores of notebook 04.

    torchrun --standalone --nproc-per-node 2 tests/programs/ddp_edge_cases.py [SCENARIO ...]

Each scenario runs the same inputs through torch's ``DistributedDataParallel`` (where it
neither hangs nor breaks the process group) and through the cores ``NaiveDDP`` and
``BucketedDDP`` of ``ddp_lesson/core/`` where they take the case, and prints one JSON line
per scenario and rank: ``{"scenario": ..., "rank": r, ...}`` where each entry is a number
list, or ``["error", type, message]``. World size 2, gloo; tests/ddp/test_ddp_edge_cases.py
reads the lines and asserts the values (docs/pitfalls.md B15-B24, B31-B33).
"""
from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP

CORES = {"core naive": NaiveDDP, "core bucketed": BucketedDDP}
WRAPPERS = {"torch": DistributedDataParallel, **CORES}


def _scalar(bias: bool = False) -> nn.Linear:
    m = nn.Linear(1, 1, bias=bias)
    with torch.no_grad():
        m.weight.fill_(1.0)
    return m


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return ["error", type(e).__name__, str(e)]


def different_models(rank):
    """Case 1: rank 0 and rank 1 wrap different models (the cores' check; torch's DDP raises
    on the differing rank only, and the other waits)."""
    out = {}
    for v, cls in CORES.items():
        out[v + " out_features"] = _try(
            lambda cls=cls: cls(nn.Linear(4, 3 if rank == 0 else 2)) and [])
        out[v + " transposed"] = _try(  # weight (3, 4) vs (4, 3): equal element counts
            lambda cls=cls: cls(nn.Linear(4, 3, bias=False) if rank == 0
                                else nn.Linear(3, 4, bias=False)) and [])

        def frozen(cls=cls):
            m = nn.Linear(4, 3)
            if rank == 1:
                m.requires_grad_(False)
            return cls(m) and []
        out[v + " no trainable on rank 1"] = _try(frozen)
    return out


class BufferEMA(nn.Module):
    """``self.buf = 0.5 * self.buf + 0.5 * x.mean()``: a new buffer tensor every forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.register_buffer("buf", torch.tensor(3.0))

    def forward(self, x):
        self.buf = 0.5 * self.buf + 0.5 * x.mean().detach()
        return (self.w * x).sum()


def buffers_reassigned(rank):
    """Case 3: 3 steps, x = rank + 2; torch broadcasts rank 0's buffer before each forward
    (``broadcast_buffers=True``), the cores at construction only."""
    out = {}
    for v, cls in WRAPPERS.items():
        for bb in (True, False) if v == "torch" else (None,):
            m = BufferEMA()
            with torch.no_grad():
                m.buf.fill_(3.0 + 10 * rank)  # differs per rank: shows what init broadcasts
            ddp = cls(m) if bb is None else cls(m, broadcast_buffers=bb)
            for _ in range(3):
                ddp(torch.full((2,), float(rank + 2))).backward()
            out[v if bb is None else f"{v} broadcast_buffers={bb}"] = [round(m.buf.item(), 6)]
    return out


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(_scalar(), _scalar())

    def forward(self, x):
        y = self.net(x)
        if hasattr(self, "extra"):
            y = y * self.extra
        return y.sum()


def unfrozen_after_wrapping(rank):
    """Case 4: net[0].weight frozen, wrapped, unfrozen; a parameter added after wrapping; one
    frozen after wrapping; x = 1 on rank 0, 3 on rank 1. Each entry: the changed parameter's
    gradient."""
    out = {}
    x = torch.full((1, 1), 1.0 if rank == 0 else 3.0)
    for v, cls in WRAPPERS.items():
        m = TwoLayer()
        m.net[0].weight.requires_grad_(False)
        ddp = cls(m)
        m.net[0].weight.requires_grad_(True)

        def step(ddp=ddp, m=m):
            ddp(x).backward()
            return [m.net[0].weight.grad.item()]
        out[v + " unfrozen"] = _try(step)
        m = TwoLayer()
        ddp = cls(m)
        m.extra = nn.Parameter(torch.ones(1))
        out[v + " added"] = _try(lambda ddp=ddp, m=m: ddp(x).backward() or [m.extra.grad.item()])
        # the opposite: frozen after wrapping (ShiqiYu/OpenGait#230); its .grad (None: none)
        m = TwoLayer()
        ddp = cls(m)
        m.net[0].weight.requires_grad_(False)
        out[v + " frozen"] = _try(lambda ddp=ddp, m=m: ddp(x).backward() or [
            None if m.net[0].weight.grad is None else m.net[0].weight.grad.item()])
    return out


class AB(nn.Module):
    """``which`` = "a", "b" or "ab": a(x), b(x) or a(x) + b(x), summed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _scalar(), _scalar()

    def forward(self, x, which):
        return sum(getattr(self, w)(x) for w in which).sum()


def unused_with_no_sync(rank):
    """Case 5: a only inside no_sync (x = 2, 4), then b synchronised (x = 4, 6); torch with
    find_unused_parameters=True (without it torch fails an iteration later or hangs), the
    cores without a flag."""
    out = {}
    for v, cls in WRAPPERS.items():
        for flag in (True,) if v == "torch" else (None,):
            m = AB()
            ddp = cls(m) if flag is None else cls(m, find_unused_parameters=flag)

            def run(ddp=ddp, m=m):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with ddp.no_sync():
                        ddp(torch.full((1, 1), 2.0 + 2 * rank), "a").backward()
                    ddp(torch.full((1, 1), 4.0 + 2 * rank), "b").backward()
                advice = sum("leave it False" in str(w.message) for w in caught)
                return [m.a.weight.grad.item(), m.b.weight.grad.item(), advice]
            out[v] = _try(run)
    return out


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.head, self.body(x), use_reentrant=self.reentrant).sum()


def reentrant_checkpoint(rank):
    """Case 6: forward returns checkpoint(head, body(x)).sum(); gradients of every parameter."""
    out = {}
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_(True)  # the reentrant variant needs an input that requires grad
    for v, cls in WRAPPERS.items():
        for reentrant in (True, False):
            m = Checkpointed(reentrant)
            ddp = cls(m)

            def run(ddp=ddp, m=m):
                ddp(x).backward()
                return [round(g, 6) for p in m.parameters() for g in p.grad.reshape(-1).tolist()]
            out[f"{v} use_reentrant={reentrant}"] = _try(run)
    return out


def device_ids(rank):
    """Case 7: torch's signature on CPU: None accepted, a device list refused."""
    cls = DistributedDataParallel
    return {"torch None": _try(lambda: cls(nn.Linear(2, 1), device_ids=None,
                                           output_device=None) and []),
            "torch [0]": _try(lambda: cls(nn.Linear(2, 1), device_ids=[0]) and [])}


def uneven_inputs(rank):
    """Case 2: w = 1, loss = model(x).sum(); rank 0 has x = 1, 2, 6 and rank 1 has 3, 4; torch's
    DDP under Join (the cores are not Joinable)."""
    out = {}
    inputs = [1.0, 2.0, 6.0] if rank == 0 else [3.0, 4.0]
    for v, cls in {"torch": DistributedDataParallel}.items():
        for divide in (True, False):
            m = _scalar()
            ddp = cls(m)
            grads = []
            with Join([ddp], divide_by_initial_world_size=divide):
                for x in inputs:
                    m.weight.grad = None
                    ddp(torch.full((1, 1), x)).sum().backward()
                    grads.append(m.weight.grad.item())
            out[f"{v} divide_by_initial_world_size={divide}"] = grads
    return out


def skipped_backward(rank):
    """Rank 0 runs one forward without backward, then both train 2 steps on x = rank + 1
    (a model without buffers): the gradient after each step."""
    out = {}
    for v, cls in WRAPPERS.items():
        m = _scalar()
        ddp = cls(m)

        def run(ddp=ddp, m=m):
            if rank == 0:
                ddp(torch.ones(1, 1))  # forgotten backward
            grads = []
            for _ in range(2):
                m.weight.grad = None
                ddp(torch.full((1, 1), float(rank + 1))).sum().backward()
                grads.append(m.weight.grad.item())
            return grads
        out[v] = _try(run)
    return out


def fp16_sum(rank):
    """Pre-division: two fp16 gradients of 40000 (max fp16 is 65504) average to 40000."""
    out = {}
    for v, cls in WRAPPERS.items():
        m = nn.Linear(1, 1, bias=False).half()
        with torch.no_grad():
            m.weight.fill_(1.0)
        ddp = cls(m)
        ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()
        out[v] = [m.weight.grad.float().item()]
    return out


def _behind_ddp(opt):
    opt.average_gradients = False   # the gradients are the same on every rank here
    return opt


def zero_optimizer(rank):
    """Case 8: ZeRO-1 as a torch optimizer, ours and torch's ZeroRedundancyOptimizer.

    Four parameters of 50, 40, 30 and 20 ones, each in its own group, SGD lr 0.1; group 1's
    lr set to 0; gradients all ones; one step. Then momentum SGD with a group added after
    construction and a LambdaLR (factor 0.5 per epoch), 3 steps, the state consolidated on
    rank 0 and loaded into a fresh optimizer.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.optim.lr_scheduler import LambdaLR

    from ddp_lesson.core.zero1 import Zero1Optimizer

    out = {}
    makers = {"torch": lambda g, **kw: ZeroRedundancyOptimizer(g, torch.optim.SGD, **kw),
              "ours": lambda g, **kw: _behind_ddp(Zero1Optimizer(g, torch.optim.SGD, **kw))}
    for v, make in makers.items():
        params = [nn.Parameter(torch.ones(n)) for n in (50, 40, 30, 20)]
        opt = make([{"params": [p], "lr": 0.1} for p in params], lr=0.1)
        opt.param_groups[1]["lr"] = 0
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        out[v + " values"] = [round(p[0].item(), 6) for p in params]
        out[v + " groups"] = [len(g["params"]) for g in opt.param_groups]
        out[v + " is Optimizer"] = [isinstance(opt, torch.optim.Optimizer)]

        # scheduler + momentum + a group added later, then the consolidated state
        params = [nn.Parameter(torch.ones(n)) for n in (50, 40, 30, 20)]
        opt = make([{"params": params[:2]}], lr=0.1, momentum=0.9)
        opt.add_param_group({"params": params[2:], "lr": 0.2})
        sched = LambdaLR(opt, lambda epoch: 0.5 ** epoch)
        lrs = []
        for _ in range(3):
            for p in params:
                p.grad = torch.full_like(p, 1.0)
            opt.step()
            sched.step()
            lrs.append([g["lr"] for g in opt.param_groups])
        out[v + " lrs"] = lrs
        out[v + " after 3 steps"] = [round(p[0].item(), 6) for p in params]
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            sd = opt.state_dict()
            out[v + " state"] = {str(k): round(s["momentum_buffer"][0].item(), 6)
                                 for k, s in sorted(sd["state"].items())}
            out[v + " saved groups"] = [[g["params"], g["lr"], g["momentum"]]
                                        for g in sd["param_groups"]]
            if v == "ours":  # reload into a fresh optimizer: the same state, the same next step
                params2 = [nn.Parameter(p.detach().clone()) for p in params]
                fresh = make([{"params": params2[:2]}, {"params": params2[2:]}], lr=0.1,
                             momentum=0.9)
                fresh.load_state_dict(sd)
                out[v + " reloaded groups"] = [[g["lr"], g["momentum"]]
                                               for g in fresh.param_groups]
    return out


def _backwards(cls, rank, no_sync_first=False, **kwargs):
    """w = 1; three forwards on x = 1, 2, 3 (rank 0) or 5, 6, 7 (rank 1), each output summed,
    then three backwards (retain_graph=True on the first two): .grad after each.
    ``no_sync_first``: one micro-batch inside no_sync() first (x = 4 on rank 0, 0 on rank 1)."""
    m = _scalar()
    ddp = cls(m, **kwargs)
    if no_sync_first:
        with ddp.no_sync():
            ddp(torch.full((1, 1), 4.0 - 4 * rank)).sum().backward()
    outs = [ddp(torch.full((1, 1), x + 4.0 * rank)).sum() for x in (1.0, 2.0, 3.0)]
    grads = []
    for i, out in enumerate(outs):
        out.backward(retain_graph=i < 2)
        grads.append(m.weight.grad.item())
    return grads


def several_backwards(rank):
    """B32: several forwards, then several backwards (pytorch/pytorch#47260)."""
    out = {}
    for v, cls in WRAPPERS.items():
        out[v] = _backwards(cls, rank)
        # a forward under no_grad between a forward and its backward (x = 1 or 5, then 2 or 6)
        m = _scalar()
        ddp = cls(m)
        loss = ddp(torch.full((1, 1), 1.0 + 4 * rank)).sum()
        with torch.no_grad():
            ddp(torch.full((1, 1), 2.0 + 4 * rank))
        loss.backward()
        out[v + " no_grad forward between"] = [m.weight.grad.item()]
    out["torch find_unused"] = _try(
        lambda: _backwards(DistributedDataParallel, rank, find_unused_parameters=True))
    for v, cls in WRAPPERS.items():
        out[v + " no_sync first"] = _backwards(cls, rank, no_sync_first=True)
    for v, cls in CORES.items():
        # forward "ab" on x = 1 or 5, forward "a" on x = 2 or 6; then both backwards
        m = AB()
        ddp = cls(m)

        def run(ddp=ddp, m=m):
            o1 = ddp(torch.full((1, 1), 1.0 + 4 * rank), "ab")
            o2 = ddp(torch.full((1, 1), 2.0 + 4 * rank), "a")
            grads = []
            for o in (o1, o2):
                o.backward()
                grads.append([None if p.grad is None else p.grad.item()
                              for p in (m.a.weight, m.b.weight)])
            return grads
        out[f"{v} ab then a"] = _try(run)
    return out


class Scaled(nn.Module):
    """``lin(x) * scale``, a registered buffer the multiplication saves for backward."""

    def __init__(self, scale=2.0):
        super().__init__()
        self.lin = _scalar()
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return self.lin(x) * self.scale


def two_forwards_buffer(rank):
    """B33: two forwards, one backward, a buffer used in forward (pytorch/pytorch#22095,
    #175024). Scaled: x = 1 (rank 0), 2 (rank 1). BatchNorm (training): two different batches
    per rank, loss weighted by position; every gradient and the running statistics."""
    out = {}
    for v, cls in WRAPPERS.items():
        m = Scaled()
        ddp = cls(m)

        def run(ddp=ddp, m=m):
            x = torch.full((1, 1), 1.0 + rank)
            (ddp(x).sum() + ddp(x).sum()).backward()
            return [m.lin.weight.grad.item(), m.scale._version]
        out[v + " scaled"] = _try(run)
    for v, cls in WRAPPERS.items():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        ddp = cls(m)
        g = torch.Generator().manual_seed(rank)
        x1, x2 = torch.randn(4, 2, generator=g), torch.randn(4, 2, generator=g)
        k = torch.arange(8.0).view(4, 2)

        def run(ddp=ddp, m=m, x1=x1, x2=x2, k=k):
            ((ddp(x1) * k).sum() + (ddp(x2) * k).sum()).backward()
            return [round(t, 5) for t in torch.cat(
                [p.grad.reshape(-1) for p in m.parameters()]
                + [m[1].running_mean, m[1].running_var]).tolist()]
        out[v + " batchnorm"] = _try(run)
    return out


SCENARIOS = {f.__name__: f for f in (zero_optimizer,
    different_models, uneven_inputs, buffers_reassigned, unfrozen_after_wrapping,
    unused_with_no_sync, reentrant_checkpoint, device_ids, skipped_backward, fp16_sum,
    several_backwards, two_forwards_buffer)}


def main(argv=None) -> None:
    from ddp_lesson.env import cleanup, init_distributed

    names = (sys.argv[1:] if argv is None else argv) or list(SCENARIOS)
    env = init_distributed(timeout=20, backend="gloo")
    for name in names:
        result = SCENARIOS[name](env.rank)
        print(json.dumps({"scenario": name, "rank": env.rank, **result}), flush=True)
        dist.barrier()
    import gc
    gc.collect()  # free torch's DDP objects before the group goes
    cleanup()


if __name__ == "__main__":
    main()
