"""python -m ddp_lesson.convert.single --out runs/convert/single

A complete single-process training script: the starting point of the conversion to DDP.

A small MLP (``make_toy_model``, 4 -> 8 -> 1) fits a seeded regression set of 64 samples with
SGD, batch 16, 3 epochs, the gradient norm clipped to 1; fp16 autocast and a GradScaler on
CUDA with ``--fp16``. Prints the mean loss per epoch, the last step's gradient norm and a
fingerprint of the weights, and saves a checkpoint to ``--out/checkpoint.pt``. The shuffle is
``randperm`` seeded with ``seed + epoch``, as torch's ``DistributedSampler`` draws it, so the
DDP version (``ddp.py``) sees the same global batches.
"""
import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from ddp_lesson.gradients import make_toy_batch, make_toy_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp16", action="store_true", help="fp16 autocast and GradScaler (CUDA)")
    p.add_argument("--out", default="runs/convert/single")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp16 = args.fp16 and device.type == "cuda"

    dataset = TensorDataset(*make_toy_batch(64, seed=1))
    shuffle = torch.Generator()
    loader = DataLoader(dataset, batch_size=args.batch_size,
                        sampler=RandomSampler(dataset, generator=shuffle))
    model = make_toy_model(seed=args.seed, hidden=8).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)

    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        total, steps = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            total, steps = total + loss.item(), steps + 1
        print(f"epoch {epoch}: mean loss {total / steps:.4f}")

    weights = torch.cat([q.detach().flatten() for q in model.parameters()]).double().cpu()
    print(f"last step's gradient norm: {norm.item():.4f}")
    print(f"weights: sum {weights.sum().item():+.4f}, norm {weights.norm().item():.4f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "epoch": args.epochs - 1}, out / "checkpoint.pt")
    state = torch.load(out / "checkpoint.pt")
    model.load_state_dict(state["model"])
    print(f"saved and reloaded checkpoint.pt (epoch {state['epoch']})")


if __name__ == "__main__":
    main()
