"""The GPU group's shape, checked on any machine: at least 6 tests marked ``gpu``, each skipped
with a reason where CUDA is missing, and the marker registered (so ``pytest -m gpu`` selects
them without a warning). The tests themselves live in tests/gpu/test_gpu.py."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_tests", ROOT / "tests/gpu/test_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_group_has_at_least_six_tests_skipped_with_a_reason_without_cuda():
    module = _gpu_module()
    tests = [name for name in vars(module) if name.startswith("test_")]
    assert len(tests) >= 6, tests
    marks = {m.name: m for m in module.pytestmark}
    assert "gpu" in marks and "skipif" in marks
    skip = marks["skipif"]
    assert skip.args == (not torch.cuda.is_available(),)
    assert "no CUDA device" in skip.kwargs["reason"]
    covered = " ".join(tests)
    for topic in ("nccl", "torchrun_cell", "amp_bf16", "amp_fp16", "bucketed_ddp",
                  "sync_batchnorm", "checkpoint", "step_timer", "doctor"):
        assert topic in covered, topic


def test_gpu_marker_is_registered_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; we support 3.10)
    options = text[text.index("[tool.pytest.ini_options]"):]
    markers = re.search(r"^markers = \[(.*?)^\]", options, re.DOTALL | re.MULTILINE)
    assert markers and re.search(r'^\s+"gpu: ', markers.group(1), re.MULTILINE), options
