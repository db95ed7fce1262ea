"""Segmentation networks for the lessons: a compact DeepLabV3 and a tiny conv net.

Every model here maps a float image batch ``(B, in_channels, H, W)`` to per-pixel logits
``(B, num_classes, H, W)`` at the input's own resolution, for any ``H, W >= 1``: train it
with ``CrossEntropyLoss(ignore_index=255)`` and take ``argmax(1)`` for a prediction.

:class:`DeepLabV3Mini` follows DeepLabV3 (Chen et al., "Rethinking Atrous Convolution for
Semantic Image Segmentation", arXiv:1706.05587) at a size a 2-core CPU trains in seconds:
a strided conv backbone that stops at output stride 8 and keeps its receptive field growing
with *atrous* (dilated) convolutions instead of further striding; an ASPP head (a 1x1 conv,
three 3x3 atrous convs and image-level pooling, side by side, then a 1x1 projection); a 1x1
classifier; and a bilinear upsample back to the input size (torchvision's
``deeplabv3_resnet50`` is the full-size design).

Under ``DistributedDataParallel``:

* **Every parameter takes part in every forward pass**, so ``find_unused_parameters`` stays
  ``False``; ``True`` (the seed script's) makes DDP walk the autograd graph after every
  forward for nothing (``tests/models/test_models.py`` checks every parameter gets a gradient).
* **BatchNorm normalises with the batch it sees: under DDP each rank's own slice.** With 4
  ranks of 2 images, 2-image statistics, so DDP is *not* bit-for-bit one process on the global
  batch; ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`` all-reduces the statistics
  (one collective per BatchNorm layer per step). The running mean/var are buffers: DDP
  broadcasts rank 0's copy before each forward (``broadcast_buffers=True``), never averages.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeepLabV3Mini", "TinyConvNet", "ASPP", "build_model", "count_parameters", "MODELS"]


def _check_positive(**values: int) -> None:
    """Raise ValueError naming any argument that is not an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_input(x: torch.Tensor, in_channels: int) -> None:
    """Raise ValueError unless ``x`` is ``(B, in_channels, H, W)``."""
    if x.ndim != 4 or x.shape[1] != in_channels:
        raise ValueError(f"expected input of shape (B, {in_channels}, H, W), "
                         f"got {tuple(x.shape)}")


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 dilation: int = 1) -> nn.Sequential:
    """Conv2d (no bias: BatchNorm's beta plays it) -> BatchNorm2d -> ReLU, padded so that
    stride 1 keeps the size: ``(B, in, H, W) -> (B, out, H', W')``.

    ``kernel_size`` odd; ``stride`` 2 halves H and W (rounding up); ``dilation``: the atrous
    rate (a 3x3 kernel with rate r sees a (2r+1)x(2r+1) window).
    """
    padding = dilation * (kernel_size - 1) // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                  dilation=dilation, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class ASPP(nn.Module):
    """Atrous Spatial Pyramid Pooling, the DeepLabV3 head (arXiv:1706.05587, section 3.3).

    Branches concatenated, then a 1x1 conv-BN-ReLU to ``out_channels``: a 1x1 conv, one 3x3
    conv per rate in ``atrous_rates``, and image-level pooling (global average, 1x1 conv,
    broadcast back). The pooling branch has no BatchNorm: on its 1x1 map one image per rank
    would give BatchNorm a single value per channel (torchvision's ASPPPooling fails there).
    DeepLabV3's dropout is left out so that runs compare step for step.

    Shapes: ``(B, in_channels, h, w) -> (B, out_channels, h, w)``.
    """

    def __init__(self, in_channels: int, out_channels: int, atrous_rates: Sequence[int]):
        super().__init__()
        _check_positive(in_channels=in_channels, out_channels=out_channels)
        for rate in atrous_rates:
            _check_positive(atrous_rate=rate)
        self.branches = nn.ModuleList([conv_bn_relu(in_channels, out_channels, 1)])
        self.branches.extend(conv_bn_relu(in_channels, out_channels, 3, dilation=r)
                             for r in atrous_rates)
        self.pool = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(in_channels, out_channels, 1),
            nn.ReLU(inplace=True),
        )
        self.project = conv_bn_relu((len(atrous_rates) + 2) * out_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, h, w) -> (B, out_channels, h, w)``."""
        outs = [branch(x) for branch in self.branches]
        # Upsampling a 1x1 map bilinearly is a broadcast; expand says so without the work.
        outs.append(self.pool(x).expand(-1, -1, x.shape[-2], x.shape[-1]))
        return self.project(torch.cat(outs, dim=1))


class DeepLabV3Mini(nn.Module):
    """A compact DeepLabV3: atrous backbone at output stride 8, ASPP head, bilinear upsample.

    Layout for ``width = w`` (channels, and the feature map of a 64x128 input):

    ========  ==============================================  ========  =========
    stage     layers                                          channels  map
    ========  ==============================================  ========  =========
    stem      3x3 s2, 3x3                                     w         32x64
    layer1    3x3 s2, 3x3                                     2w        16x32
    layer2    3x3 s2, 3x3                                     4w        8x16
    layer3    3x3 rate 2, 3x3 rate 2 (atrous, no stride)      4w        8x16
    aspp      1x1 | 3x3 rates ``atrous_rates`` | image pool   4w        8x16
    head      1x1 classifier, bilinear upsample               classes   64x128
    ========  ==============================================  ========  =========

    The default rates (2, 3, 4) are DeepLabV3's (6, 12, 18) for its 33x33 map scaled to this
    net's 8x16 map of a 64x128 image (a rate past the map's edge reads only padding). Under
    DDP: see the module docstring.

    Args:
        num_classes: output channels (19 for Cityscapes trainIds).
        width: base channel count ``w``; parameters grow as ``w**2``.
        in_channels: input channels (3 for RGB).
        atrous_rates: dilations of the three 3x3 ASPP branches.

    Raises:
        ValueError: if a size argument is not an int >= 1.

    Shapes:
        input ``(B, in_channels, H, W)`` float (any ``H, W >= 1``; no multiple of 8
        needed) -> output ``(B, num_classes, H, W)`` logits.
    """

    def __init__(self, num_classes: int = 19, width: int = 16, in_channels: int = 3,
                 atrous_rates: Sequence[int] = (2, 3, 4)):
        super().__init__()
        _check_positive(num_classes=num_classes, width=width, in_channels=in_channels)
        self.num_classes, self.in_channels = num_classes, in_channels
        w = width
        self.backbone = nn.Sequential(
            conv_bn_relu(in_channels, w, stride=2), conv_bn_relu(w, w),                  # /2
            conv_bn_relu(w, 2 * w, stride=2), conv_bn_relu(2 * w, 2 * w),                # /4
            conv_bn_relu(2 * w, 4 * w, stride=2), conv_bn_relu(4 * w, 4 * w),            # /8
            # Output stride stays 8 from here: dilation widens the view without losing
            # resolution, which a dense per-pixel prediction needs.
            conv_bn_relu(4 * w, 4 * w, dilation=2), conv_bn_relu(4 * w, 4 * w, dilation=2),
        )
        self.aspp = ASPP(4 * w, 4 * w, atrous_rates)
        self.classifier = nn.Conv2d(4 * w, num_classes, 1)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images ``(B, in_channels, H, W)`` -> logits ``(B, num_classes, H, W)``.

        Raises:
            ValueError: if ``x`` is not ``(B, in_channels, H, W)``.
        """
        _check_input(x, self.in_channels)
        logits = self.classifier(self.aspp(self.backbone(x)))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


class TinyConvNet(nn.Module):
    """A very small segmentation net for quick lessons: two stride-2 conv-BN-ReLU (output
    stride 4), one with dilation 2, a 1x1 classifier and a bilinear upsample; 3.4 M
    multiply-adds per 64x128 image against :class:`DeepLabV3Mini`'s 47 M, 5.5 k parameters
    against 287 k (defaults), each used in every forward pass. ``width``: hidden channels.

    Raises:
        ValueError: if an argument is not an int >= 1.

    Shapes:
        ``(B, in_channels, H, W)`` float -> ``(B, num_classes, H, W)`` logits.
    """

    def __init__(self, num_classes: int = 19, width: int = 16, in_channels: int = 3):
        super().__init__()
        _check_positive(num_classes=num_classes, width=width, in_channels=in_channels)
        self.num_classes, self.in_channels = num_classes, in_channels
        self.features = nn.Sequential(
            conv_bn_relu(in_channels, width, stride=2),
            conv_bn_relu(width, width, stride=2),
            conv_bn_relu(width, width, dilation=2),
        )
        self.classifier = nn.Conv2d(width, num_classes, 1)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, H, W)`` -> ``(B, num_classes, H, W)`` logits.

        Raises:
            ValueError: if ``x`` is not ``(B, in_channels, H, W)``.
        """
        _check_input(x, self.in_channels)
        logits = self.classifier(self.features(x))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def _init_weights(model: nn.Module) -> None:
    """He (Kaiming) init for convs, identity BatchNorm, zero biases, a near-zero classifier
    (the first loss is then close to ``ln(num_classes)``, 2.94 for 19 classes).
    Deterministic under ``torch.manual_seed``."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    nn.init.normal_(model.classifier.weight, std=0.01)


#: Model names accepted by :func:`build_model`.
MODELS: dict[str, type[nn.Module]] = {"deeplab": DeepLabV3Mini, "tiny": TinyConvNet}


def build_model(name: str = "deeplab", num_classes: int = 19, **kwargs) -> nn.Module:
    """The model :data:`MODELS` names (``"deeplab"``, ``"tiny"``), initialised from torch's
    global RNG (seed it first); ``kwargs`` go to its constructor (``width``, ...).

    Raises:
        ValueError: for an unknown name (lists the known ones) or a bad size argument.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name](num_classes=num_classes, **kwargs)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters (``requires_grad`` ones with ``trainable_only``); buffers
    such as BatchNorm's running statistics are not counted. Under DDP every step all-reduces
    ``4 * count_parameters(model)`` bytes of float32 gradients per rank."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
