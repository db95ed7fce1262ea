"""What notebook 04 and its deep dives say about torch 2.13's DDP, checked against torch itself.

Each test reads torch's installed source (``torch/nn/parallel/distributed.py``, the Reducer's
header ``torch/include/torch/csrc/distributed/c10d/reducer.hpp``) or runs torch, and checks the
notebook sentence that states the fact, so neither can change without the other.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import distributed as torch_ddp
from torch.utils.checkpoint import checkpoint

from ddp_lesson.labs import torch_reducer as tr

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TORCH = Path(torch.__file__).parent
REDUCER_HPP = TORCH / "include/torch/csrc/distributed/c10d/reducer.hpp"
INSIDE = "notebooks/deep/04_inside_torchs_ddp.ipynb"
EDGE = "notebooks/deep/04_ddp_edge_cases.ipynb"


def _markdown(path: str) -> str:
    nb = nbformat.read(ROOT / path, as_version=4)
    return re.sub(r"\s+", " ", "\n".join(c.source for c in nb.cells if c.cell_type == "markdown"))


#: Runs in a child process: a gloo process group inside the pytest worker would outlive the
#: test, and tearing one down there can block in ProcessGroupGloo's destructor (its threads
#: joined while a peer structure is gone), where no pytest timeout can interrupt it.
CHILD = r"""
import json, sys, warnings
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from ddp_lesson.labs.torch_reducer import _parse_sizes
from ddp_lesson.models import build_model

def deeplab(**kwargs):
    torch.manual_seed(0)
    model = build_model("deeplab", width=16)
    ddp = DistributedDataParallel(model, **kwargs)
    data = []
    for _ in range(3):
        ddp(torch.randn(1, 3, 64, 128)).sum().backward()
        d = ddp._get_ddp_logging_data()   # sizes as "n1, n2, ..." strings; absent: None
        data.append({k: _parse_sizes(d.get(k)) for k in ("bucket_sizes", "rebuilt_bucket_sizes")})
    return sum(p.numel() * p.element_size() for p in model.parameters()), data

def warned(make):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        obj = make()
    return obj, [str(x.message) for x in w if issubclass(x.category, FutureWarning)]

out = {"default": deeplab(), "find_unused": deeplab(find_unused_parameters=True)}
_, out["torch_warns"] = warned(lambda: DistributedDataParallel(nn.BatchNorm1d(2),
                                                               broadcast_buffers=False))
print(json.dumps(out), flush=True)
import os
os._exit(0)   # no teardown of the group: the process ends
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What torch's DDP did, in a 1-process gloo group of a child process."""
    import json
    import subprocess
    import sys

    store = tmp_path_factory.mktemp("pg") / "store"
    r = subprocess.run([sys.executable, "-c", CHILD, str(store)], capture_output=True, text=True,
                       timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_claim3_buckets_rebuilt_only_without_find_unused_parameters(runs):
    hpp = REDUCER_HPP.read_text()
    # the Reducer rebuilds once, and never with find_unused_parameters (unless static_graph)
    assert "return (static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_;" in hpp
    src = inspect.getsource(torch_ddp._BucketCapacityConfig.compute_bucket_size_limits)
    assert "if static_graph or not find_unused_parameters:" in src
    assert "bucket_size_limits = [sys.maxsize]" in src
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    total, its = runs["default"]
    assert total == 1_149_964                                 # the 1.15 MB DeepLab
    assert its[0]["bucket_sizes"] == [total]                  # one bucket, first iteration
    rebuilt = its[-1]["rebuilt_bucket_sizes"]
    assert len(rebuilt) == 2 and sum(rebuilt) == total        # first bucket capped at 1 MiB
    assert rebuilt[0] >= 1024 * 1024 > rebuilt[1]             # the cap, passed by one tensor
    _, its = runs["find_unused"]
    assert len(its[0]["bucket_sizes"]) == 2                   # built with the caps at once
    assert all(it["rebuilt_bucket_sizes"] is None for it in its)  # and never rebuilt
    text = _markdown(INSIDE)
    assert "which makes 2 buckets for the 1.15 MB DeepLab" in text
    assert "(the seed's setting) the buckets are built once" in text
    assert ("With `find_unused_parameters=True` the initial buckets use the caps and are never "
            "rebuilt") in text


def test_claim4_bf16_hook_refused_by_the_build_not_the_backend():
    src = inspect.getsource(DistributedDataParallel._check_comm_hook)
    bf16 = src[src.index('"bf16_compress_hook"'):]
    assert "torch.version.cuda is not None" in bf16 and "is_nccl_available()" in bf16
    assert "get_backend" not in bf16 and "backend" not in bf16.replace("is_available", "")
    cuda_nccl = (torch.version.cuda is not None or torch.version.hip is not None) and (
        dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10))
    assert tr.bf16_build_supports() == cuda_nccl              # the lab's rule is torch's
    text = _markdown(INSIDE)
    assert ("refused at registration by a CPU-only build of torch and accepted by a CUDA "
            "build") in text
    assert "`_check_comm_hook` tests the *build*" in text
    assert "The backend is not what it checks." in text
    assert "refuses gloo" not in text


@pytest.mark.slow
def test_claim5_broadcast_buffers_deprecated_forward_sync_buffers_still_syncs_at_init(runs):
    src = inspect.getsource(DistributedDataParallel.__init__)
    assert "broadcast_buffers=None," in inspect.getsource(DistributedDataParallel)
    assert "FutureWarning" in src and "`broadcast_buffers` is deprecated" in src
    forward = src[src.index("if forward_sync_buffers is not None:\n            self."):]
    assert forward.split("else:")[0].strip().endswith("init_sync_buffers = True")
    assert any("broadcast_buffers" in w for w in runs["torch_warns"])
    text = _markdown(EDGE)
    assert "In torch 2.13 `broadcast_buffers` is deprecated" in text
    assert "construction still broadcasts rank 0's buffers" in text


def test_claim12_hook_fires_once_per_checkpointed_use():
    from ddp_lesson.labs.torch_reducer import _CheckpointedTwice

    def fired(model, x):
        count = []
        model.l.weight.register_post_accumulate_grad_hook(lambda p: count.append(1))
        model(x).sum().backward()
        return len(count)

    x = torch.randn(2, 8, requires_grad=True)
    assert fired(_CheckpointedTwice(), x) == 2                # two checkpointed uses of l

    class Once(_CheckpointedTwice):
        def forward(self, x):
            return checkpoint(self.l, x, use_reentrant=True)

    assert fired(Once(), x) == 1                              # one use: once, reentrant or not
    text = _markdown(INSIDE)
    assert "`l`'s gradient hook fires once per checkpointed use, twice in one iteration" in text


def test_claim13_reducer_copies_each_gradient_when_its_hook_fires():
    from ddp_lesson.viz.ddp import REDUCER_MAP

    hpp = REDUCER_HPP.read_text()
    assert "void mark_variable_ready_dense(size_t variable_index);" in hpp
    torch_side = [" ".join(row[2].split()) for row in REDUCER_MAP]
    assert "mark_variable_ready_dense" in torch_side[0] and "copy" in torch_side[0]
    assert "bucket view" in torch_side[0]
    assert "copy" not in torch_side[1]                        # the bucket is ready: no copy


def test_claim16_reentrant_checkpoint_on_input_averaged_by_all_three():
    """The deep dive's run (replayed by nbval): torch 2.13's DDP averages this pattern, as the
    cores do, on both ranks; the row B20 of docs/pitfalls.md says the same."""
    from notebook_cells import stream_text

    stored = stream_text("deep/04_ddp_edge_cases.ipynb", "reentrant_checkpoint_on_input")
    lines = [line for line in stored.splitlines() if line.startswith("[rank")]
    want = [f"[rank {r}] {name}: averaged True, rank-local False"
            for r in (0, 1) for name in ("DistributedDataParallel", "NaiveDDP", "BucketedDDP")]
    assert lines == want
    pitfalls = (ROOT / "docs" / "pitfalls.md").read_text()
    row = next(line for line in pitfalls.splitlines() if 'id="B20"' in line)
    assert "gradients equal to torch's DDP" in row


def test_claim17_buffer_broadcast_hidden_from_autograd_as_torch():
    """torch's buffer sync before a forward keeps the buffers' version counters, so a second
    forward does not break the first one's backward (B33); torch averages only the first of
    several backwards (B32; the numbers: tests/ddp/test_ddp_edge_cases.py)."""
    src = inspect.getsource(DistributedDataParallel._sync_buffers)
    assert "torch.autograd._unsafe_preserve_version_counter(" in src
    assert "self._sync_module_buffers(authoritative_rank)" in src.split(
        "_unsafe_preserve_version_counter(")[1]
    text = _markdown(EDGE)
    assert ("In the cores every backward after a synchronised forward averages, where torch's "
            "DDP averages the first only") in text
    assert ("torch hides the buffer broadcast before a second forward from autograd "
            "(`_unsafe_preserve_version_counter` in `_sync_buffers`)") in text


def test_claim18_edge_cases_cite_torchs_own_functions():
    """The deep dive's torch rules, read in torch 2.13's source: the shape check across ranks
    at construction, Joinable with divide_by_initial_world_size=True by default, frozen
    parameters left out and shared ones deduplicated when the reducer's list is built."""
    init = inspect.getsource(DistributedDataParallel.__init__)
    assert "_verify_param_shape_across_processes(self.process_group, parameters)" in init
    from torch.distributed.algorithms import Joinable

    assert issubclass(DistributedDataParallel, Joinable)
    join = inspect.signature(DistributedDataParallel.join).parameters
    assert join["divide_by_initial_world_size"].default is True
    build = inspect.getsource(DistributedDataParallel._build_params_for_reducer)
    assert "if param.requires_grad" in build and "if p not in memo" in build
    assert "void search_unused_parameters(" in REDUCER_HPP.read_text()
    text = _markdown(EDGE)
    for phrase in ("compares the parameters' shapes (`_verify_param_shape_across_processes`)",
                   "torch's DDP is `Joinable` (its `join_hook`)",
                   "the default `divide_by_initial_world_size=True`",
                   "`_build_params_for_reducer` keeps `param.requires_grad` ones",
                   "torch deduplicates shared parameters too",
                   "(`Reducer::search_unused_parameters`)"):
        assert phrase in text, phrase


def test_claim19_unused_parameter_run_torch_with_the_flag_the_core_without():
    """The deep dive's unused-parameter cell (replayed by nbval): b used on rank 0 only is
    averaged with rank 1's zeros (2.0 / 2) by torch's DDP with find_unused_parameters and by the
    bucketed core without it; unused everywhere, torch leaves None and the core zeros."""
    from notebook_cells import stream_text

    stored = stream_text("deep/04_ddp_edge_cases.ipynb", "unused_parameters(wrapper")
    lines = [line for line in stored.splitlines() if line.startswith("[rank")]
    assert lines == [
        "[rank 0] DistributedDataParallel (find_unused_parameters=True):",
        "[rank 0]   b on rank 0 only: b.weight.grad[0, 0] = 1.0",
        "[rank 0]   b unused everywhere: b.weight.grad is None",
        # the core has no find_unused_parameters (it sends zeros): the label must not say so
        "[rank 0] BucketedDDP (no such flag: it sends zeros):",
        "[rank 0]   b on rank 0 only: b.weight.grad[0, 0] = 1.0",
        "[rank 0]   b unused everywhere: b.weight.grad max |g| = 0.0",
        "[rank 0] rank 0's own gradient was 2.0: rank 1 sent zeros for b"]


def test_claim_bucketed_ddp_builds_torchs_rebuilt_buckets():
    """Deep dive 04 inside torch's DDP: the stack's buckets at cap 0.5 as BucketedDDP builds them
    (torch's after the rebuild, which walks the ready order); with find_unused_parameters=True
    torch keeps its construction-time buckets."""
    from ddp_lesson.core.bucketed_ddp import assign_buckets, bucket_size_limits, ddp_buckets
    from ddp_lesson.labs.torch_reducer import CAP_MB, make_stack

    nbytes = [p.numel() * p.element_size() for p in make_stack().parameters()]
    built = ddp_buckets(nbytes, CAP_MB)
    assert built == [[15, 14, 13, 12], [11, 10, 9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]
    assert built == assign_buckets(nbytes, bucket_size_limits(CAP_MB), order=range(15, -1, -1))
    theirs, _ = dist._compute_bucket_assignment_by_size(list(make_stack().parameters()),
                                                        bucket_size_limits(CAP_MB))
    assert theirs[::-1] == [[15], [11, 12, 13, 14], [7, 8, 9, 10], [3, 4, 5, 6], [0, 1, 2]]
    text = _markdown(INSIDE)
    assert ("makes the same four buckets, and so does our `BucketedDDP` from its first "
            "iteration") in text
    assert ("filled from index 0 and reversed: [15], [11–14], [7–10], [3–6], [0–2] (the cores "
            "take no `find_unused_parameters`") in text
    assert ("rebuilds its buckets once, before the second forward (with `static_graph`, the "
            "third)") in text
    from ddp_lesson.viz.ddp import REDUCER_MAP

    box = " ".join(REDUCER_MAP[3][2].split())
    assert "Rebuilt once, before forward 2 (static_graph: 3); never with find_unused_parameters" \
        in box
