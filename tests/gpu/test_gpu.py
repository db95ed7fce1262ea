"""The GPU path, checked for real: NCCL, CUDA tensors, AMP, SyncBatchNorm, checkpoints, timers.

Every test here is marked ``gpu`` and is skipped, with the reason, on a machine without CUDA
(``pytest -m gpu`` collects them all; on a CPU-only machine each reports "SKIPPED ... no CUDA
device"). Multi-process tests use min(2, GPUs) processes, one GPU each, on NCCL: the same code
that runs on gloo/CPU elsewhere in the suite. Run on a GPU machine with

    pytest -m gpu -n 0 tests/gpu -q

and record the result in README.md's "Tested on" table.
"""
from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

from ddp_lesson.launch import run_torchrun
from ddp_lesson.train import cuda_bf16_native

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
NPROC = min(2, GPUS) if GPUS else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not CUDA, reason="no CUDA device: the GPU path needs torch.cuda.is_available()"
    ),
]

#: A small, fast trainer run (the flags of ddp_lesson.train).
TRAIN_SMALL = ["--size", "32", "64", "--width", "8", "--num-train", "32", "--num-val", "8",
               "-b", "4", "--epochs", "1", "--no-resume"]


def _code(src: str) -> str:
    return textwrap.dedent(src).lstrip()


def _json_lines(result, rank: int) -> list[dict]:
    return [json.loads(line) for line in result.rank_lines(rank) if line.startswith("{")]


@pytest.mark.slow
def test_nccl_all_reduce_at_world_size_min_2_gpus():
    code = _code("""
        import json, os, torch, torch.distributed as dist
        from ddp_lesson.env import cleanup, init_distributed
        env = init_distributed(timeout=60)
        t = torch.full((1000,), float(env.rank + 1), device=f"cuda:{env.local_rank}")
        dist.all_reduce(t)
        print(json.dumps({"backend": dist.get_backend(), "device": str(t.device),
                          "sum": t[0].item(), "same": bool((t == t[0]).all())}))
        cleanup()
    """)
    result = run_torchrun(code=code, nproc_per_node=NPROC, backend="nccl", timeout=180,
                          live=False)
    want = NPROC * (NPROC + 1) / 2
    for rank in range(NPROC):
        (rec,) = _json_lines(result, rank)
        assert rec == {"backend": "nccl", "device": f"cuda:{rank}", "sum": want, "same": True}


@pytest.mark.slow
def test_torchrun_cell_on_cuda_picks_nccl_and_one_gpu_per_rank(capsys):
    from ddp_lesson.launch import torchrun_magic

    code = _code("""
        import torch, torch.distributed as dist
        from ddp_lesson.env import cleanup, init_distributed
        env = init_distributed()
        print(dist.get_backend(), torch.cuda.current_device() == env.local_rank, env.device)
        cleanup()
    """)
    torchrun_magic(f"--nproc-per-node {NPROC} --timeout 180", code)
    lines = capsys.readouterr().out.splitlines()
    procs = f"{NPROC} process{'es' if NPROC != 1 else ''}"
    gpus = f"{GPUS} GPU{'s' if GPUS != 1 else ''}"
    assert lines[0] == f"[torchrun] {procs} and {gpus}: using nccl, one GPU per process"
    assert lines[1:] == [f"[rank {r}] nccl True cuda:{r}" for r in range(NPROC)]


def _train_one_epoch(tmp_path, amp: str):
    """One epoch of the trainer on min(2, GPUs) GPUs with ``--amp amp``: (summary, out folder)."""
    out = tmp_path / f"amp_{amp}"
    run_torchrun("ddp_lesson.train", [*TRAIN_SMALL, "--amp", amp, "--out", str(out)],
                 module=True, nproc_per_node=NPROC, backend="nccl", timeout=240, live=False)
    with open(out / "summary.json") as f:
        return json.load(f), out


@pytest.mark.slow
@pytest.mark.skipif(CUDA and not cuda_bf16_native(),
                    reason="this GPU cannot compute in bfloat16 natively (compute capability < 8)")
def test_trainer_one_epoch_on_cuda_with_amp_bf16(tmp_path):
    summary, _ = _train_one_epoch(tmp_path, "bf16")
    assert summary["device"] == "cuda"
    assert summary["config"]["amp"] == "bf16"
    losses = [v for v in summary["step_losses"] if v is not None]
    assert losses and all(math.isfinite(v) for v in losses)


@pytest.mark.slow
def test_trainer_one_epoch_on_cuda_with_amp_fp16_saves_the_scaler(tmp_path):
    from ddp_lesson.checkpoint import load_checkpoint

    summary, out = _train_one_epoch(tmp_path, "fp16")
    assert summary["device"] == "cuda"
    assert summary["config"]["amp"] == "fp16"
    losses = [v for v in summary["step_losses"] if v is not None]
    assert losses and all(math.isfinite(v) for v in losses)
    ckpt = load_checkpoint(str(out / "checkpoint.pt"), map_location="cpu")
    scaler_keys = [k for k in ckpt if "scaler" in k]
    assert scaler_keys, sorted(ckpt)
    state = ckpt[scaler_keys[0]]
    assert state and state["scale"] > 0          # GradScaler.state_dict() of a used scaler


@pytest.mark.slow
def test_naive_and_bucketed_ddp_cores_equal_torch_ddp_on_cuda():
    """NaiveDDP and BucketedDDP (``ddp_lesson.core``, what ``--ddp naive|bucketed`` run) under
    NCCL: their hooks and end-of-backward callback on CUDA streams give torch's DDP's weights."""
    code = _code("""
        import json, torch, torch.distributed as dist
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel
        from ddp_lesson.core.bucketed_ddp import BucketedDDP
        from ddp_lesson.core.naive_ddp import NaiveDDP
        from ddp_lesson.env import cleanup, init_distributed
        from ddp_lesson.models import build_model
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        env = init_distributed(timeout=60)
        dev = torch.device(f"cuda:{env.local_rank}")
        def run(wrap):
            torch.manual_seed(0)
            model = build_model("deeplab", width=8).to(dev)
            ddp = wrap(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                g = torch.Generator().manual_seed(100 + step)
                x = torch.randn(2 * env.world_size, 3, 32, 64, generator=g)
                y = torch.randint(0, 19, (2 * env.world_size, 32, 64), generator=g)
                lo = 2 * env.rank
                xs, ys = x[lo:lo + 2].to(dev), y[lo:lo + 2].to(dev)
                opt.zero_grad()
                F.cross_entropy(ddp(xs), ys).backward()
                opt.step()
            return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        theirs = run(lambda m: DistributedDataParallel(m, device_ids=[env.local_rank]))
        out = {}
        for name, wrap in (("bucketed", lambda m: BucketedDDP(m, bucket_cap_mb=0.05)),
                           ("naive", NaiveDDP)):
            ours = run(wrap)
            diff = (ours - theirs).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            out[name] = diff.item()
        print(json.dumps({"device": str(theirs.device), "max_diff": out}))
        cleanup()
    """)
    result = run_torchrun(code=code, nproc_per_node=NPROC, backend="nccl", timeout=240,
                          live=False)
    for rank in range(NPROC):
        (rec,) = _json_lines(result, rank)
        assert rec["device"] == f"cuda:{rank}"
        assert set(rec["max_diff"]) == {"bucketed", "naive"}
        assert all(d < 1e-5 for d in rec["max_diff"].values()), rec["max_diff"]


@pytest.mark.slow
def test_torch_sync_batchnorm_on_cuda_uses_the_global_batch_statistics():
    code = _code("""
        import json, torch, torch.distributed as dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel
        from ddp_lesson.env import cleanup, init_distributed
        env = init_distributed(timeout=60)
        dev = torch.device(f"cuda:{env.local_rank}")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * env.world_size, 3, 8, 8, generator=g) * 3 + 1   # the global batch
        bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3, momentum=1.0)))
        ddp = DistributedDataParallel(bn.to(dev), device_ids=[env.local_rank])
        ddp(x[4 * env.rank:4 * env.rank + 4].to(dev)).sum().backward()
        mean, var = x.double().mean(dim=(0, 2, 3)), x.double().var(dim=(0, 2, 3), unbiased=True)
        rm, rv = bn[0].running_mean.double().cpu(), bn[0].running_var.double().cpu()
        print(json.dumps({"cls": type(bn[0]).__name__, "device": str(bn[0].running_mean.device),
                          "mean_diff": (rm - mean).abs().max().item(),
                          "var_diff": (rv - var).abs().max().item()}))
        cleanup()
    """)
    result = run_torchrun(code=code, nproc_per_node=NPROC, backend="nccl", timeout=180,
                          live=False)
    for rank in range(NPROC):
        (rec,) = _json_lines(result, rank)
        assert rec["cls"] == "SyncBatchNorm" and rec["device"] == f"cuda:{rank}"
        assert rec["mean_diff"] < 1e-4 and rec["var_diff"] < 1e-3


@pytest.mark.slow
def test_checkpoint_loads_onto_each_ranks_own_gpu(tmp_path):
    path = tmp_path / "ckpt.pt"
    code = _code(f"""
        import json, torch
        from ddp_lesson.checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, REQUIRED_KEYS,
                                           load_checkpoint, save_checkpoint)
        from ddp_lesson.env import cleanup, init_distributed
        env = init_distributed(timeout=60)
        dev = f"cuda:{{env.local_rank}}"
        obj = {{k: None for k in REQUIRED_KEYS}}
        obj.update(format=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION, epoch=0,
                   step_in_epoch=0, global_step=0, world_size=env.world_size, config={{}},
                   sampler={{}}, rng={{}}, model={{"w": torch.arange(4.0, device="cuda:0")}},
                   optimizer={{}}, scheduler={{}})
        save_checkpoint(obj if env.rank == 0 else None, {str(path)!r})
        ck = load_checkpoint({str(path)!r}, map_location=dev)
        w = ck["model"]["w"]
        print(json.dumps({{"device": str(w.device), "values": w.tolist()}}))
        cleanup()
    """)
    result = run_torchrun(code=code, nproc_per_node=NPROC, backend="nccl", timeout=180,
                          live=False)
    for rank in range(NPROC):
        (rec,) = _json_lines(result, rank)
        assert rec == {"device": f"cuda:{rank}", "values": [0.0, 1.0, 2.0, 3.0]}


def test_step_timer_synchronises_cuda_before_reading_the_clock(monkeypatch):
    from ddp_lesson.bench.scaling import StepTimer

    stream = torch.cuda.current_stream()
    # Without sync: the block returns while the GPU is still busy (the clock would stop early).
    bare = StepTimer(sync=None)
    with bare.phase("kernel"):
        torch.cuda._sleep(200_000_000)  # queue a GPU busy-wait of ~0.1 s and return at once
    busy_after_bare = not stream.query()
    torch.cuda.synchronize()
    # With sync=torch.cuda.synchronize (what bench.scaling passes on CUDA): the phase ends
    # only when the queued work has finished.
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real(*a))[1])
    timer = StepTimer(sync=torch.cuda.synchronize)
    with timer.phase("kernel"):
        torch.cuda._sleep(200_000_000)
        assert not stream.query()       # still queued inside the block
    assert stream.query()               # done when the phase was timed
    assert len(calls) == 2              # before starting and before stopping the clock
    assert busy_after_bare              # the difference sync makes
    assert timer.counts == {"kernel": 1}


@pytest.mark.slow
def test_doctor_finds_another_process_holding_gpu_0():
    """``ddp-lesson doctor``'s gpu0 check, with the fault reproduced: a process that made a CUDA
    context on GPU 0 (as a rank does that touches CUDA before ``set_device``)."""
    import subprocess
    import sys
    import time

    from ddp_lesson.doctor import check_gpu0_contexts

    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import torch, time; torch.zeros(1, device='cuda:0'); print('ready', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        f = check_gpu0_contexts()
        while f.ok and time.monotonic() < deadline:
            time.sleep(0.5)
            f = check_gpu0_contexts()
        assert not f.ok
        assert f"pid {holder.pid} " in f.symptom
    finally:
        holder.kill()
        holder.wait(timeout=20)
