"""Segmentation metrics that stay exact under data parallelism: confusion matrix, IoU, mIoU.

mIoU is a ratio of *counts* (per class c: true positives / (true positives + false positives
+ false negatives)), and a mean of ratios computed on different shards is not the ratio of the
whole. Counts add up: each rank counts (true class, predicted class) pairs for its samples into
a ``(C, C)`` confusion matrix, one ``all_reduce`` sums the matrices, and the IoU is computed
once from the sum. With :class:`ddp_lesson.sampler.DistributedEvalSampler` (each validation
sample on exactly one rank) the summed matrix is the single-process matrix, element for element,
at any world size; torch's padding ``DistributedSampler`` would count repeated samples twice
(tests/evaluation/test_metrics.py checks the equality at 2 and 3 ranks).

Definitions follow the Cityscapes benchmark (Cordts et al., CVPR 2016, "IoU = TP / (TP + FP +
FN)"); pixels labelled ``ignore_index`` (255, "void") count nowhere.
"""
from __future__ import annotations

import math

import torch

#: Target value that losses and metrics skip (``CrossEntropyLoss(ignore_index=255)``, the
#: Cityscapes "void" trainId). Owned here, in the lesson core; :mod:`ddp_lesson.data` and the
#: trainer import it from here, so the metrics never import the trainer's data module.
IGNORE_INDEX = 255


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Count (true class, predicted class) pairs over all non-ignored pixels.

    One ``bincount`` over ``target * C + pred``, reshaped ``(C, C)``; the result stays on
    ``pred``'s device (keep it there for an NCCL ``all_reduce``). ``pred`` and ``target``: class
    indices of the same shape (e.g. ``(N, H, W)``, ``logits.argmax(1)``), ``target`` in
    ``[0, num_classes)`` or ``ignore_index``.

    Returns:
        int64 ``(C, C)``: ``cm[t, p]`` = pixels of true class ``t`` predicted as ``p``.

    Raises:
        ValueError: shapes differ, ``num_classes < 1``, or a label out of range ("target has
            label 19, outside [0, 18] and not ignore_index 255").
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    pred = pred.reshape(-1).long()
    target = target.reshape(-1).long()
    keep = target != ignore_index
    pred, target = pred[keep], target[keep]
    if target.numel():
        for name, t in (("target", target), ("pred", pred)):
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= num_classes:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name} has label {bad}, outside [0, {num_classes - 1}]"
                                 f" and not ignore_index {ignore_index}")
    counts = torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def miou_from_confusion(cm: torch.Tensor) -> tuple[float, torch.Tensor, float]:
    """Mean IoU, per-class IoU and pixel accuracy from a ``(C, C)`` confusion matrix (rows = true
    class, summed over batches and ranks).

    ``IoU_c = cm[c, c] / (row_c + col_c - cm[c, c])``. A class absent from target and prediction
    has ``0 / 0``: IoU NaN, left out of the mean (0 or 1 would reward or punish a model for a
    class the data never showed); a class present and never hit has IoU 0 and counts.

    Returns:
        ``(miou, per_class_iou, pixel_accuracy)``: a float (NaN when no class is present), a
        float64 ``(C,)`` CPU tensor (NaN for absent classes), correct / counted pixels (NaN
        when empty).

    Raises:
        ValueError: ``cm`` is not square 2-D.
    """
    if cm.dim() != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(f"confusion matrix must be (C, C), got shape {tuple(cm.shape)}")
    cm = cm.detach().to("cpu", torch.float64)
    tp = cm.diagonal()
    union = cm.sum(1) + cm.sum(0) - tp
    per_class = torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, math.nan))
    present = ~per_class.isnan()
    miou = float(per_class[present].mean()) if present.any() else math.nan
    total = float(cm.sum())
    pixel_accuracy = float(tp.sum()) / total if total > 0 else math.nan
    return miou, per_class, pixel_accuracy

