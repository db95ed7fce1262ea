"""``ddp-lesson compare``: the package's own pair trains the same weights; a broken conversion
(no ``set_epoch``, the loss divided by R again) is flagged; the contract's edges are clear
errors."""
from __future__ import annotations

import pytest
import torch

from ddp_lesson import cli
from ddp_lesson.convert import DDP, SINGLE
from ddp_lesson.convert.compare import (
    CompareError,
    compare_scripts,
    compare_weights,
    load_weights,
    run_ddp,
    run_single,
    split_argv,
)

TIMEOUT = 120   # seconds per run: the pair trains 12 steps of a 4-8-1 MLP


def _weights(scale=1.0):
    g = torch.Generator().manual_seed(0)
    return {"0.weight": torch.randn(8, 4, generator=g) * scale, "0.bias": torch.zeros(8)}


def test_within_tolerance_is_the_same_and_beyond_it_is_not():
    a = _weights()
    b = {k: v + 1e-7 for k, v in a.items()}
    same = compare_weights(a, b, tol=1e-5)
    assert same.same
    assert same.lines()[-1] == "verdict: the same weights, 2 tensors within --tol 1e-05"
    far = compare_weights(a, {k: v + 1e-3 for k, v in a.items()}, tol=1e-5)
    assert not far.same
    assert far.lines()[0].startswith("0.weight: max |diff| 1.0e-03")
    assert far.lines()[0].endswith("DIFFERENT")
    assert "verdict: DIFFERENT, 2 of 2 tensors beyond --tol 1e-05" in far.lines()
    assert any("set_epoch" in line for line in far.lines())
    assert all(len(line) <= 100 for line in far.lines())


def test_names_shapes_and_wrapper_prefixes(tmp_path):
    a = _weights()
    torch.save({"model": {"module." + k: v for k, v in a.items()}, "epoch": 2}, tmp_path / "c.pt")
    assert compare_weights(a, load_weights(tmp_path / "c.pt", "DDP")).same
    odd = compare_weights(a, {"0.weight": torch.zeros(4, 8), "1.bias": torch.zeros(1)})
    assert (odd.missing, odd.extra, odd.shapes) == (["0.bias"], ["1.bias"], ["0.weight"])
    assert not odd.same
    with pytest.raises(CompareError, match=r"the single run wrote no weights\.pt into "
                                           r"\$DDP_LESSON_OUT"):
        load_weights(tmp_path / "weights.pt", "single")


def test_bad_input_is_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(CompareError, match="no script"):
        compare_scripts(tmp_path / "nope.py", DDP)
    with pytest.raises(CompareError, match="--nproc-per-node must be >= 1, got 0"):
        compare_scripts(SINGLE, DDP, nproc_per_node=0)
    assert cli.main(["compare", str(SINGLE), str(DDP), "--tol", "-1"]) == 2
    assert "ddp-lesson compare: error: --tol must be >= 0, got -1" in capsys.readouterr().err
    assert split_argv(["a.py", "b.py", "--tol", "1", "--", "--out", "{out}"]) == \
        (["a.py", "b.py", "--tol", "1"], ["--out", "{out}"])


def test_help_states_the_contract(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = capsys.readouterr().out
    for words in ("$DDP_LESSON_OUT", "{out}", "model.state_dict()", "rank 0", "dropout p=0",
                  "seed + epoch", "another order", "exit status"):
        assert words in text


@pytest.mark.slow
def test_the_package_pair_trains_the_same_weights(capsys):
    code = cli.main(["compare", str(SINGLE), str(DDP), "--weights", "checkpoint.pt",
                     "--timeout", str(TIMEOUT), "--", "--out", "{out}"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    assert out[-1] == "verdict: the same weights, 4 tensors within --tol 1e-05"
    assert [line.split(":")[0] for line in out[2:-1]] == ["0.weight", "0.bias", "2.weight",
                                                          "2.bias"]


BROKEN = {
    "no set_epoch": ("        sampler.set_epoch(epoch)\n", "        pass\n"),
    "loss divided by R": ("scaler.scale(loss).backward()",
                          "scaler.scale(loss / world_size).backward()"),
}


@pytest.mark.slow
def test_broken_conversions_are_flagged(tmp_path):
    run_single(SINGLE, ["--out", "{out}"], tmp_path, TIMEOUT)
    reference = load_weights(tmp_path / "checkpoint.pt", "single")
    source = DDP.read_text()
    for name, (old, new) in BROKEN.items():
        assert source.count(old) == 1, name
        script = tmp_path / f"{name.replace(' ', '_')}.py"
        script.write_text(source.replace(old, new))
        out = tmp_path / name.replace(" ", "_")
        out.mkdir()
        run_ddp(script, ["--out", "{out}"], out, 2, TIMEOUT)
        result = compare_weights(reference, load_weights(out / "checkpoint.pt", "DDP"))
        assert not result.same, (name, result.lines())
        worst = max(d for _, d, _, _ in result.rows)
        assert worst > 1e-3, (name, worst)   # far beyond float rounding (6e-8 for the good pair)
