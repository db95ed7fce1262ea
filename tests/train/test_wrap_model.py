"""``--ddp naive|bucketed`` run the cores of notebook 04 and train what ``--ddp torch`` trains.

One 2-rank torchrun launch: :func:`ddp_lesson.train.wrap_model` returns the classes of
``ddp_lesson/core/``, and the trainer with each wrapper (BatchNorm model, gradient accumulation
through ``no_sync()``) writes the same checkpoint, parameters and BatchNorm buffers, bit for bit,
with the same losses and validation scores; so do a run stopped under one wrapper and resumed
under another, and runs with ``--amp bf16 --clip-grad-norm --sync-bn``. With 2 ranks an
averaged element is one addition, ``a/2 + b/2``, whatever bucket carries it, so equality is
exact.
"""
import json

import pytest

from ddp_lesson.launch import run_torchrun

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, sys
import torch
from ddp_lesson import train
from ddp_lesson.core.bucketed_ddp import BucketedDDP
from ddp_lesson.core.naive_ddp import NaiveDDP
from ddp_lesson.env import cleanup, init_distributed
from ddp_lesson.models import build_model

env = init_distributed(timeout=60, announce=False)
base = json.loads(sys.argv[1])
cpu = torch.device("cpu")
res = {"is_core": [type(train.wrap_model(build_model("tiny", width=4), "naive", env, cpu))
                   is NaiveDDP,
                   type(train.wrap_model(build_model("tiny", width=4), "bucketed", env, cpu))
                   is BucketedDDP]}
summaries, states = {}, {}
cap = ["--bucket-cap-mb", "0.01"]  # several buckets (NaiveDDP has none: refused there)
for kind, extra in (("torch", cap), ("naive", []), ("bucketed", cap)):
    summaries[kind] = train.main(base + extra + ["--ddp", kind, "--out", kind])
    states[kind] = torch.load(f"{kind}/checkpoint.pt", weights_only=True)["model"]
ref = states["torch"]
for kind in ("naive", "bucketed"):
    res[kind] = {"keys": list(states[kind]) == list(ref),
                 "differ": [k for k in ref if not torch.equal(ref[k], states[kind][k])],
                 "losses": summaries[kind]["step_losses"] == summaries["torch"]["step_losses"],
                 "history": summaries[kind]["history"] == summaries["torch"]["history"]}
res["buffers"] = sorted({k.rsplit(".", 1)[1] for k, _ in build_model("deeplab", width=4)
                         .named_buffers()})
res["steps"] = summaries["torch"]["steps_per_epoch"]
# a checkpoint holds the bare module: a run stopped under one wrapper resumes under another
def wrapper(kind):
    return (cap if kind != "naive" else []) + ["--ddp", kind]
for a, b in (("torch", "naive"), ("bucketed", "torch")):
    out = f"resume_{a}_{b}"
    train.main(base + wrapper(a) + ["--out", out, "--max-steps", "1"])
    s = train.main(base + wrapper(b) + ["--out", out])
    got = torch.load(f"{out}/checkpoint.pt", weights_only=True)["model"]
    res[out] = {"differ": [k for k in ref if not torch.equal(ref[k], got[k])],
                "losses": s["step_losses"] == summaries["torch"]["step_losses"]}
# the trainer's other options with the cores: bf16 autocast, clipping, SyncBatchNorm
extra = ["--amp", "bf16", "--clip-grad-norm", "0.5", "--sync-bn"]
opts = {kind: train.main(base + extra + wrapper(kind) + ["--out", f"opts_{kind}"])
        for kind in ("torch", "naive", "bucketed")}
ref_opts = torch.load("opts_torch/checkpoint.pt", weights_only=True)["model"]
for kind in ("naive", "bucketed"):
    got = torch.load(f"opts_{kind}/checkpoint.pt", weights_only=True)["model"]
    res[f"opts_{kind}"] = {"differ": [k for k in ref_opts if not torch.equal(ref_opts[k], got[k])],
                           "losses": opts[kind]["step_losses"] == opts["torch"]["step_losses"],
                           "norms": opts[kind]["grad_norms"] == opts["torch"]["grad_norms"]}
print(json.dumps(res))
import gc
gc.collect()
cleanup()
'''


@pytest.mark.timeout(200)
def test_naive_and_bucketed_train_what_torchs_ddp_trains(tmp_path):
    script = tmp_path / "wrap.py"
    script.write_text(SCRIPT)
    # 16 samples on 2 ranks, 2 per micro-batch, 2 micro-batches per step: 2 steps per epoch
    base = ["--epochs", "1", "--num-train", "16", "--num-val", "4", "-b", "2", "--size", "32",
            "64", "--width", "4", "--grad-accum-steps", "2"]
    result = run_torchrun(str(script), [json.dumps(base)], nproc_per_node=2, timeout=200,
                          live=False, backend="gloo", cwd=tmp_path)
    res = json.loads(result.rank_lines(0)[-1])
    assert res["is_core"] == [True, True]
    assert res["steps"] == 2
    # the model holds BatchNorm buffers, compared with the parameters
    assert res["buffers"] == ["num_batches_tracked", "running_mean", "running_var"]
    for kind in ("naive", "bucketed"):
        assert res[kind] == {"keys": True, "differ": [], "losses": True, "history": True}, kind
    # resumed under another wrapper: the weights and losses of the uninterrupted run
    for key in ("resume_torch_naive", "resume_bucketed_torch"):
        assert res[key] == {"differ": [], "losses": True}, key
    # --amp bf16 --clip-grad-norm --sync-bn: the cores train what torch's DDP trains
    for kind in ("naive", "bucketed"):
        assert res[f"opts_{kind}"] == {"differ": [], "losses": True, "norms": True}, kind
