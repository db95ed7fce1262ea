"""Every line the persistent-ranks section of notebook 02's deep dive on edge cases
(``notebooks/deep/02_sampler_edge_cases.ipynb``, section 4) prints, recomputed with torch's own
``torch.utils.data.DistributedSampler`` on one process (3 ranks, N = 10, seed 0)."""
from __future__ import annotations

from pathlib import Path

import nbformat
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.env import choose_backend

ROOT = Path(__file__).resolve().parents[2]
N, R = 10, 3
NOTEBOOK = "deep/02_sampler_edge_cases.ipynb"


def _outputs(marker: str) -> list[str]:
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    hits = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(hits) == 1, f"{len(hits)} code cells contain {marker!r}"
    return "".join(o.get("text", "") for o in hits[0].outputs
                   if o.get("output_type") == "stream").splitlines()


def _shard(rank: int, epoch: int) -> list[int]:
    s = TorchSampler(range(N), num_replicas=R, rank=rank, shuffle=True, seed=0)
    s.set_epoch(epoch)
    return list(s)


def _report(epochs: list[int]) -> str:
    seen = [i for r, e in enumerate(epochs) for i in _shard(r, e)]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    never = sorted(set(range(N)) - set(seen))
    return f"[rank 0] epochs {epochs}: {len(seen)} slots; seen twice: {twice}; never seen: {never}"


def test_notebook_02_deep_ranks_cells_print_what_torchs_sampler_gives():
    assert _outputs("%dist_start --nproc-per-node 3") == [
        "[dist_start] 3 ranks (1 node x 3), gloo: " + choose_backend(3, "auto", 0)[1]]
    assert _outputs("sampler = DistributedSampler(range(10)") == [
        f"[rank {r}] len 4, epoch 0: {_shard(r, 0)}" for r in range(R)]
    lines = []
    for r in range(R):
        lines += [f"[rank {r}] iterated again, epoch 0: {_shard(r, 0)}",
                  f"[rank {r}] after set_epoch(1), epoch 1: {_shard(r, 1)}"]
    assert _outputs("sampler.set_epoch(1)") == lines
    # same epoch everywhere: the padding's 2 repeats, nothing missing
    assert _outputs("def report():") == [_report([1, 1, 1])]
    assert _report([1, 1, 1]).endswith("never seen: []")
    assert _outputs("sampler.set_epoch(2)") == [f"[rank 2] epoch 2: {_shard(2, 2)}"]
    # rank 2 a epoch ahead (case A2): overlaps and a gap
    assert _outputs("%%ranks\nreport()") == [_report([1, 1, 2])]
    assert not _report([1, 1, 2]).endswith("never seen: []")
    assert _outputs("%dist_stop") == [
        "[dist_stop] 3 ranks stopped: process group destroyed, engines and controller ended"]


def test_the_one_shot_run_on_three_processes_is_torchs_sharding():
    """The deep dive's %%torchrun cell: 3 real ranks, each sampler from the process group."""
    lines = _outputs("shard = DistributedSampler(range(10), shuffle=False, drop_last=drop_last)")
    want = []
    for rank in range(R):
        for drop_last in (False, True):
            s = TorchSampler(range(N), num_replicas=R, rank=rank, shuffle=False,
                             drop_last=drop_last)
            want.append(f"[rank {rank}] N=10, drop_last={drop_last}: {list(s)}")
    assert [line for line in lines if line.startswith("[rank")] == want
