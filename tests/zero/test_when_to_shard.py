"""The FSDP decision, measured (notebook 08, deep/08_when_to_shard): the activations autograd
saves, with and without checkpointing; the decision rule against bytes measured in this
process; the calculator; exercise 08.6's checker and the slips it names."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

from ddp_lesson.exercises import reference
from ddp_lesson.exercises.core import run_candidates
from ddp_lesson.gpt import TinyGPT
from ddp_lesson.memory import (
    checkpoint_blocks,
    decision_lines,
    optimizer_state_bytes,
    per_rank_bytes,
    saved_activation_bytes,
    smallest_stage,
)
from ddp_lesson.widgets import shard_calculator

ROOT = Path(__file__).resolve().parents[2]
T, C = 32, 64   # TinyGPT's block_size and n_embd


def test_saved_bytes_of_a_small_mlp_worked_out_by_hand():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    x = torch.randn(3, 10)
    # Linear 1 saves its input (3 x 10 fp32 = 120 B); ReLU saves its output (3 x 20 = 240 B),
    # the very tensor Linear 2 saves as its input (one storage, counted once); weights excluded
    assert saved_activation_bytes(lambda: m(x).sum(), list(m.parameters()))[0] == 360
    # not excluded, Linear 2's weight (5 x 20 fp32 = 400 B) counts too: it is saved for the
    # gradient of Linear 2's input; Linear 1's is not, x needing no gradient
    assert saved_activation_bytes(lambda: m(x).sum())[0] == 360 + 4 * 5 * 20


def activations(batch, n_layer=2, checkpointed=False):
    """(saved bytes, gradients) of TinyGPT's forward and backward on ``batch`` sequences."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=103, n_layer=n_layer)
    if checkpointed:
        checkpoint_blocks(model.blocks)
    idx = torch.randint(0, 103, (batch, T), generator=torch.Generator().manual_seed(1))
    nbytes, loss = saved_activation_bytes(lambda: model(idx, idx.roll(-1, 1))[1],
                                          list(model.parameters()))
    loss.backward()
    return nbytes, [p.grad for p in model.parameters()]


def test_activations_grow_linearly_with_the_micro_batch():
    a4, a8, a12 = (activations(b)[0] for b in (4, 8, 12))
    assert a8 - a4 == a12 - a8 > 0
    assert 0 <= 2 * a4 - a8 < 1000   # what no batch changes: the positions (32 int64 = 256 B)


def test_checkpointing_keeps_each_blocks_input_only_and_the_same_gradients():
    plain = [activations(4, n)[0] for n in (1, 2, 4)]
    ckpt = [activations(4, n, checkpointed=True)[0] for n in (1, 2, 4)]
    # one more block costs its input, (B, T, C) fp32, with checkpointing
    assert ckpt[1] - ckpt[0] == (ckpt[2] - ckpt[1]) / 2 == 4 * T * C * 4
    assert plain[1] - plain[0] > 10 * (ckpt[1] - ckpt[0])
    (_, g_plain), (_, g_ckpt) = activations(4), activations(4, checkpointed=True)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(g_plain, g_ckpt))


def test_the_decision_rule_is_the_bytes_measured_in_one_process():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=103)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 103, (4, T), generator=torch.Generator().manual_seed(1))
    act, loss = saved_activation_bytes(lambda: model(idx, idx)[1], list(model.parameters()))
    loss.backward()
    opt.step()
    params = list(model.parameters())
    measured = (sum(p.numel() * 4 for p in params) + sum(p.grad.numel() * 4 for p in params)
                + optimizer_state_bytes(opt) + act)
    # fp32 AdamW: 4 + 4 + 8 bytes per parameter, plus the 4-byte `step` of each tensor
    rule = per_rank_bytes(model.num_params(), act, 1, 0, param_bytes=4, grad_bytes=4,
                          optimizer_bytes=8) + 4 * len(params)
    assert measured == rule
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert smallest_stage(model.num_params(), act, 1, rule - 4 * len(params), **fp32) == 0
    assert smallest_stage(model.num_params(), act, 1, rule - 4 * len(params) - 1, **fp32) is None


def test_smallest_stage_and_the_calculator():
    # 7.5B, mixed-precision Adam, 20 GB of activations, 8 GPUs: 120 + 20 = 140 GB under DDP;
    # ZeRO-1: 15 + 15 + 90 / 8 + 20 = 61.25 GB
    assert per_rank_bytes(7.5e9, 20e9, 8, 0) == 140e9
    assert per_rank_bytes(7.5e9, 20e9, 8, 1) == 61.25e9
    assert smallest_stage(7.5e9, 20e9, 8, 80e9) == 1
    assert smallest_stage(7.5e9, 20e9, 8, 50e9) == 2
    assert smallest_stage(7.5e9, 80e9, 8, 80e9) is None   # activations alone fill the GPU
    lines = decision_lines(7.5e9, 20e9, 8, 80e9)
    assert lines[1] == "DDP                  140.00 GB per rank: does not fit"
    assert lines[-1] == "use: ZeRO-1 (P_os)"
    assert decision_lines(7.5e9, 80e9, 8, 80e9)[-1].startswith("use: none fits")
    with pytest.raises(ValueError, match="activation_bytes must be >= 0, got -1"):
        per_rank_bytes(1e9, -1, 8, 0)
    calc = shard_calculator(7.5, 20, 8, 80)
    assert calc.text == "\n".join(lines)
    calc.children[0].children[3].value = 50          # GB per GPU
    assert calc.text.splitlines()[-1] == "use: ZeRO-2 (P_os+g)"
    calc.children[0].children[2].value = 0           # GPUs
    assert calc.text == "cannot compute: world_size must be >= 1, got 0"
    assert "use: ZeRO-2" not in calc._repr_mimebundle_()["text/plain"]


def _mixed(psi, act, R, stage, optimizer_bytes=12, divide_activations=False):
    p, g, o = 2 * psi, 2 * psi, optimizer_bytes * psi
    return ((p / R if stage >= 3 else p) + (g / R if stage >= 2 else g)
            + (o / R if stage >= 1 else o) + (act / R if divide_activations else act))


def test_08_6_refuses_the_plausible_slips_and_names_them():
    assert reference("08.6")(7.5e9, 20e9, 64, 1) == per_rank_bytes(7.5e9, 20e9, 64, 1)
    table = {(7.5e9, 20e9, 64, s): per_rank_bytes(7.5e9, 20e9, 64, s) for s in range(4)}
    good, moments, divided, missing, shifted, fixed = run_candidates("08.6", [
        reference("08.6"),
        lambda psi, act, R, s: _mixed(psi, act, R, s, optimizer_bytes=4),
        lambda psi, act, R, s: _mixed(psi, act, R, s, divide_activations=True),
        lambda psi, act, R, s: _mixed(psi, 0, R, s),
        lambda psi, act, R, s: _mixed(psi, act, R, min(s + 1, 3)),
        lambda psi, act, R, s: table.get((psi, act, R, s), 0.0)])
    assert good.passed
    assert "got 80 GB, expected 140 GB: Adam's two moments are missing" in moments.problems[0]
    assert "got 120.3 GB, expected 140 GB: the activations were divided by the world size" \
        in divided.problems[0]
    assert "the activations are missing" in missing.problems[0]
    assert "that is stage 1's figure: stage 0 shards nothing" in shifted.problems[0]
    assert not fixed.passed   # the seeded cases catch a table of the fixed answers


# ------------------------------------------------------------ the deep dive's stored numbers
DEEP = "deep/08_when_to_shard.ipynb"


def test_the_deep_dives_activations_are_the_ones_measured_here():
    from notebook_cells import stream_text

    out = stream_text(DEEP, "def activations(").splitlines()
    a4, a8 = activations(4)[0], activations(8)[0]
    assert out == [f"parameters: {4 * TinyGPT(vocab_size=103).num_params():,} bytes",
                   f"activations, 4 x 32 tokens: {a4:,} bytes",
                   f"activations, 8 x 32 tokens: {a8:,} bytes",
                   f"one more block, 4 x 32 tokens: {activations(4, 3)[0] - a4:,} bytes"]
    ckpt, ckpt3 = activations(4, checkpointed=True)[0], activations(4, 3, checkpointed=True)[0]
    assert stream_text(DEEP, "ckpt = activations(4").splitlines() == [
        f"checkpointed, 4 x 32 tokens: {ckpt:,} bytes = {ckpt / a4:.3f} of plain",
        f"one more checkpointed block: {ckpt3 - ckpt:,} bytes = 4 x 32 x 64 fp32, "
        "the block's input"]
    prose = "".join(c.source for c in nbformat.read(ROOT / "notebooks" / DEEP, as_version=4).cells
                    if c.cell_type == "markdown")
    assert f"{a4 / (4 * TinyGPT(vocab_size=103).num_params()):.2f} times the parameters" in prose
    assert f"(less {2 * a4 - a8} bytes" in prose
    assert round((activations(4, 3)[0] - a4) / (ckpt3 - ckpt)) == 16 and "a sixteenth" in prose
    ddp, zero1 = (per_rank_bytes(7.5e9, 20e9, 8, s) / 1e9 for s in (0, 1))
    assert f"({ddp:g} GB per rank); ZeRO-1 brings it to {zero1:g} GB" in prose
    assert f"with {80 - zero1:g} GB to spare" in prose


def _table(lines):
    """{"DDP measured": [params, grads, optimizer, total], ...} from the lab's rows."""
    rows = {}
    for line in lines:
        words = line.split()
        if len(words) == 6 and words[1] in ("measured", "formula"):
            rows[" ".join(words[:2])] = [int(w.replace(",", "")) for w in words[2:]]
    return rows


def test_the_measured_table_is_the_formula_up_to_the_rounding_of_real_shards():
    from notebook_cells import stored_run

    from ddp_lesson.core.zero1 import partition_parameters
    from ddp_lesson.memory import memory_per_rank

    ranks, _ = stored_run(DEEP, "from ddp_lesson.labs.zero_memory import main")
    rows = _table(ranks[0])
    model = TinyGPT(vocab_size=103)
    shapes = [p.shape for p in model.parameters()]
    n, R = model.num_params(), 2
    for stage, name in ((0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "FSDP")):
        m = memory_per_rank(n, R, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        formula = [m.params_bytes, m.grads_bytes, m.optimizer_bytes + 4 * len(shapes)]
        assert rows[f"{name} formula"] == [*formula, sum(formula)], name
    assert rows["DDP measured"] == rows["DDP formula"]
    # ZeRO-1: whole tensors, largest first; the largest rank's AdamW state (8 B + a step each)
    owned = partition_parameters([s.numel() for s in shapes], R)
    zero1 = max(sum(8 * shapes[i].numel() + 4 for i in o) for o in owned)
    assert rows["ZeRO-1 measured"][2] == zero1
    # FSDP2: dim 0 split as torch.chunk does, rank 0 the larger half (103 rows -> 52)
    fsdp = sum(4 * s.numel() // s[0] * -(-s[0] // R) for s in shapes)
    assert rows["FSDP measured"][:2] == [fsdp, fsdp]
    assert rows["FSDP measured"][2] == 2 * fsdp + 4 * len(shapes)
    for name in ("ZeRO-1", "FSDP"):   # the prose: "within 0.2 %"
        assert abs(rows[f"{name} measured"][3] / rows[f"{name} formula"][3] - 1) < 0.002
    shard = stored_run(DEEP, "fully_shard(model, mesh=mesh)")[0]
    assert shard[0] == [f"params {fsdp:,}, grads {fsdp:,}, optimizer {2 * fsdp + 116:,} "
                        "bytes on this rank"]
    rank1 = 4 * n - fsdp
    assert shard[1] == [f"params {rank1:,}, grads {rank1:,}, optimizer {2 * rank1 + 116:,} "
                        "bytes on this rank"]


# ------------------------------------------------------------------ notebook 08's numbers
NB08 = "08_beyond_ddp_zero_fsdp.ipynb"


def test_notebook_08_prints_the_papers_table_and_the_rule():
    from notebook_cells import stream_text

    from ddp_lesson.memory import GB, STAGE_NAMES, memory_per_rank

    lines = stream_text(NB08, "psi, world_size = 7.5e9, 64").splitlines()
    for stage in range(4):
        m = memory_per_rank(7.5e9, 64, stage)
        assert lines[1 + stage] == (f"{STAGE_NAMES[stage]:20s} {m.params_bytes / GB:7.2f} "
                                    f"{m.grads_bytes / GB:7.2f} {m.optimizer_bytes / GB:7.2f} "
                                    f"{m.total_bytes / GB:7.3g}")
    assert [round(memory_per_rank(7.5e9, 64, s).total_bytes / GB, 2) for s in range(4)] == [
        120, 31.41, 16.64, 1.88]   # the paper's Figure 1: 120, 31.4, 16.6, 1.88 GB
    assert stream_text(NB08, "decision_lines(7.5e9").splitlines() == decision_lines(
        7.5e9, 20e9, 8, 80e9)


def test_notebook_08s_measured_table_is_the_deep_dives_run():
    from notebook_cells import stored_run

    rows = _table(stored_run(DEEP, "from ddp_lesson.labs.zero_memory import main")[0][0])
    prose = "".join(c.source for c in nbformat.read(ROOT / "notebooks" / NB08, as_version=4).cells
                    if c.cell_type == "markdown")
    for name, label in (("DDP", "DDP"), ("ZeRO-1", "ZeRO-1"), ("FSDP", "FSDP (`fully_shard`)")):
        p, g, o, _ = rows[f"{name} measured"]
        assert f"| {label} | {p:,} | {g:,} | {o:,} |" in prose, name
    plain, ckpt = activations(4)[0], activations(4, checkpointed=True)[0]
    assert f"4 sequences of 32 tokens are {plain:,} bytes at every stage, {ckpt:,} with" in prose
