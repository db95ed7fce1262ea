"""ZeRO-1's sharded optimizer state through torch.distributed.checkpoint, loaded at another world
size (ddp_lesson.zero.dcp_save / dcp_load, the lab ddp_lesson.labs.zero_dcp).

Five real runs of the lab: 6 steps at R=2 and at R=1, each saving a DCP checkpoint after step 3
and training on (the uninterrupted weights); the R=2 checkpoint loaded at R'=1 and at R'=2, the
R=1 checkpoint loaded at R'=2, each training the last 3 steps.
"""
from __future__ import annotations

import json
import types

import pytest
import torch

from ddp_lesson.labs.zero_dcp import compare
from ddp_lesson.launch import run_torchrun_many
from ddp_lesson.zero import dcp_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LAB = "ddp_lesson.labs.zero_dcp"
N_PARAMS = 29  # TinyGPT's parameter tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero_dcp")

    def job(nproc, *args):
        return dict(target=LAB, module=True, args=[str(a) for a in args], nproc_per_node=nproc,
                    timeout=180, live=False, backend="gloo")

    first = run_torchrun_many({
        "s2": job(2, "--steps", 6, "--save-at", 3, "--save", d / "ck2", "--out", d / "s2.pt"),
        "s1": job(1, "--steps", 6, "--save-at", 3, "--save", d / "ck1", "--out", d / "s1.pt"),
    })
    second = run_torchrun_many({
        "r21": job(1, "--steps", 3, "--load", d / "ck2", "--out", d / "r21.pt",
                   "--dump-loaded", d / "l21.pt"),
        "r12": job(2, "--steps", 3, "--load", d / "ck1", "--out", d / "r12.pt",
                   "--dump-loaded", d / "l12.pt"),
        "r22": job(2, "--steps", 3, "--load", d / "ck2", "--out", d / "r22.pt"),
    })
    results = {**first, **second}
    lines = {name: [json.loads(line) for r in sorted(res.outputs)
                    for line in res.rank_lines(r) if line.startswith("{")]
             for name, res in results.items()}
    return {"dir": d, "lines": lines,
            "w": {n: torch.load(d / f"{n}.pt") for n in ("s1", "s2", "r21", "r12", "r22")}}


def _max_delta(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_each_rank_holds_the_state_of_the_parameters_it_owns_at_its_world_size(runs):
    for name in ("s2", "r12", "r22"):
        ranks = sorted(runs["lines"][name], key=lambda e: e["rank"])
        assert [e["rank"] for e in ranks] == [0, 1]
        assert [e["owned"] for e in ranks] == [6, 23]  # whole tensors, largest first
        assert all(0 < e["owned"] < N_PARAMS and e["state_tensors"] == e["owned"]
                   and e["step"] == 6 for e in ranks), ranks
    for name in ("s1", "r21"):
        (only,) = runs["lines"][name]
        assert (only["owned"], only["state_tensors"], only["step"]) == (N_PARAMS, N_PARAMS, 6)


def test_the_state_loaded_at_another_world_size_is_the_state_saved(runs):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for ckpt, loaded in (("ck2", "l21.pt"), ("ck1", "l12.pt")):
        flat = runs["dir"] / f"{ckpt}.flat.pt"
        dcp_to_torch_save(runs["dir"] / ckpt, flat)
        saved = torch.load(flat, weights_only=False)
        state = torch.load(runs["dir"] / loaded, weights_only=False)["state"]
        assert sorted(state) == list(range(N_PARAMS))
        for i, entries in state.items():
            assert sorted(entries) == ["exp_avg", "exp_avg_sq", "step"]
            for name, value in entries.items():
                assert torch.equal(value, saved[f"optim.state.{i}.{name}"]), (ckpt, i, name)
        assert state[0]["step"].item() == 3.0


def test_resumed_at_the_same_world_size_is_bit_identical_to_the_uninterrupted_run(runs):
    w = runs["w"]
    assert all(torch.equal(w["r22"][k], w["s2"][k]) for k in w["s2"])


def test_resumed_at_another_world_size_differs_only_by_the_summation_order(runs):
    """R -> R' changes how each step's gradient mean is summed (one local mean of 8 rows against
    two means of 4 rows all-reduced): the same size of difference as two uninterrupted runs at
    R=1 and R=2, never more."""
    w = runs["w"]
    between_world_sizes = _max_delta(w["s1"], w["s2"])
    assert 0 < between_world_sizes < 1e-4
    for resumed, uninterrupted in (("r21", "s2"), ("r12", "s1")):
        assert 0 < _max_delta(w[resumed], w[uninterrupted]) < 2 * between_world_sizes
    # what the 08 deep dive prints for 2 -> 1, through the lab's own comparison
    d = runs["dir"]
    assert compare(d / "r21.pt", d / "s2.pt") == {"max |dw| below 0.0001": True,
                                                  "bit-identical": False}
    assert compare(d / "r22.pt", d / "s2.pt")["bit-identical"] is True


def test_a_checkpoint_of_another_model_is_refused_naming_the_counts(runs):
    model = torch.nn.Linear(3, 2)
    optimizer = types.SimpleNamespace(params=list(model.parameters()), owner=[0, 0], rank=0,
                                      process_group=None)
    with pytest.raises(ValueError, match=r"holds \d+ model entries, the model 2: missing "
                                         r"\['model.bias', 'model.weight'\]"):
        dcp_load(runs["dir"] / "ck2", model, optimizer)
