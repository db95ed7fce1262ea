"""Checkpoint and exact resume of the trainer: an interrupted then resumed run ends bit-identical.

Single process (in this process, cheap): stop after every step of a 2-epoch run in turn,
resume, compare with the uninterrupted run; and a real crash (an exception in the middle of
an epoch) resumed from the last periodic checkpoint. Two ranks (one torchrun launch running
the trainer several times): mid-epoch and epoch-boundary interruptions, with SyncBatchNorm and
gradient accumulation, and with this package's DDP wrappers.
"""
import json

import pytest
import torch

from ddp_lesson import train
from ddp_lesson.launch import run_torchrun
from ddp_lesson.models import build_model

# 16 samples, batch 4: 4 steps per epoch, 8 in all.
BASE = ["--epochs", "2", "--num-train", "16", "--num-val", "4", "-b", "4", "--size", "32", "64",
        "--width", "4"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread, as under torchrun: small models run faster without contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _load(path):
    return torch.load(path, weights_only=True)


def _same_tensors(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or list(a["state"]) != list(b["state"]):
        return False
    return all(_same_tensors(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    summary = train.main(BASE + ["--out", str(out)])
    return summary, _load(out / "checkpoint.pt")


@pytest.mark.parametrize("stop_after", range(1, 8))
def test_stop_after_any_step_then_resume_is_bit_identical(tmp_path, reference, stop_after,
                                                          capsys):
    ref_summary, ref_ckpt = reference
    first = train.main(BASE + ["--out", str(tmp_path), "--max-steps", str(stop_after)])
    assert first["stopped_early"] and first["global_step"] == stop_after
    mid = _load(tmp_path / "checkpoint.pt")
    assert (mid["epoch"], mid["step_in_epoch"]) == divmod(stop_after, 4) or \
        (stop_after == 4 and (mid["epoch"], mid["step_in_epoch"]) == (0, 4))
    assert mid["sampler"]["seed"] == 0
    # the cursor: samples of the epoch's permutation read (one process, 4 per step), the layout
    assert mid["cursor"] == {"epoch": mid["epoch"], "samples": mid["step_in_epoch"] * 4,
                             "world_size": 1, "grad_accum_steps": 1, "batch_size": 4}
    summary = train.main(BASE + ["--out", str(tmp_path)])
    ckpt = _load(tmp_path / "checkpoint.pt")
    assert _same_tensors(ckpt["model"], ref_ckpt["model"])
    assert _same_optimizer(ckpt["optimizer"], ref_ckpt["optimizer"])
    assert ckpt["scheduler"] == ref_ckpt["scheduler"]
    assert summary["step_losses"] == ref_summary["step_losses"]
    assert summary["history"] == ref_summary["history"]
    assert summary["resumed_from"]["global_step"] == stop_after
    out = capsys.readouterr().out
    assert f"stopped after global step {stop_after} (--max-steps {stop_after})" in out
    assert "resuming from " in out


# --amp fp16 with a GradScaler and clipping: the scaler's scale and growth tracker
# are part of the state; 0.7 is below some steps' norms (about 0.68-0.81 here), so clipping acts.
AMP_CLIP = ["--amp", "fp16", "--clip-grad-norm", "0.7"]


@pytest.fixture(scope="module")
def reference_amp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref_amp")
    summary = train.main(BASE + AMP_CLIP + ["--out", str(out)])
    return summary, _load(out / "checkpoint.pt")


@pytest.mark.parametrize("clip", ["1.0", "0.7"])
def test_amp_fp16_with_clipping_stopped_and_resumed_is_bit_identical(tmp_path, reference_amp,
                                                                     clip):
    if clip == "0.7":
        ref_summary, ref_ckpt = reference_amp
    else:  # the issue's own flags: --amp fp16 --clip-grad-norm 1.0
        ref_summary = train.main(BASE + ["--amp", "fp16", "--clip-grad-norm", clip, "--out",
                                         str(tmp_path / "ref")])
        ref_ckpt = _load(tmp_path / "ref" / "checkpoint.pt")
    flags = BASE + ["--amp", "fp16", "--clip-grad-norm", clip, "--out", str(tmp_path / "run")]
    first = train.main(flags + ["--max-steps", "3"])
    assert first["stopped_early"] and first["global_step"] == 3
    mid = _load(tmp_path / "run" / "checkpoint.pt")
    # the GradScaler's state travels with the checkpoint: 3 good steps since the start
    assert mid["scaler"]["scale"] == 65536.0 and mid["scaler"]["_growth_tracker"] == 3
    summary = train.main(flags)
    ckpt = _load(tmp_path / "run" / "checkpoint.pt")
    assert _same_tensors(ckpt["model"], ref_ckpt["model"])
    assert _same_optimizer(ckpt["optimizer"], ref_ckpt["optimizer"])
    assert ckpt["scaler"] == ref_ckpt["scaler"]
    assert ckpt["scaler"]["_growth_tracker"] == 8
    assert summary["step_losses"] == ref_summary["step_losses"]
    assert summary["grad_norms"] == ref_summary["grad_norms"]
    assert summary["history"] == ref_summary["history"]
    assert summary["config"]["amp"] == "fp16" and summary["amp_scale"] == 65536.0
    assert summary["skipped_steps"] == []
    # per-epoch record: mean and max of the norms before clipping, and how many were clipped
    norms = ref_summary["grad_norms"]
    assert len(norms) == 8 and all(n > 0 for n in norms)
    for e, entry in enumerate(ref_summary["history"]):
        mine = norms[4 * e: 4 * e + 4]
        assert entry["grad_norm_max"] == max(mine)
        assert entry["grad_norm_mean"] == pytest.approx(sum(mine) / 4, rel=1e-12)
        assert entry["clipped_steps"] == sum(n > float(clip) for n in mine)
        assert entry["skipped_steps"] == 0
    if clip == "0.7":
        assert sum(e["clipped_steps"] for e in ref_summary["history"]) >= 1


def test_amp_runs_differ_from_fp32_but_stay_close(reference, reference_amp, tmp_path):
    """Autocast changes the arithmetic (the losses are not fp32's) but not the lesson."""
    fp32 = reference[0]["step_losses"]
    bf16 = train.main(BASE + ["--amp", "bf16", "--out", str(tmp_path)])["step_losses"]
    for other in (bf16, reference_amp[0]["step_losses"]):
        assert other != fp32
        assert max(abs(a - b) for a, b in zip(other, fp32)) < 0.05


def test_a_crash_resumes_from_the_last_periodic_checkpoint(tmp_path, reference, monkeypatch):
    ref_summary, ref_ckpt = reference
    calls = {"n": 0}
    real_step = train.train_step

    def crashing_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # the machine dies in step 6; the last checkpoint is step 4
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train.main(BASE + ["--out", str(tmp_path), "--checkpoint-every-steps", "3"])
    monkeypatch.undo()
    # every 3 steps and at each epoch end: steps 3 and 4 were saved, step 6 never happened
    assert _load(tmp_path / "checkpoint.pt")["global_step"] == 4
    summary = train.main(BASE + ["--out", str(tmp_path), "--checkpoint-every-steps", "3"])
    assert _same_tensors(_load(tmp_path / "checkpoint.pt")["model"], ref_ckpt["model"])
    assert summary["step_losses"] == ref_summary["step_losses"]


def test_a_finished_run_run_again_only_evaluates(tmp_path, capsys):
    first = train.main(BASE + ["--out", str(tmp_path)])
    before = (tmp_path / "checkpoint.pt").read_bytes()
    again = train.main(BASE + ["--out", str(tmp_path)])
    assert "all 2 epochs done; nothing left to train" in capsys.readouterr().out
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert again["history"] == first["history"] and again["val_miou"] == first["val_miou"]


def test_no_resume_starts_over(tmp_path, reference, capsys):
    train.main(BASE + ["--out", str(tmp_path), "--max-steps", "2"])
    summary = train.main(BASE + ["--out", str(tmp_path), "--no-resume"])
    assert "resuming" not in capsys.readouterr().out
    assert summary["resumed_from"] is None
    assert summary["step_losses"] == reference[0]["step_losses"]


def test_the_checkpoint_holds_everything_named_in_the_issue(reference):
    ckpt = reference[1]
    for key in ("model", "optimizer", "scheduler", "epoch", "step_in_epoch", "sampler", "rng",
                "config", "global_step"):
        assert key in ckpt
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]) == (2, 0, 8)
    assert set(ckpt["rng"][0]) == {"torch", "numpy", "python", "cuda"}
    # a bare model loads it as it is (no "module." prefix): docs/pitfalls.md B12
    model = build_model("deeplab", width=4)
    model.load_state_dict(ckpt["model"], strict=True)


# ---- two ranks -----------------------------------------------------------------------------

TWO_RANKS = r'''
import gc, json, sys
import torch
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson import train
from ddp_lesson.models import build_model

env = init_distributed(timeout=60, announce=False)
base = json.loads(sys.argv[1])

def weights(out):
    return torch.load(f"{out}/checkpoint.pt", weights_only=True)

def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and list(a) == list(b)

res = {}
for tag, extra in (("plain", []), ("syncbn_accum", ["--sync-bn", "--grad-accum-steps", "2"]),
                   ("bucketed", ["--ddp", "bucketed"]), ("naive", ["--ddp", "naive"]),
                   ("amp_clip", ["--amp", "fp16", "--clip-grad-norm", "0.5",
                                 "--grad-accum-steps", "2"])):
    ref = train.main(base + extra + ["--out", f"ref_{tag}"])
    R = weights(f"ref_{tag}")
    stops = [2, 4] if tag == "plain" else [3]
    for k in stops:
        out = f"run_{tag}_{k}"
        train.main(base + extra + ["--out", out, "--max-steps", str(k)])
        s = train.main(base + extra + ["--out", out])
        C = weights(out)
        res[f"{tag}_{k}"] = {"model": same(R["model"], C["model"]),
                             "losses": s["step_losses"] == ref["step_losses"],
                             "history": s["history"] == ref["history"]}
    res[f"{tag}_weights"] = {k: v.float().sum().item() for k, v in R["model"].items()}
    res[f"{tag}_norms"] = ref["grad_norms"]  # this rank's own: compared across ranks
    res[f"{tag}_scaler"] = R.get("scaler")
    res[f"{tag}_steps"] = ref["steps_per_epoch"]
res["plain_loss_fell"] = all(a["train_loss"] > b["train_loss"]
                            for a, b in zip(ref["history"], ref["history"][1:]))
# notebook 06, section 3: global batch 8 as 2 processes x 4, with and without SyncBatchNorm
nb = ["--epochs", "1", "--num-train", "64", "--num-val", "8", "--size", "32", "64", "--width", "8",
      "-b", "4"]
res["nb05_two"] = train.main(nb + ["--sync-bn", "--out", "nb05_two"])["step_losses"]
res["nb05_plain"] = train.main(nb + ["--out", "nb05_plain"])["step_losses"]
# ... and as 2 processes x 2 samples x 2 accumulation steps (SyncBatchNorm over 4 images)
res["nb05_accum"] = train.main(nb + ["-b", "2", "--grad-accum-steps", "2", "--sync-bn",
                                     "--out", "nb05_accum"])["step_losses"]
# clipping: the norm of the all-reduced gradient, the same global batch of 8 as one process
res["clip_norms"] = train.main(base + ["--sync-bn", "--clip-grad-norm", "0.5", "--out",
                                       "clip"])["grad_norms"]
# --bucket-cap-mb, --static-graph, --gradient-as-bucket-view reach the wrappers
from ddp_lesson.config import parse_config
t = train.Trainer(parse_config(base + ["--width", "16", "--ddp", "bucketed", "--bucket-cap-mb",
                                       "0.25", "--out", "wb"]), env)
res["bucketed_buckets"] = len(t.model.bucket_indices)
t = train.Trainer(parse_config(base + ["--bucket-cap-mb", "0.25", "--static-graph",
                                       "--gradient-as-bucket-view", "--out", "wt"]), env)
res["torch_ddp"] = [t.model.bucket_bytes_cap, t.model.static_graph,
                    t.model.gradient_as_bucket_view]
del t
gc.collect()
# a checkpoint written under DDP loads into a bare model
bare = build_model("deeplab", width=4)
bare.load_state_dict(weights("ref_plain")["model"], strict=True)
res["bare_load"] = True
print(json.dumps(res))
import gc
gc.collect()  # free DDP wrappers (reference cycles) before the process group goes
cleanup()
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_interrupted_and_resumed_are_bit_identical(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    # 32 samples on 2 ranks, batch 4: 4 steps per epoch (2 with accumulation 2)
    base = ["--epochs", "2", "--num-train", "32", "--num-val", "4", "-b", "4", "--size", "32",
            "64", "--width", "4"]
    result = run_torchrun(str(script), [json.dumps(base)], nproc_per_node=2, timeout=240,
                          live=False, backend="gloo", cwd=tmp_path)
    res = json.loads(result.rank_lines(0)[-1])
    res1 = json.loads(result.rank_lines(1)[-1])
    for key in ("plain_2", "plain_4", "syncbn_accum_3", "bucketed_3", "naive_3", "amp_clip_3"):
        assert res[key] == {"model": True, "losses": True, "history": True}, key
    # fp16 + clipping + accumulation on 2 ranks: one norm per optimizer step (clipped once,
    # after the micro-batch that all-reduces), the same bit for bit on both ranks
    assert len(res["amp_clip_norms"]) == 4 and all(n > 0 for n in res["amp_clip_norms"])
    assert res["amp_clip_norms"] == res1["amp_clip_norms"]
    assert res["amp_clip_scaler"]["scale"] == 65536.0
    assert res["amp_clip_scaler"] == res1["amp_clip_scaler"]
    assert res["plain_norms"] == [None] * 8  # no clipping, no norm
    # ... and fp32 clipping: rank 0 == rank 1 bit for bit, and within 1e-4 (relative) of one
    # process on the same global batch of 8 (SyncBatchNorm: the same function; the sums are
    # taken in another order, hence not bit for bit)
    assert res["clip_norms"] == res1["clip_norms"] and len(res["clip_norms"]) == 8
    one_clip = train.main(base + ["-b", "8", "--sync-bn", "--clip-grad-norm", "0.5", "--out",
                                  str(tmp_path / "clip_one")])["grad_norms"]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(res["clip_norms"], one_clip)), \
        (res["clip_norms"], one_clip)
    assert len(one_clip) == 8
    # the wrapper flags reach the wrappers: the default-width model (about 1.1 MB of
    # gradients) in several 0.25 MB buckets; torch's DDP with its three options
    assert res["bucketed_buckets"] > 1
    assert res["torch_ddp"] == [int(0.25 * 1024 * 1024), True, True]
    assert res["plain_steps"] == 4 and res["syncbn_accum_steps"] == 2
    # the package's wrappers train the very same weights as torch's DDP
    assert res["bucketed_weights"] == res["plain_weights"]
    assert res["naive_weights"] == res["plain_weights"]
    assert res["bare_load"]
    assert res["plain_loss_fell"]
    # notebook 06, section 3: the same global batch of 8 on one process (in this process)
    one = train.main(["--epochs", "1", "--num-train", "64", "--num-val", "8", "--size", "32",
                      "64", "--width", "8", "-b", "8", "--sync-bn", "--out",
                      str(tmp_path / "nb05_one")])["step_losses"]
    two, plain = res["nb05_two"], res["nb05_plain"]
    assert len(one) == len(two) == len(plain) == 8
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-3
    assert abs(one[0] - two[0]) < 1e-5       # SyncBatchNorm: the same function
    assert abs(one[0] - plain[0]) >= 1e-5    # per-rank statistics: a different one
    # accumulation: the same global batch of 8 as one process with micro-batches of 4 (the
    # statistics SyncBatchNorm sees under 2 ranks x 2 samples), not as one process at batch 8
    one_accum = train.main(["--epochs", "1", "--num-train", "64", "--num-val", "8", "--size",
                            "32", "64", "--width", "8", "-b", "4", "--grad-accum-steps", "2",
                            "--sync-bn", "--out", str(tmp_path / "nb05_one_accum")])["step_losses"]
    accum = res["nb05_accum"]
    assert len(accum) == len(one_accum) == 8
    assert max(abs(a - b) for a, b in zip(accum, one_accum)) < 1e-3
    assert abs(accum[0] - one_accum[0]) < 1e-5
    assert abs(accum[0] - one[0]) >= 1e-5    # BatchNorm over 4 images, not 8


THREE_RANKS = r'''
import gc, json, sys
import torch
from ddp_lesson.env import init_distributed, cleanup
from ddp_lesson import train

env = init_distributed(timeout=60, announce=False)
base = json.loads(sys.argv[1])
ref = train.main(base + ["--out", "ref"])
train.main(base + ["--out", "run", "--max-steps", "3"])
resumed = train.main(base + ["--out", "run"])
a = torch.load("ref/checkpoint.pt", weights_only=True)["model"]
b = torch.load("run/checkpoint.pt", weights_only=True)["model"]
print(json.dumps({"model": all(torch.equal(a[k], b[k]) for k in a),
                  "losses": ref["step_losses"] == resumed["step_losses"]}))
gc.collect()  # free DDP wrappers (reference cycles) before the process group goes
cleanup()
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_ranks_resume_is_bit_identical_with_torch_ddp(tmp_path):
    """With 3 ranks the gradient sum's order depends on DDP's bucket layout, which torch's
    DDP rebuilds after its first backward: the resumed wrapper must get the same layout."""
    script = tmp_path / "three_ranks.py"
    script.write_text(THREE_RANKS)
    base = ["--epochs", "2", "--num-train", "48", "--num-val", "3", "-b", "4", "--size", "32",
            "64", "--width", "4"]
    result = run_torchrun(str(script), [json.dumps(base)], nproc_per_node=3, timeout=240,
                          live=False, backend="gloo", cwd=tmp_path)
    assert json.loads(result.rank_lines(0)[-1]) == {"model": True, "losses": True}
