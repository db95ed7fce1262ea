"""torch's own DistributedSampler, rank by rank: the reference the sampler tests compare with."""
from torch.utils.data.distributed import DistributedSampler as TorchSampler


def torch_shards(n, r, shuffle, seed=0, epoch=0, drop_last=False):
    """Each rank's indices from ``torch.utils.data.DistributedSampler`` (``shuffle`` explicit:
    torch defaults to True, the teaching helpers to False)."""
    out = []
    for rank in range(r):
        s = TorchSampler(range(n), num_replicas=r, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out
