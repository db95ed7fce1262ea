"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.convert.ddp --out runs/convert/ddp

``single.py`` converted to DistributedDataParallel: the same training, one process per rank.

Each of R ranks trains on its shard (batch 16 / R) of the global batch of 16, so the run ends
with the single-process script's weights, up to float rounding. Backend by the series' rule:
NCCL, one GPU per process, when CUDA can give every local rank a GPU of its own; gloo on CPU
otherwise. Rank 0 prints the loss averaged over all ranks and writes ``--out/checkpoint.pt``;
every rank prints its weights' fingerprint (the same on all) and reloads the checkpoint onto
its own device. Run it with torchrun (above); it reads RANK, LOCAL_RANK, WORLD_SIZE and
LOCAL_WORLD_SIZE from torchrun's environment.
"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_lesson.gradients import make_toy_batch, make_toy_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, over all ranks")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp16", action="store_true", help="fp16 autocast and GradScaler (CUDA)")
    p.add_argument("--out", default="runs/convert/ddp")
    args = p.parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]):
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fp16 = args.fp16 and device.type == "cuda"

    dataset = TensorDataset(*make_toy_batch(64, seed=1))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size // world_size,
                        sampler=sampler, pin_memory=device.type == "cuda")
    model = make_toy_model(seed=args.seed, hidden=8).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            total, steps = total + loss.item(), steps + 1
        mean = torch.tensor([total, steps], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch}: mean loss {mean[0].item() / mean[1].item():.4f}")

    weights = torch.cat([q.detach().flatten() for q in model.parameters()]).double().cpu()
    if rank == 0:
        print(f"last step's gradient norm: {norm.item():.4f}")
    print(f"weights: sum {weights.sum().item():+.4f}, norm {weights.norm().item():.4f}")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "epoch": args.epochs - 1},
                   out / "checkpoint.pt")
    dist.barrier()
    state = torch.load(out / "checkpoint.pt", map_location=device)
    model.module.load_state_dict(state["model"])
    print(f"saved and reloaded checkpoint.pt (epoch {state['epoch']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
