"""torchrun --standalone --nproc-per-node 2 -m ddp_lesson.seedfix.seed_v0

The seed program re-created, every defect kept (docs/seed.md describes the original).

Its structure is the seed's: the imports, a hand-written ``DistributedSampler``, a command
line, the set-up (process group, model on the GPU, DDP, loss, optimizer), the data. The
package's synthetic street scenes (:class:`ddp_lesson.data.SyntheticCityscapes`, 12 of 32x64
pixels) and its small DeepLab (``build_model("deeplab", width=8)``) stand in for Cityscapes
and the real DeepLab, so a run takes seconds on a CPU; the defaults are scaled down to match
(2 epochs, no DataLoader workers). The seed stops before its training loop; the loop at the
end of :func:`main` is the one its reader would write: it prints how many steps an epoch
has and, at the start of each epoch, this rank's order of samples.

Run as it is, it stops at its first defect: ``ddp_lesson.seedfix.STEPS`` lists them in the
order a run meets them, and ``seed_v1`` ... ``seed_v10`` repair them one at a time.
"""
import argparse
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddp_lesson.data import SyntheticCityscapes
from ddp_lesson.models import build_model

warnings.filterwarnings("ignore")


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
    parser.add_argument("--local_rank", default=0, type=int, help="this process's GPU")
    args = parser.parse_args(argv)

    dist.init_process_group(backend="nccl")
    print(f"Use GPU: {args.local_rank} for training")
    model = build_model("deeplab", width=8)
    torch.cuda.set_device(args.local_rank)
    model = model.cuda()
    model = DistributedDataParallel(model, device_ids=[args.local_rank],
                                    find_unused_parameters=True)
    criterion = nn.CrossEntropyLoss().cuda()
    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum, weight_decay=args.weight_decay)

    train_dataset = SyntheticCityscapes(12, size=(32, 64))
    train_sampler = DistributedSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=True, sampler=train_sampler)

    print(f"{len(train_loader)} steps per epoch")
    for epoch in range(args.start_epoch, args.epochs):
        print(f"epoch {epoch}: samples {list(train_sampler)}")
        for images, targets in train_loader:
            images = images.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
