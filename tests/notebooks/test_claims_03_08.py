"""Notebooks 03 and 08: what their prose says about torch's collectives and DDP's memory, bound
to torch 2.13's source and to the stored runs that show it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from notebook_cells import stream_text

ROOT = Path(__file__).resolve().parents[2]
TORCH = Path(torch.__file__).parent


def _prose(name: str) -> str:
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return " ".join(text.split())


def _docstring(src: str, signature: str) -> str:
    start = src.index(signature)
    return src[start:src.index('"""', src.index('"""', start) + 3)]


def test_03_only_barrier_promises_that_every_rank_has_entered():
    c10d = (TORCH / "distributed" / "distributed_c10d.py").read_text()
    barrier = _docstring(c10d, "def barrier(")
    assert "blocks processes until the whole group enters this function" in barrier
    # NCCL's barrier is special-cased to block the CPU thread: its other calls do not
    assert "`ProcessGroupNCCL` now blocks the cpu thread till the completion of the barrier" in barrier
    monitored = _docstring(c10d, "def monitored_barrier(")
    assert "will block all processes/ranks in the group" in monitored
    # what every collective does require: the same order on every rank
    new_group = _docstring(c10d, "def new_group(")
    assert "globally consistent execution order of collectives across" in new_group
    assert "the communication kernel is\n        enqueued on a separate CUDA stream" in new_group
    for name in ("all_reduce", "broadcast", "reduce"):
        doc = _docstring(c10d, f"def {name}(")
        assert "blocks processes until" not in doc     # no such promise for the others


def test_03_prose_says_what_a_collective_promises():
    prose = _prose("03_collectives.ipynb")
    assert "no rank leaves it before all have entered" not in prose
    assert "every rank must call every collective, in the same order" in prose
    assert "The *result* needs every rank's input" in prose
    assert "the call is **not** a synchronisation point in general" in prose
    assert "NCCL's calls return once the work is enqueued" in prose
    assert "Only `barrier` (and `monitored_barrier`) promises" in prose
    assert "Collectives are called by every rank and synchronise them" not in prose
    deep = _prose("deep/03_collective_costs.ipynb")
    assert "until the slowest rank has finished" not in deep
    assert "its left neighbour's chunk has arrived" in deep


def test_03_stored_run_shows_a_rank_leaving_a_broadcast_early():
    text = stream_text("deep/03_collective_costs.ipynb", "time.sleep(2.0)")
    assert "[rank 0] every rank got 7: True" in text
    assert "[rank 0] rank 2 left before rank 1 entered: True" in text
    assert "[rank 0] rank 0 left after rank 1 entered: True" in text


def test_08_ddp_memory_is_the_papers_baseline_plus_torchs_bucket_copy():
    ddp = (TORCH / "nn" / "parallel" / "distributed.py").read_text()
    view = ddp[ddp.index("gradient_as_bucket_view (bool):"):ddp.index("static_graph (bool):")]
    view = " ".join(view.split())
    assert "gradients will be views pointing to different offsets of ``allreduce`` communication" \
           " buckets" in view
    assert "the saved memory size will be equal to the total gradients size" in view
    assert "gradient_as_bucket_view=False" in ddp          # the default: a separate bucket copy
    prose = _prose("08_beyond_ddp_zero_fsdp.ipynb")
    assert "In the paper's count, DDP replicates all of it: $16\\Psi$ bytes" in prose
    assert ("Unless `gradient_as_bucket_view=True`, it keeps a second copy of the gradients in its "
            "all-reduce buckets") in prose
    assert "autocast keeps the weights in fp32" in prose
    assert "4 + 4 + 8 = 16 bytes, plus 4 for the bucket copy" in prose


def test_08_autocast_keeps_fp32_weights_and_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16                      # the op ran in 16 bits
    out.float().sum().backward()
    assert layer.weight.dtype == torch.float32              # the stored weight did not change
    assert layer.weight.grad.dtype == torch.float32         # nor does its gradient's dtype
