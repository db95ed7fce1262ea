"""Notebook 02 and its deep dives: sentences about torch bound to torch's source (torch 2.13) or
shown by a run.

* the core notebook, section 5: in ``eval()`` under ``torch.no_grad()`` neither SyncBatchNorm nor
  DDP's buffer broadcast communicates per batch (one broadcast, in the first no-grad forward after
  training), so ranks with unpadded shards of different lengths do not wait for each other;
* the deep dive on weighted sampling, streams and seeds: ``Join`` shadows only the collectives of
  the Joinables passed to it; numpy in a DataLoader worker is seeded from a hash of
  ``(base_seed, worker_id)``, not ``base_seed + worker_id`` (what ``random`` and ``torch`` get);
  docs/pitfalls.md A13 says the same.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ddp_lesson.launch import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
TORCH = Path(torch.__file__).parent
CORE = "02_sampler_sharding.ipynb"
EDGE = "deep/02_sampler_edge_cases.ipynb"
STREAMS = "deep/02_weighted_streams_and_seeds.ipynb"


def _prose(name: str) -> str:
    """The notebook's markdown, with line breaks and runs of spaces joined to one space."""
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return " ".join(text.split())


def _function(src: str, name: str) -> str:
    start = src.index(f"    def {name}(")
    return src[start:src.index("\n    def ", start + 10)]


# ------------------------------------------------------------- eval under no_grad: no sync

def test_02_prose_says_eval_under_no_grad_does_not_communicate_per_batch():
    prose = _prose(EDGE)           # notebook 02's evaluation section moved to this deep dive
    assert ("In `eval()` under `torch.no_grad()` neither SyncBatchNorm (it uses its running "
            "statistics) nor DDP communicates per batch: DDP broadcasts its buffers once, in the "
            "first no-grad forward after training") in prose
    assert "no DDP forward that broadcasts buffers, no SyncBatchNorm" not in prose


def test_02_torch_source_syncbn_and_ddp_buffers_in_eval_no_grad():
    bn = (TORCH / "nn" / "modules" / "batchnorm.py").read_text()
    sync = bn[bn.index("class SyncBatchNorm"):]
    need = sync[sync.index("need_sync = ("):]
    need = need[:need.index(")") + 1]
    # SyncBatchNorm communicates only in training mode
    assert "self.training" in need and "bn_training" in need
    assert "# Don't sync batchnorm stats in inference mode (model.eval())." in sync
    ddp = (TORCH / "nn" / "parallel" / "distributed.py").read_text()
    # the broadcast is gated on require_forward_param_sync ...
    will = _function(ddp, "will_sync_module_buffers")
    assert "self.require_forward_param_sync" in will and "self.forward_sync_buffers" in will
    pre = _function(ddp, "_pre_forward")
    assert "if self._check_sync_bufs_pre_fwd():\n            self._sync_buffers()" in pre
    # ... which a forward without gradients turns off, and one with gradients turns on again
    post = _function(ddp, "_post_forward")
    grad_on = post.index("if torch.is_grad_enabled() and self.require_backward_grad_sync:")
    assert post.index("self.require_forward_param_sync = True", grad_on) \
        < post.index("else:\n            self.require_forward_param_sync = False", grad_on)


EVAL_WORKER = textwrap.dedent("""
    import json
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_lesson.env import init_distributed

    env = init_distributed(timeout=30)
    calls = {"broadcasts": 0, "collectives": 0}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                 "_broadcast_coalesced"):
        def counted(*a, _f=getattr(dist, name), **k):
            calls["collectives"] += 1
            return _f(*a, **k)
        setattr(dist, name, counted)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    sync_buffers = ddp._sync_buffers

    def counted_sync():
        calls["broadcasts"] += 1
        sync_buffers()
    ddp._sync_buffers = counted_sync
    for _ in range(2):                                # training: a broadcast every forward
        ddp(torch.randn(8, 4)).sum().backward()
    trained = dict(calls)
    ddp.eval()
    bn = torch.nn.SyncBatchNorm(4).eval()
    batches = 3 if env.rank == 0 else 1               # unpadded shards of different lengths
    with torch.no_grad():
        for _ in range(batches):
            ddp(torch.randn(5, 4))
            bn(torch.randn(5, 4))
    evaluated = {k: calls[k] - trained[k] for k in calls}
    print("RESULT " + json.dumps({"rank": env.rank, "trained": trained, "eval": evaluated,
                                  "batches": batches}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_02_eval_under_no_grad_one_buffer_broadcast_and_no_per_batch_collective(tmp_path):
    script = tmp_path / "eval_worker.py"
    script.write_text(EVAL_WORKER)
    run = run_torchrun(str(script), nproc_per_node=2, timeout=120, live=False, backend="gloo")
    results = {}
    for rank in (0, 1):
        (line,) = [ln for ln in run.rank_lines(rank) if ln.startswith("RESULT ")]
        results[rank] = json.loads(line[len("RESULT "):])
    for r in results.values():
        assert r["trained"]["broadcasts"] == 2, r      # one per training forward
        # 3 batches on rank 0, 1 on rank 1, and no rank waited: one broadcast, in the first
        # no-grad forward, and no other collective (SyncBatchNorm in eval runs locally)
        assert r["eval"] == {"broadcasts": 1, "collectives": 1}, r
    assert [results[r]["batches"] for r in (0, 1)] == [3, 1]


# ------------------------------------------------------------- Join shadows only its Joinables

def test_02_deep_prose_join_covers_only_the_joinables_passed_to_it():
    prose = _prose(STREAMS)
    assert "shadows the collectives *of the Joinables passed to it*" in prose
    assert ('"is not aware of non-DDP collective communication"') in prose
    assert "SyncBatchNorm would hang under `Join`" in prose
    assert "`throw_on_early_termination=True`" in prose
    assert "keeps shadowing the others' all_reduces" not in prose


def test_02_torch_source_join_hooks_come_only_from_its_joinables():
    join = (TORCH / "distributed" / "algorithms" / "join.py").read_text()
    assert re.search(r"self\._join_hooks = \[\s*joinable\.join_hook\(\*\*kwargs\) "
                     r"for joinable in self\._joinables\s*\]", join)
    ddp = (TORCH / "nn" / "parallel" / "distributed.py").read_text()
    doc = " ".join(ddp[ddp.index("    def join(\n"):].split())
    assert ("such as ``SyncBatchNorm`` in the model's forward pass, then the flag "
            "``throw_on_early_termination`` must be enabled. This is because this context "
            "manager is not aware of non-DDP collective communication.") in doc


# ------------------------------------------------------------- numpy's seed in a DataLoader worker

class _Seeds(Dataset):
    """Item w: (the worker's info.seed, its id, numpy's first draw in that worker)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        info = get_worker_info()
        return info.seed, info.id, int(np.random.randint(0, 2**31 - 1))


def test_02_deep_prose_and_pitfalls_numpy_worker_seed_is_a_hash():
    prose = _prose(STREAMS)
    assert ("worker `w` seeds `random` and `torch` with `base_seed + w` "
            "(`get_worker_info().seed`), and numpy's global generator from a hash of "
            "`(base_seed, w)`") in prose
    assert "`torch` and `numpy` with `base_seed + w`" not in prose
    assert "for `random`, `torch` and `numpy`" not in prose
    a13 = next(ln for ln in (ROOT / "docs" / "pitfalls.md").read_text().splitlines()
               if ln.startswith('| <a id="A13">'))
    assert "numpy a hash of `(base_seed, worker_id)`" in a13
    worker = (TORCH / "utils" / "data" / "_utils" / "worker.py").read_text()
    assert ("seed = base_seed + worker_id\n        random.seed(seed)\n"
            "        torch.manual_seed(seed)") in worker
    assert "np_seed = _generate_state(base_seed, worker_id)" in worker
    assert "entropy = [worker_id, base_seed & MASK32, base_seed >> 32, 0]" in worker


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_02_numpy_in_a_worker_is_not_seeded_base_seed_plus_worker_id():
    from torch.utils.data._utils.worker import _generate_state

    loader = DataLoader(_Seeds(), batch_size=None, num_workers=2,
                        generator=torch.Generator().manual_seed(0))
    items = list(loader)
    assert sorted(w for _, w, _ in items) == [0, 1]
    base = items[0][0] - items[0][1]
    for seed, w, draw in items:
        assert seed == base + w                                 # random and torch
        rs = np.random.RandomState(_generate_state(base, w))    # numpy: the hash
        assert draw == rs.randint(0, 2**31 - 1)
        assert draw != np.random.RandomState((base + w) % 2**32).randint(0, 2**31 - 1)
