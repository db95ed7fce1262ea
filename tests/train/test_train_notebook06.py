"""Notebook 06's sentences about torch and about the stored benchmarks, bound to their sources;
the scaling study and mixed precision are read from its deep dive
(``notebooks/deep/06_scaling_and_mixed_precision.ipynb``).

Each test reads the fact from where it lives (torch's installed source and constants, the
stored ``benchmarks/scaling.csv`` through ``ddp_lesson.bench.claims``) and finds the sentence
that states it in the notebook, so a torch upgrade or a re-measured benchmark that changes the
fact fails here, naming it. No process is started.
"""
from __future__ import annotations

import inspect
import re
from datetime import timedelta
from pathlib import Path

import nbformat
import torch
import torch.distributed.constants as constants

from ddp_lesson import syncbn
from ddp_lesson.bench.claims import CLAIMS, NB05, load

ROOT = Path(__file__).resolve().parents[2]
NB = ROOT / "notebooks" / "06_training_the_seed_model.ipynb"
DEEP = ROOT / NB05  # the deep dive: scaling study, mixed precision and clipping


def _cells(nb: Path = NB):
    return nbformat.read(nb, as_version=4).cells


def _markdown(nb: Path = NB) -> str:
    return re.sub(r"\s+", " ", "\n".join(c.source for c in _cells(nb) if c.cell_type == "markdown"))


def _output_of(marker: str, nb: Path = NB) -> str:
    cell = next(c for c in _cells(nb) if c.cell_type == "code" and marker in c.source)
    return "".join(o.get("text", "") for o in cell.outputs)


def test_default_timeouts_stated_are_torchs():
    """The seed's init_process_group has no explicit timeout: torch's defaults apply."""
    assert constants.default_pg_timeout == timedelta(minutes=30)  # gloo (non-NCCL backends)
    nccl = constants.default_pg_nccl_timeout
    if nccl is None:  # a CPU build: the NCCL constant lives in the C++ header only
        header = (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/"
                  "ProcessGroupNCCL.hpp").read_text()
        m = re.search(r"kProcessGroupNCCLDefaultTimeout\s*=\s*std::chrono::milliseconds\("
                      r"(\d+) \* (\d+) \* (\d+)\)", header)
        nccl = timedelta(milliseconds=int(m[1]) * int(m[2]) * int(m[3]))
    assert nccl == timedelta(minutes=10)
    # the values are read from the torch installed (any build: a CUDA build has the NCCL
    # constant in Python, a CPU build in the header only); the prose names the version it
    # was written against, and these values hold for every torch the tests run on
    assert ("no explicit timeout, so torch's defaults apply (10 minutes for NCCL and 30 for gloo "
            "in torch 2.13)") in _markdown()


def test_syncbn_gathers_in_torch_and_reduces_in_the_package():
    fwd = inspect.getsource(torch.nn.modules._functions.SyncBatchNorm.forward)
    bwd = inspect.getsource(torch.nn.modules._functions.SyncBatchNorm.backward)
    assert "dist.all_gather(" in fwd and "all_reduce(" not in fwd
    assert "all_reduce(" in bwd
    ours = inspect.getsource(syncbn)
    assert "dist.all_reduce(sums" in ours and "all_gather" not in ours.split("class ")[1]
    text = _markdown()
    assert "Torch's **all-gathers** every rank's mean, inverse standard deviation and count" in text
    assert "the package's **all-reduces** the per-channel sums, sums of squares and counts" in text


def test_no_unbound_claims_left():
    text = _markdown() + " " + _markdown(DEEP)
    assert "mIoU about" not in text          # the trained model's mIoU is only in the ignored log
    assert "dedicated hardware" not in text and "off the compute cores" not in text
    assert "compete with the compute for memory bandwidth" in _markdown(DEEP)
    assert "three numbers per channel" not in text  # collective counts of SyncBN: not stated


def test_ddp_divides_each_gradient_before_the_sum():
    """Section 3: DDP divides each rank's gradient by world_size, then sums (torch's source).

    Torch's default all-reduce hook divides the bucket and then all-reduces it (SUM), "first to
    avoid overflow"; the reducer's ``div_factor_`` is the process-group size. A run of this
    order is ``tests/ddp/test_torch_reducer.py``'s fp16 case (40000 pre-divided, not inf).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = inspect.getsource(default_hooks._allreduce_fut)
    assert "Apply the division first to avoid overflow" in hook
    assert hook.index("tensor.div_(group_to_use.size())") < hook.index("dist.all_reduce(tensor")
    header = (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/"
              "reducer.hpp").read_text()
    assert "Equal to the process group size" in header and "int div_factor_;" in header
    text = _markdown()
    assert "divides the summed gradients" not in text
    assert ("because DDP divides each rank's gradient by `world_size` before it sums them "
            "(notebooks 01 and 04)") in text


def test_scaling_claims_stated_and_printed_from_the_csv():
    tables = load(ROOT)
    mine = [c for c in CLAIMS if c.prose == NB05]
    assert len(mine) == 3
    text = _markdown(DEEP)
    for claim in mine:
        assert re.sub(r"\s+", " ", claim.sentence) in text, claim.sentence
        assert claim.verdict(tables) == claim.says, claim.id
    printed = _output_of("claim.line(tables)", DEEP)
    for claim in mine:
        assert claim.line(tables) + "\n" in printed
    rows = tables["scaling"]
    one = {r["mode"]: r for r in rows if r["nprocs"] == 1}
    weak, strong = (round(one[m]["comm_exposed_s"] * 1e3) for m in ("weak", "strong"))
    assert (weak, strong) == (15, 25)
    assert f"'exposed communication' at 1 process: weak {weak} ms, strong {strong} ms" in printed
    assert (f"At one process 'exposed communication' ({weak} ms weak, {strong} ms strong) is not "
            "communication: it is DDP's own work (torch's reducer has no special case for a world "
            "size of 1), the pixel-count all_reduce call, and timing noise. Read it as a floor to "
            "subtract.") in text
    load_avg = round(sum(r["load_avg_1min"] for r in rows) / len(rows))
    assert f"load average during the study: {load_avg}\n" in printed
    assert f"load average was about {load_avg} during the study" in text
    assert "a bigger share of the 2 cores" in text


def test_section_3_runs_at_once_and_shows_live_progress():
    cell = next(c for c in _cells() if c.cell_type == "code" and "run_torchrun_many(" in c.source)
    assert "live=False" not in cell.source
    widgets = [o for o in cell.outputs if o.get("output_type") == "display_data"]
    # one live status line for the five jobs started at once; its stored text is plain (no
    # widget repr): every process of the five jobs, 1 + 2 + 2 + 2 + 1
    assert len(widgets) == 1
    assert widgets[0]["data"] == {"text/plain": "torchrun: 8 processes"}


def test_mixed_precision_is_one_launch_of_the_lab():
    cells = [c for c in _cells(DEEP) if c.cell_type == "code" and "amp_clip" in c.source]
    assert len(cells) == 1 and cells[0].source.startswith("%%torchrun --nproc-per-node 2")
    assert not any("amp_clip" in c.source for c in _cells())  # one launch, in the deep dive
    out = _output_of("amp_clip", DEEP)
    assert (
        "[rank 0]   step 5: own gradient finite True, after all_reduce False; skipped steps [5]"
        in out
    )
    assert (
        "[rank 1]   step 5: own gradient finite False, after all_reduce False; skipped steps [5]"
        in out
    )


RESIZE = ROOT / "notebooks" / "deep" / "06_resume_at_another_world_size.ipynb"


def test_resize_deep_dive_prints_what_the_layout_computes():
    """The deep dive's dealt micro-batches and its resumed run's lines, from the package."""
    from ddp_lesson.config import derived_values, layout_for, parse_config
    from ddp_lesson.layout import DataLayout, LayoutBatchSampler

    layout = DataLayout(num_samples=16, world_size=2, grad_accum_steps=1, batch_size=2, seed=0)

    def dealt(world_size, rank, start_step=0):
        sampler = LayoutBatchSampler(layout, world_size, rank)
        sampler.set_epoch(1)
        sampler.start_step = start_step
        return list(sampler)

    out = _output_of("LayoutBatchSampler(layout, world_size, rank)", RESIZE)
    assert f"R=2, rank 0: {dealt(2, 0)}\nR=2, rank 1: {dealt(2, 1)}\n" in out
    assert "rank 0 = torch's sampler and loader: True" in out
    assert f"after 2 steps the cursor is at sample {layout.cursor(2)} of {layout.cursor(4)}" in out
    assert f"on R'=1, K' = 2 from step 2: {dealt(1, 0, start_step=2)}" in out

    cfg = parse_config(["--num-train", "64", "-b", "4"])
    lay = layout_for(cfg, 64, 2, 1)
    d = derived_values(cfg, 1, layout=lay)
    resumed = _output_of("run_torchrun(", RESIZE)
    assert (f"batch per rank 4  global batch {d['global_batch']} (= 4 x 1 x "
            f"{d['grad_accum_steps']} accumulation steps)") in resumed
    assert f"epoch 1/1, step 5/{d['steps_per_epoch']} (global step 5)" in resumed
    assert (f"global batch {d['global_batch']} kept; cursor at sample {lay.cursor(5)} of "
            f"{d['samples_per_epoch']} this epoch") in resumed
    compared = _output_of("weights bit-identical", RESIZE)
    steps = d["steps_per_epoch"]
    assert "weights bit-identical to the uninterrupted 2-process run: True" in compared
    # BatchNorm counts its forwards: rank 0 of 2 ran 8; 5 on 2 then 3 steps x K'=2 on 1 ran 11
    assert (f"rank 0 of 2 processes {steps} | 5 on 2, then 3 x 2 on 1: "
            f"{5 + (steps - 5) * d['grad_accum_steps']}") in compared


def test_resize_runs_show_live_progress():
    cell = next(c for c in _cells(RESIZE) if c.cell_type == "code" and "run_torchrun(" in c.source)
    assert "live=False" not in cell.source
    shown = [o for o in cell.outputs if o.get("output_type") == "display_data"]
    assert [o["data"] for o in shown] == [{"text/plain": "torchrun: 4 processes"}]
