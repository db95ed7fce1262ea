"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.seedfix.seed_v7

The seed program after 7 of its 10 repairs: ``seed_v6`` with the local rank read from torchrun's
``LOCAL_RANK``.

``ddp_lesson.seedfix.step_diff(7)`` prints the change; ``ddp_lesson.seedfix.STEPS`` lists the
repairs in the order a run meets the defects.
"""
import argparse
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler

from ddp_lesson.data import SyntheticCityscapes
from ddp_lesson.models import build_model


class DistributedSampler(Sampler):
    """Deals each rank its share of one order of the data set, the same order on every rank."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0):
        if num_replicas is None:
            num_replicas = dist.get_world_size()  # the number of processes
        if rank is None:
            rank = dist.get_rank()  # which process this is
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.num_samples = math.ceil(len(dataset) / num_replicas)  # per rank
        self.total_size = self.num_samples * num_replicas  # all ranks' samples, padding included
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)  # a new order each epoch, once set_epoch runs
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices += indices[:(self.total_size - len(indices))]  # pad to a multiple of the ranks
        assert len(indices) == self.total_size
        indices = indices[self.rank:self.total_size:self.num_replicas]  # every R-th, from rank
        assert len(indices) == self.num_samples
        return iter(indices)

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch):
        self.epoch = epoch


def main(argv=None):
    parser = argparse.ArgumentParser(description="DeepLab on street scenes, the seed's way")
    parser.add_argument("-j", "--workers", default=0, type=int, metavar="N",
                        help="data loading workers per process (default: 0)")
    parser.add_argument("--epochs", default=2, type=int, metavar="N", help="epochs to run")
    parser.add_argument("--start-epoch", default=0, type=int, metavar="N",
                        help="the first epoch's number (to restart by hand)")
    parser.add_argument("-b", "--batch-size", default=3, type=int, metavar="N",
                        help="samples per process and step")
    parser.add_argument("--lr", default=0.05, type=float, help="learning rate")
    parser.add_argument("--momentum", default=0.9, type=float, help="SGD momentum")
    parser.add_argument("--weight-decay", default=1e-4, type=float, help="L2 penalty")
    args = parser.parse_args(argv)
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it for every process

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every process on this machine
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    print(f"local rank {local_rank}, device {device}")
    model = build_model("deeplab", width=8)
    model = model.to(device)
    ids = [local_rank] if device.type == "cuda" else None
    model = DistributedDataParallel(model, device_ids=ids,
                                    find_unused_parameters=True)
    criterion = nn.CrossEntropyLoss(ignore_index=255).to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum, weight_decay=args.weight_decay)

    train_dataset = SyntheticCityscapes(12, size=(32, 64))
    train_sampler = DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=device.type == "cuda", sampler=train_sampler)

    print(f"{len(train_loader)} steps per epoch")
    for epoch in range(args.start_epoch, args.epochs):
        print(f"epoch {epoch}: samples {list(train_sampler)}")
        for images, targets in train_loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
