"""The series' determinism advice names every op of its training step that raises on CUDA.

torch's own list of the operations that raise a RuntimeError on CUDA under
``torch.use_deterministic_algorithms(True)`` is read from the function's docstring
(torch/__init__.py). The aten ops one real training step of the series' models runs
(:func:`ddp_lesson.train.train_step`, forward and backward) are recorded with a dispatch mode, on
CPU: the ops are the same on CUDA (the 1x1 adaptive pooling becomes ``mean`` on every device,
aten's AdaptiveAveragePooling.cpp). Each list entry the step uses must be named in the advice
(docs/gpus.md's "Determinism" section and notebook 07 §1), so a torch that adds an op to its
list, or a model that starts using one, fails here until the advice says so.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_lesson.data import IGNORE_INDEX
from ddp_lesson.models import build_model
from ddp_lesson.train import train_step

ROOT = Path(__file__).resolve().parents[2]


def torch_raising_list() -> list[dict]:
    """torch's "will throw a RuntimeError" entries for CUDA: name, aten key(s), backward-only or
    not (an entry for another device, such as torch 2.15's MPS interpolate, is left out)."""
    doc = torch.use_deterministic_algorithms.__doc__
    start = doc.index("will throw a")
    section = doc[start:doc.index("In addition", start)]
    entries = []
    for item in re.split(r"\n\s*\* ", section)[1:]:
        target = re.search(r":(?:class|func):`([\w.]+)`", item)
        if target is None:
            continue
        if "CUDA" not in item:  # e.g. torch 2.15's interpolate entry for MPS tensors
            continue
        name = target.group(1).split(".")[-1]
        modes = re.findall(r"- ``(\w+)``", item)
        if name == "interpolate":  # F.interpolate's modes run aten's upsample_<mode>
            keys = [f"upsample_{m}" for m in modes]
        elif name[0].isupper():  # a module: AdaptiveAvgPool2d -> adaptive_avg_pool2d
            keys = [re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
                    .lower()]
        else:
            keys = [name.rstrip("_")]
        entries.append({"name": name, "keys": keys, "modes": modes,
                        "backward_only": "differentiate" in item, "text": " ".join(item.split())})
    return entries


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def step_ops(model_name: str) -> set[str]:
    """The aten ops of one :func:`train_step` of ``model_name`` (19 classes, void pixels)."""
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=19, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 32, 64, generator=g)
    target = torch.randint(0, 19, (2, 32, 64), generator=g)
    target[0, :4] = IGNORE_INDEX
    with _Ops() as rec:
        train_step(model, opt, [(images, target)], 1)
    return rec.ops


def used_raising_entries(model_name: str) -> list[dict]:
    ops = step_ops(model_name)
    used = []
    for entry in torch_raising_list():
        hits = [op for op in ops if any(k in op for k in entry["keys"])]
        if entry["backward_only"]:
            hits = [op for op in hits if "backward" in op]
        if hits:
            used.append(entry)
    return used


def advice_texts() -> dict[str, str]:
    gpus = (ROOT / "docs" / "gpus.md").read_text()
    start = gpus.index("## Determinism")
    section = gpus[start:gpus.index("\n## ", start + 1)]
    nb = nbformat.read(ROOT / "notebooks" / "07_failures_and_multinode.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells
                if c.cell_type == "markdown" and c.source.startswith("**Bit for bit**"))
    return {"docs/gpus.md": section, "notebook 07 §1": cell}


def test_torch_list_is_read():
    entries = {e["name"]: e for e in torch_raising_list()}
    assert entries["NLLLoss"]["keys"] == ["nll_loss"]
    assert entries["AdaptiveAvgPool2d"]["keys"] == ["adaptive_avg_pool2d"]
    assert entries["AdaptiveAvgPool2d"]["backward_only"]
    assert "upsample_bilinear" in entries["interpolate"]["keys"]
    assert len(entries) >= 20


@pytest.mark.parametrize("model_name", ["deeplab", "tiny"])
def test_the_step_uses_exactly_these_raising_ops(model_name):
    """What the advice says the model runs: NLLLoss and bilinear interpolate's backward; not the
    adaptive pooling, which is a mean at 1x1."""
    names = {e["name"] for e in used_raising_entries(model_name)}
    assert names == {"NLLLoss", "interpolate"}
    ops = step_ops(model_name)
    assert "upsample_bilinear2d_backward" in ops and "nll_loss2d_forward" in ops
    assert not any("adaptive_avg_pool" in op for op in ops)


def test_the_advice_names_every_raising_op_the_step_uses():
    used = {e["name"] for m in ("deeplab", "tiny") for e in used_raising_entries(m)}
    for where, text in advice_texts().items():
        missing = [name for name in sorted(used) if name not in text]
        assert not missing, f"{where} does not name {missing}, which raise on CUDA"
    section = advice_texts()["docs/gpus.md"]
    for needed in ("use_deterministic_algorithms", "CUBLAS_WORKSPACE_CONFIG", "warn_only",
                   "AdaptiveAvgPool2d", "tolerance"):
        assert needed in section, needed


def test_no_document_advises_deterministic_mode_alone():
    """Wherever the series names use_deterministic_algorithms, it is the advice above."""
    places = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if "use_deterministic_algorithms" in path.read_text():
            places.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if "use_deterministic_algorithms" in cell.source:
                places.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "ddp_lesson").rglob("*.py")):
        if "use_deterministic_algorithms" in path.read_text():
            places.append(str(path.relative_to(ROOT)))
    assert sorted(places) == ["docs/gpus.md", "notebooks/07_failures_and_multinode.ipynb"]
