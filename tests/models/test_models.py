"""Tests for ddp_lesson.models: shapes, gradients reach every parameter, names, training."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ddp_lesson.data import IGNORE_INDEX, SyntheticCityscapes
from ddp_lesson.models import (
    MODELS,
    DeepLabV3Mini,
    TinyConvNet,
    build_model,
    count_parameters,
)


@pytest.fixture(autouse=True)
def seeded_single_thread():
    """Seed torch, and use one intra-op thread: the small convs here gain little from more,
    and on a busy 2-core machine extra OpenMP threads spin against other processes."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("size", [(64, 128), (37, 53), (17, 31), (8, 8)])
def test_output_is_per_pixel_logits_at_input_size(name, size):
    model = build_model(name, num_classes=5).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, *size))
    assert out.shape == (2, 5, *size)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_backbone_stops_at_output_stride_8_and_uses_atrous_convs():
    model = DeepLabV3Mini(width=8)
    features = model.backbone(torch.randn(2, 3, 64, 128))
    assert features.shape == (2, 32, 8, 16)
    dilations = [m.dilation[0] for m in model.backbone.modules() if isinstance(m, nn.Conv2d)]
    assert max(dilations) > 1
    aspp_dilations = [m.dilation[0] for m in model.aspp.modules() if isinstance(m, nn.Conv2d)]
    assert sorted(set(aspp_dilations)) == [1, 2, 3, 4]
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_gets_a_gradient(name):
    """What lets DDP run with find_unused_parameters=False."""
    model = build_model(name).train()
    x = torch.randn(2, 3, 37, 53)
    y = torch.randint(0, 19, (2, 37, 53))
    nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)(model(x), y).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.slow
def test_ddp_without_find_unused_parameters(world_of_one):
    """Two DDP steps in a world of one (gloo): the reducer finds no unused parameter."""
    ddp = nn.parallel.DistributedDataParallel(DeepLabV3Mini(width=4),
                                              find_unused_parameters=False)
    for _ in range(2):  # an unused parameter would make the second step raise
        ddp(torch.randn(2, 3, 16, 32)).sum().backward()
    assert all(p.grad is not None for p in ddp.parameters())


def test_count_parameters():
    # TinyConvNet(19, width=16): three 3x3 convs without bias (3->16, 16->16, 16->16),
    # three BatchNorms (weight + bias), a 1x1 classifier 16->19 with bias.
    expected = 3 * 16 * 9 + 16 * 16 * 9 * 2 + 3 * 2 * 16 + 16 * 19 + 19
    model = TinyConvNet(num_classes=19, width=16)
    assert count_parameters(model) == expected == 5459
    model.classifier.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == expected - 16 * 19
    deeplab = DeepLabV3Mini()
    assert count_parameters(deeplab) == sum(p.numel() for p in deeplab.parameters())
    assert count_parameters(DeepLabV3Mini(width=32)) > 3 * count_parameters(deeplab)


def test_build_model_by_name():
    assert isinstance(build_model(), DeepLabV3Mini)
    model = build_model("tiny", num_classes=7, width=4)
    assert isinstance(model, TinyConvNet) and model.classifier.out_channels == 7
    with pytest.raises(ValueError, match=r"unknown model 'resnet'; known models: deeplab, tiny"):
        build_model("resnet")


def test_bad_arguments_and_inputs_are_named():
    with pytest.raises(ValueError, match=r"width must be an int >= 1, got 0"):
        DeepLabV3Mini(width=0)
    with pytest.raises(ValueError, match=r"num_classes must be an int >= 1, got -2"):
        TinyConvNet(num_classes=-2)
    with pytest.raises(ValueError, match=r"atrous_rate must be an int >= 1, got 0"):
        DeepLabV3Mini(atrous_rates=(0, 2, 3))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\), got \(2, 1, 16, 16\)"):
        DeepLabV3Mini()(torch.randn(2, 1, 16, 16))


def test_first_loss_is_about_log_num_classes():
    model = DeepLabV3Mini().train()
    x = torch.randn(4, 3, 32, 64)
    y = torch.randint(0, 19, (4, 32, 64))
    loss = nn.CrossEntropyLoss()(model(x), y).item()
    assert abs(loss - math.log(19)) < 0.1, loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_learns_synthetic_scenes(name):
    dataset = SyntheticCityscapes(8, seed=0)
    x = torch.stack([image for image, _ in dataset])
    y = torch.stack([target for _, target in dataset])
    model = build_model(name).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.4 * losses[0], losses
    model.eval()
    with torch.no_grad():
        prediction = model(x).argmax(1)
    valid = y != IGNORE_INDEX
    accuracy = (prediction == y)[valid].float().mean().item()
    assert accuracy > 0.6, accuracy
