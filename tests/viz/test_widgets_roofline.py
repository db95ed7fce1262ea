"""The roofline calculator widget: its text is roofline_report's for the controls' values."""
from __future__ import annotations

import pytest
import torch

from ddp_lesson.cost_model import HARDWARE, Hardware, roofline_report
from ddp_lesson.widgets import roofline_calculator


def test_calculator_follows_its_controls():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(4, 64)
    calc = roofline_calculator(model, (x,), hardware="a100", batch_per_gpu=16)
    assert calc.text == roofline_report(model, "a100", batch_per_gpu=16, inputs=(x,))
    calc.hardware.value = HARDWARE["t4x2"]
    calc.batch_per_gpu.value = 512
    calc.grad_bytes.value = 2
    want = roofline_report(model, "t4x2", batch_per_gpu=512, inputs=(x,), grad_bytes_per_param=2)
    assert calc.text == want and "   8  more GPUs than this hardware holds" in want
    assert "efficiency at 512/GPU" in calc.view.value
    plain = calc._repr_mimebundle_()["text/plain"]
    assert plain == "roofline calculator (run the notebook to change it)\n" + want


def test_calculator_counts_the_flops_once(monkeypatch):
    """No control changes the model's FLOPs: built once, the count is not run again."""
    import ddp_lesson.cost_model as cm

    calls = []
    count = cm.flops_per_sample
    monkeypatch.setattr(cm, "flops_per_sample", lambda *a: calls.append(1) or count(*a))
    model, x = torch.nn.Linear(64, 64), torch.randn(4, 64)
    calc = roofline_calculator(model, (x,), hardware="a100", batch_per_gpu=16)
    calc.batch_per_gpu.value, calc.mfu.value, calc.grad_bytes.value = 64, 0.5, 2
    assert len(calls) == 1
    assert calc.text == roofline_report(model, "a100", batch_per_gpu=64, inputs=(x,), mfu=0.5,
                                        grad_bytes_per_param=2)


def test_calculator_names_the_presets():
    with pytest.raises(KeyError, match="presets are \\['a100', 'h100', 'h100-200g', 't4x2'\\]"):
        roofline_calculator(1e6, hardware="v100")


def test_calculator_takes_the_learners_own_hardware():
    mine = Hardware("4x L4 over PCIe Gen4", 121e12, 4, 32e9, 0.0, "my data sheet")
    calc = roofline_calculator(1e8, hardware=mine, batch_per_gpu=8)
    assert calc.hardware.options[-1] == ("custom", mine)
    assert calc.text == roofline_report(1e8, mine, batch_per_gpu=8)
    assert "hardware: 4x L4 over PCIe Gen4" in calc.text
