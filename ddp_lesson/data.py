"""Cityscapes-like data: procedural street scenes (the default) and the real folder layout.

The lessons train a segmentation net on *Cityscapes* (Cordts et al., CVPR 2016): street photos
whose every pixel carries one of 19 evaluated classes (its *trainId*, 0..18) or 255, "ignore".
The real set is 11 GB behind a login, so the default is :class:`SyntheticCityscapes`: street
scenes drawn from a seeded generator with the same classes, colours, return format and
normalisation. :class:`CityscapesFolder` reads the real folder layout; :func:`make_datasets`
picks one.

Under DDP every rank builds its own copy of the dataset and the sampler hands each rank
different indices: that partitions the data only if index ``i`` means the same sample on
every rank and worker, whatever was read before. So sample ``i`` comes from its own generator,
``numpy.random.default_rng([seed, split, i])``.

Both data sets return, for ``size = (H, W)``: ``image``, float32 ``(3, H, W)``, RGB in [0, 1]
normalised per channel with :data:`CITYSCAPES_MEAN` / :data:`CITYSCAPES_STD`; ``target``,
int64 ``(H, W)``, trainIds 0..18 or :data:`IGNORE_INDEX` (255). Class names, the labelId ->
trainId table and the colours come from ``cityscapesscripts.helpers.labels``.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

# The official table (cityscapesScripts, helpers/labels.py). Importing it costs < 1 ms.
from cityscapesscripts.helpers import labels as _cs_labels
from torch.utils.data import Dataset

from .config import TrainInputError
from .metrics import IGNORE_INDEX  # re-exported: the trainer's labels use the metrics' value

__all__ = [
    "CITYSCAPES_CLASSES",
    "NUM_CLASSES",
    "IGNORE_INDEX",
    "TRAIN_ID_COLORS",
    "LABEL_ID_TO_TRAIN_ID",
    "CITYSCAPES_MEAN",
    "CITYSCAPES_STD",
    "label_ids_to_train_ids",
    "colorize_target",
    "normalize_image",
    "denormalize_image",
    "SyntheticCityscapes",
    "CityscapesFolder",
    "make_datasets",
    "render_scene",
]



def _evaluated_labels() -> list:
    """The official labels with a trainId in 0..18, by trainId.

    Raises:
        RuntimeError: the installed cityscapesscripts does not define 0..18 once each.
    """
    rows = sorted((l for l in _cs_labels.labels if 0 <= l.trainId < IGNORE_INDEX),
                  key=lambda l: l.trainId)
    train_ids = [l.trainId for l in rows]
    if train_ids != list(range(len(rows))):
        raise RuntimeError(f"cityscapesscripts trainIds are not 0..N-1 once each: {train_ids}")
    return rows


_EVALUATED = _evaluated_labels()

#: The 19 evaluated class names, in trainId order ("road" is 0, "bicycle" is 18).
CITYSCAPES_CLASSES: tuple[str, ...] = tuple(l.name for l in _EVALUATED)
#: Number of evaluated classes (the logits' channel count).
NUM_CLASSES: int = len(CITYSCAPES_CLASSES)
assert NUM_CLASSES == 19, NUM_CLASSES
#: Official RGB colour of each trainId, ``TRAIN_ID_COLORS[train_id] == (r, g, b)``.
TRAIN_ID_COLORS: tuple[tuple[int, int, int], ...] = tuple(tuple(l.color) for l in _EVALUATED)

#: labelId (the value stored in ``*_gtFine_labelIds.png``, 0..33) -> trainId (0..18 or 255).
#: Official ids whose trainId is 255 or -1 ("unlabeled", "parking", ...) map to 255.
LABEL_ID_TO_TRAIN_ID: dict[int, int] = {
    l.id: (l.trainId if 0 <= l.trainId < IGNORE_INDEX else IGNORE_INDEX)
    for l in _cs_labels.labels
    if 0 <= l.id < 256  # "license plate" has id -1: it never appears in a labelIds PNG
}

# 256-entry lookup tables so that mapping or colouring a whole image is one fancy index.
_LABEL_LUT = np.full(256, IGNORE_INDEX, dtype=np.uint8)
for _label_id, _train_id in LABEL_ID_TO_TRAIN_ID.items():
    _LABEL_LUT[_label_id] = _train_id
_COLOR_LUT = np.zeros((256, 3), dtype=np.uint8)  # ignore (and anything unused) -> black
_COLOR_LUT[:NUM_CLASSES] = np.array(TRAIN_ID_COLORS, dtype=np.uint8)

#: Per-channel mean of the Cityscapes train images, RGB in [0, 1]. These are the figures
#: used by e.g. PyTorch Lightning Bolts' CityscapesDataModule; the synthetic palette below
#: is tuned so that synthetic images have about the same statistics.
CITYSCAPES_MEAN: tuple[float, float, float] = (0.28689554, 0.32513303, 0.28389177)
#: Per-channel standard deviation of the Cityscapes train images, RGB in [0, 1].
CITYSCAPES_STD: tuple[float, float, float] = (0.18696375, 0.19017339, 0.18720214)

_MEAN = np.array(CITYSCAPES_MEAN, dtype=np.float32)
_STD = np.array(CITYSCAPES_STD, dtype=np.float32)


# --------------------------------------------------------------------------------------
# Conversions shared by both data sets
# --------------------------------------------------------------------------------------

def label_ids_to_train_ids(label_ids: np.ndarray) -> np.ndarray:
    """Map Cityscapes labelIds (any shape, values 0..255, e.g. a ``*_gtFine_labelIds.png``) to
    trainIds with the official table: a uint8 array of the same shape, 255 for ids not evaluated
    or not defined.

    Raises:
        ValueError: a value outside 0..255.
    """
    label_ids = np.asarray(label_ids)
    if label_ids.dtype != np.uint8:
        if label_ids.size and (label_ids.min() < 0 or label_ids.max() > 255):
            raise ValueError(f"labelIds must lie in 0..255, got values in "
                             f"[{label_ids.min()}, {label_ids.max()}]")
        label_ids = label_ids.astype(np.uint8)
    return _LABEL_LUT[label_ids]


def colorize_target(target) -> np.ndarray:
    """Paint an ``(H, W)`` trainId map (tensor or array, 0..18 or 255) with the official colours:
    uint8 ``(H, W, 3)`` RGB, ignore pixels black.

    Raises:
        ValueError: ``target`` is not 2-D or holds a value other than 0..18 and 255.
    """
    if isinstance(target, torch.Tensor):
        target = target.detach().cpu().numpy()
    target = np.asarray(target)
    if target.ndim != 2:
        raise ValueError(f"target must be (H, W), got shape {tuple(target.shape)}")
    bad = (target != IGNORE_INDEX) & ((target < 0) | (target >= NUM_CLASSES))
    if bad.any():
        values = np.unique(target[bad])[:5].tolist()
        raise ValueError(f"target holds values {values} outside 0..{NUM_CLASSES - 1} "
                         f"and {IGNORE_INDEX}")
    return _COLOR_LUT[target.astype(np.int64)]


def normalize_image(rgb: np.ndarray) -> torch.Tensor:
    """An RGB image ``(H, W, 3)`` in [0, 1] as the network's input: float32 ``(3, H, W)``,
    ``(rgb - CITYSCAPES_MEAN) / CITYSCAPES_STD`` per channel.
    """
    chw = ((np.asarray(rgb, dtype=np.float32) - _MEAN) / _STD).transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(chw))


def denormalize_image(image: torch.Tensor) -> np.ndarray:
    """Undo :func:`normalize_image` for a figure: ``(3, H, W)`` -> uint8 ``(H, W, 3)`` RGB.

    Raises:
        ValueError: ``image`` is not ``(3, H, W)``.
    """
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W), got shape {tuple(image.shape)}")
    rgb = image.detach().cpu().numpy().transpose(1, 2, 0) * _STD + _MEAN
    return (np.clip(rgb, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _check_size(size, minimum: int) -> tuple[int, int]:
    """Validate a ``(height, width)`` pair of ints, each at least ``minimum``."""
    try:
        height, width = (operator.index(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"size must be a (height, width) pair of ints, got {size!r}") from None
    if height < minimum or width < minimum:
        raise ValueError(f"size must be (height, width) with both >= {minimum}, "
                         f"got ({height}, {width})")
    return height, width


def _check_index(index, length: int, owner: str) -> int:
    """Return ``index`` as a non-negative int, or raise IndexError naming it and the length."""
    index = operator.index(index)
    if not -length <= index < length:
        raise IndexError(f"index {index} is out of range for {owner} of length {length}")
    return index % length


# --------------------------------------------------------------------------------------
# Synthetic street scenes
# --------------------------------------------------------------------------------------

_ID = {name: i for i, name in enumerate(CITYSCAPES_CLASSES)}

# Mean colour (RGB in [0, 1]) of each class in synthetic scenes. Every scene jitters these a
# little, every object gets its own tint and every pixel its own noise, so the net has to
# learn a colour *distribution* (plus context: sky above, road below), not a lookup table.
# The colours are muted like Cityscapes photos, so CITYSCAPES_MEAN/STD normalise them well.
_BASE_RGB = {
    "road": (0.27, 0.27, 0.29), "sidewalk": (0.46, 0.40, 0.44), "building": (0.36, 0.31, 0.27),
    "wall": (0.50, 0.48, 0.40), "fence": (0.45, 0.36, 0.26), "pole": (0.14, 0.14, 0.17),
    "traffic light": (0.80, 0.55, 0.08), "traffic sign": (0.80, 0.76, 0.10),
    "vegetation": (0.16, 0.32, 0.10), "terrain": (0.42, 0.52, 0.28), "sky": (0.50, 0.60, 0.72),
    "person": (0.55, 0.12, 0.18), "rider": (0.72, 0.22, 0.08), "car": (0.08, 0.12, 0.42),
    "truck": (0.16, 0.22, 0.30), "bus": (0.06, 0.36, 0.46), "train": (0.20, 0.42, 0.36),
    "motorcycle": (0.30, 0.28, 0.62), "bicycle": (0.50, 0.08, 0.28),
}
_PALETTE = np.zeros((256, 3), dtype=np.float32)
for _name, _rgb in _BASE_RGB.items():
    _PALETTE[_ID[_name]] = _rgb
_PALETTE[IGNORE_INDEX] = (0.07, 0.07, 0.08)  # the dark bonnet of the ego vehicle

_SPLIT_STREAM = {"train": 0, "val": 1, "test": 2}


class _Scene:
    """Drawing state for one synthetic frame: a trainId map and a per-pixel colour tint.

    Geometry: rows ``[0, horizon)`` hold sky and buildings; below the horizon the road is a
    trapezoid whose centre line runs from a vanishing point to the bottom edge, with a
    sidewalk on each side and terrain beyond. ``cx``, ``half`` and ``walk_*`` give, for each
    row below the horizon, the road's centre, half-width and the sidewalks' widths (pixels).
    """

    def __init__(self, rng: np.random.Generator, height: int, width: int):
        self.rng, self.h, self.w = rng, height, width
        self.label = np.full((height, width), _ID["sky"], dtype=np.uint8)
        self.tint = np.zeros((height, width, 3), dtype=np.float32)
        self.horizon = int(round(height * rng.uniform(0.38, 0.50)))
        rows = np.arange(self.horizon, height, dtype=np.float32)
        # t in (0, 1]: 0 at the horizon, 1 at the bottom row. Sizes on the ground scale with t.
        self.t = (rows - self.horizon + 1.0) / (height - self.horizon)
        vanish_x = width * rng.uniform(0.35, 0.65)
        bottom_x = width * rng.uniform(0.40, 0.60)
        self.cx = vanish_x + self.t * (bottom_x - vanish_x)
        self.half = 0.5 + self.t * width * rng.uniform(0.36, 0.50)
        self.walk_left = self.half * rng.uniform(0.30, 0.65)
        self.walk_right = self.half * rng.uniform(0.30, 0.65)

    def _clip(self, y0, y1, x0, x1) -> tuple[slice, slice] | None:
        """Rows [y0, y1) x cols [x0, x1) clipped to the frame, or None if nothing is left."""
        y0, y1 = max(int(y0), 0), min(int(y1), self.h)
        x0, x1 = max(int(x0), 0), min(int(x1), self.w)
        if y0 >= y1 or x0 >= x1:
            return None
        return slice(y0, y1), slice(x0, x1)

    def fill(self, y0, y1, x0, x1, cls: int, tint=None) -> bool:
        """Label a rectangle ``cls`` (and set its tint); False if it lies outside the frame."""
        box = self._clip(y0, y1, x0, x1)
        if box is None:
            return False
        self.label[box] = cls
        if tint is not None:
            self.tint[box] = tint
        return True

    def shade(self, y0, y1, x0, x1, delta: float) -> None:
        """Brighten (delta > 0) or darken a rectangle without changing its label."""
        box = self._clip(y0, y1, x0, x1)
        if box is not None:
            self.tint[box] += delta

    def object_tint(self, spread: float = 0.05) -> np.ndarray:
        """A random RGB offset that makes one object differ from others of its class."""
        return self.rng.normal(0.0, spread, 3).astype(np.float32)

    def ground_row(self, low: float, high: float) -> int:
        """A random row below the horizon, as a fraction ``[low, high)`` of the ground."""
        ground = self.h - self.horizon
        return self.horizon + int(ground * self.rng.uniform(low, high))


def _draw_sky_and_skyline(s: _Scene) -> None:
    """Sky brightening towards the horizon, then a row of buildings with windows.

    Some buildings stand behind a low wall or fence; some gaps let the sky through.
    """
    rng = s.rng
    s.tint[:s.horizon] = np.linspace(-0.08, 0.10, s.horizon, dtype=np.float32)[:, None, None]
    step = max(2, s.h // 20)  # window grid pitch, pixels
    x = 0
    while x < s.w:
        bw = int(rng.integers(max(3, s.w // 12), max(4, s.w // 4) + 1))
        if rng.random() < 0.15:  # a gap in the skyline
            x += bw
            continue
        top = int(s.horizon * rng.uniform(0.05, 0.70))
        s.fill(top, s.horizon, x, x + bw, _ID["building"], s.object_tint(0.06))
        s.tint[top + 1:s.horizon - 1:step, x + 1:x + bw - 1:step] -= 0.12  # windows
        low = int(rng.integers(1, max(2, s.h // 14) + 1))  # height of a wall or fence
        kind = rng.random()
        if kind < 0.12:
            s.fill(s.horizon - low, s.horizon, x, x + bw, _ID["wall"], s.object_tint())
        elif kind < 0.24:
            if s.fill(s.horizon - low, s.horizon, x, x + bw, _ID["fence"], s.object_tint()):
                s.tint[max(s.horizon - low, 0):s.horizon, x:x + bw:2] -= 0.10  # posts
        x += bw


def _draw_ground(s: _Scene) -> None:
    """Road (with dashed centre line), sidewalks on both sides, terrain beyond them."""
    xs = np.arange(s.w, dtype=np.float32) + 0.5
    offset = xs[None, :] - s.cx[:, None]  # (ground rows, W): signed distance to centre
    walk = np.where(offset < 0, s.walk_left[:, None], s.walk_right[:, None])
    dist = np.abs(offset)
    ground = np.full(offset.shape, _ID["terrain"], dtype=np.uint8)
    ground[dist <= s.half[:, None] + walk] = _ID["sidewalk"]
    ground[dist <= s.half[:, None]] = _ID["road"]
    s.label[s.horizon:] = ground
    s.tint[s.horizon:] = s.object_tint(0.03)
    # Lane markings are labelled road in Cityscapes too; they only change the colour.
    rows = np.arange(s.horizon, s.h)
    dashes = (rows // max(2, s.h // 16)) % 2 == 0
    cols = np.clip(s.cx.astype(np.int64), 0, s.w - 1)
    s.tint[rows[dashes], cols[dashes]] += 0.35


def _draw_trees(s: _Scene) -> None:
    """One to three trees: an elliptic crown on a trunk, all labelled vegetation."""
    rng = s.rng
    for _ in range(int(rng.integers(1, 4))):
        ry = s.h * rng.uniform(0.06, 0.14)
        rx = ry * rng.uniform(0.8, 1.5)
        cx = rng.uniform(0, s.w)
        cy = s.horizon - ry * rng.uniform(0.4, 1.2)
        tint = s.object_tint()
        trunk_w = max(1, int(rx * 0.2))
        trunk_bottom = s.horizon + int((s.h - s.horizon) * 0.15)
        s.fill(cy, trunk_bottom, cx - trunk_w / 2, cx + trunk_w / 2, _ID["vegetation"], tint - 0.05)
        y0, y1 = max(int(cy - ry), 0), min(int(cy + ry) + 1, s.h)
        x0, x1 = max(int(cx - rx), 0), min(int(cx + rx) + 1, s.w)
        if y0 >= y1 or x0 >= x1:
            continue
        yy, xx = np.ogrid[y0:y1, x0:x1]
        crown = ((yy + 0.5 - cy) / ry) ** 2 + ((xx + 0.5 - cx) / rx) ** 2 <= 1.0
        s.label[y0:y1, x0:x1][crown] = _ID["vegetation"]
        s.tint[y0:y1, x0:x1][crown] = tint


def _draw_poles(s: _Scene) -> None:
    """One to three poles on the sidewalks, most carrying a sign or a traffic light."""
    rng = s.rng
    for _ in range(int(rng.integers(1, 4))):
        y_base = s.ground_row(0.2, 0.95)
        r = y_base - s.horizon
        scale = 0.35 + 0.65 * s.t[r]  # nearer (lower) objects are drawn larger
        side = 1 if rng.random() < 0.5 else -1
        walk = s.walk_right[r] if side > 0 else s.walk_left[r]
        x = s.cx[r] + side * (s.half[r] + 0.6 * walk)
        width = max(1, int(round(s.w * 0.012 * scale)))
        top = y_base - int(s.h * rng.uniform(0.35, 0.55) * scale)
        s.fill(top, y_base, x, x + width, _ID["pole"], s.object_tint(0.03))
        box = max(2, int(round(width * 2.5)))
        x_mid = x + width / 2
        kind = rng.random()
        if kind < 0.65:
            s.fill(top, top + box, x_mid - box / 2, x_mid + box / 2, _ID["traffic sign"],
                   s.object_tint(0.04))
        elif kind < 0.90:
            s.fill(top, top + 2 * box, x_mid - box / 2, x_mid + box / 2,
                   _ID["traffic light"], s.object_tint(0.04))
            s.shade(top, top + box, x_mid - box / 2, x_mid + box / 2, 0.1)  # the lit lamp


def _vehicle(s: _Scene, y_base: int):
    """A car, sometimes a truck, bus or tram, standing in a lane at row ``y_base``."""
    rng = s.rng
    r = y_base - s.horizon
    width = s.half[r] * rng.uniform(0.55, 0.85)
    x_mid = s.cx[r] + s.half[r] * rng.uniform(-0.55, 0.55)
    kind = rng.random()
    if kind < 0.80:
        cls, height = _ID["car"], width * rng.uniform(0.50, 0.65)
    else:
        cls = _ID["truck"] if kind < 0.88 else _ID["bus"] if kind < 0.96 else _ID["train"]
        width *= 1.2
        height = width * rng.uniform(0.80, 1.00)
    top = y_base - max(2, int(height))
    x0, x1 = x_mid - width / 2, x_mid + width / 2
    if s.fill(top, y_base, x0, x1, cls, s.object_tint(0.06)):
        s.shade(top, top + max(1, int(height / 3)), x0, x1, -0.06)  # windows
        s.shade(y_base - 1, y_base, x0, x1, -0.06)  # wheels


def _pedestrian(s: _Scene, y_base: int):
    """A person standing on a sidewalk at row ``y_base``."""
    rng = s.rng
    r = y_base - s.horizon
    side = 1 if rng.random() < 0.5 else -1
    walk = s.walk_right[r] if side > 0 else s.walk_left[r]
    x_mid = s.cx[r] + side * (s.half[r] + walk * rng.uniform(0.2, 0.9))
    height = max(3, int(s.h * rng.uniform(0.18, 0.28) * (0.3 + 0.7 * s.t[r])))
    width = max(1, int(round(height * 0.35)))
    top = y_base - height
    x0, x1 = x_mid - width / 2, x_mid + width / 2
    if s.fill(top, y_base, x0, x1, _ID["person"], s.object_tint(0.06)):
        s.shade(top, top + max(1, height // 5), x0, x1, 0.15)  # head


def _cyclist(s: _Scene, y_base: int):
    """A rider on a bicycle or motorcycle near the road's edge at row ``y_base``."""
    rng = s.rng
    r = y_base - s.horizon
    side = 1 if rng.random() < 0.5 else -1
    x_mid = s.cx[r] + side * s.half[r] * rng.uniform(0.6, 0.9)
    scale = 0.3 + 0.7 * s.t[r]
    bike_h = max(2, int(s.h * 0.10 * scale))
    bike_w = max(2, int(bike_h * 1.6))
    rider_h = max(2, int(s.h * 0.12 * scale))
    rider_w = max(1, int(rider_h * 0.45))
    bike = _ID["bicycle"] if rng.random() < 0.7 else _ID["motorcycle"]
    s.fill(y_base - bike_h - rider_h + 1, y_base - bike_h + 1, x_mid - rider_w / 2,
           x_mid + rider_w / 2, _ID["rider"], s.object_tint(0.06))
    s.fill(y_base - bike_h, y_base, x_mid - bike_w / 2, x_mid + bike_w / 2, bike,
           s.object_tint(0.06))


def _draw_traffic(s: _Scene) -> None:
    """Vehicles, pedestrians and cyclists, far ones first so near ones cover them."""
    rng = s.rng
    items = [(s.ground_row(0.15, 1.0), _vehicle) for _ in range(int(rng.integers(1, 4)))]
    items += [(s.ground_row(0.15, 1.0), _pedestrian) for _ in range(int(rng.integers(1, 4)))]
    if rng.random() < 0.35:
        items.append((s.ground_row(0.2, 1.0), _cyclist))
    for y_base, draw in sorted(items, key=lambda item: item[0]):
        draw(s, y_base)


def _draw_ego_vehicle(s: _Scene) -> None:
    """The bonnet of the recording car along the bottom edge, labelled ignore (255).

    Real Cityscapes frames have it too (labelId 1, "ego vehicle"); it is not evaluated.
    """
    rng = s.rng
    depth = max(1, int(round(s.h * rng.uniform(0.05, 0.09))))
    u = (np.arange(s.w) + 0.5) / s.w * 2.0 - 1.0  # -1 at the left edge, +1 at the right
    top = s.h - depth + np.round(0.6 * depth * u * u).astype(np.int64)
    rows = np.arange(s.h)[:, None]
    mask = rows >= top[None, :]
    s.label[mask] = IGNORE_INDEX
    s.tint[mask] = 0.0


def render_scene(rng: np.random.Generator, height: int,
                 width: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw one synthetic street scene, ``height`` x ``width`` pixels (each >= 16), from ``rng``
    alone: ``(rgb, label)``, float32 ``(H, W, 3)`` in [0, 1] and uint8 ``(H, W)`` trainIds.
    """
    s = _Scene(rng, height, width)
    _draw_sky_and_skyline(s)
    _draw_ground(s)
    _draw_trees(s)
    _draw_poles(s)
    _draw_traffic(s)
    _draw_ego_vehicle(s)
    palette = _PALETTE.copy()
    palette[:NUM_CLASSES] += rng.normal(0.0, 0.03, (NUM_CLASSES, 3)).astype(np.float32)
    gain = np.float32(rng.uniform(0.70, 0.95))  # exposure varies from frame to frame
    noise = rng.standard_normal((height, width, 3), dtype=np.float32) * np.float32(0.04)
    rgb = (palette[s.label] + s.tint) * gain + noise
    return np.clip(rgb, 0.0, 1.0), s.label


class _Cityscapes(Dataset):
    """What both data sets share: class names, normalisation, colours (:func:`colorize_target`)."""

    classes = CITYSCAPES_CLASSES
    mean, std = CITYSCAPES_MEAN, CITYSCAPES_STD
    colorize = staticmethod(colorize_target)


class SyntheticCityscapes(_Cityscapes):
    """Procedural Cityscapes-like street scenes with per-pixel trainId targets.

    Sample ``i`` is drawn from ``numpy.random.default_rng([seed, stream, i])`` (``stream`` 0, 1, 2
    for ``split`` "train", "val", "test"): the same whichever process, worker or access order
    asks, and the splits share no sample. About a millisecond per 64x128 sample. The scenes hold
    all 19 classes (train, motorcycle and bicycle rarely) and an ego-vehicle strip along the
    bottom labelled :data:`IGNORE_INDEX`. ``size`` is ``(H, W)``, each >= 16 (default
    ``(64, 128)``, Cityscapes' 1:2 shape); ``dataset[i]`` is ``(image, target)`` as above.

    Raises:
        ValueError: a negative or non-int ``num_samples`` or ``seed``, a bad ``size``, an
            unknown ``split``.
    """

    def __init__(self, num_samples: int, size: Sequence[int] = (64, 128), seed: int = 0,
                 split: str = "train"):
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) \
                or num_samples < 0:
            raise ValueError(f"num_samples must be an int >= 0, got {num_samples!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if split not in _SPLIT_STREAM:
            raise ValueError(f"split must be one of {sorted(_SPLIT_STREAM)}, got {split!r}")
        self.num_samples = int(num_samples)
        self.size = _check_size(size, minimum=16)
        self.seed = int(seed)
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw sample ``index``: float32 ``(3, H, W)`` and int64 ``(H, W)``.

        Raises:
            IndexError: ``index`` outside ``[-len, len)``.
        """
        index = _check_index(index, self.num_samples, type(self).__name__)
        rng = np.random.default_rng([self.seed, _SPLIT_STREAM[self.split], index])
        rgb, label = render_scene(rng, *self.size)
        return normalize_image(rgb), torch.from_numpy(label.astype(np.int64))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_samples={self.num_samples}, size={self.size}, "
                f"seed={self.seed}, split={self.split!r})")


# --------------------------------------------------------------------------------------
# The real Cityscapes folder
# --------------------------------------------------------------------------------------

_IMAGE_SUFFIX = "_leftImg8bit.png"
_LABEL_SUFFIX = "_gtFine_labelIds.png"


def _layout(root: Path, split: str) -> str:
    """The expected folder layout, for error messages."""
    return (f"{root}/leftImg8bit/{split}/<city>/<city>_<seq>_<frame>{_IMAGE_SUFFIX} and "
            f"{root}/gtFine/{split}/<city>/<city>_<seq>_<frame>{_LABEL_SUFFIX}")


class CityscapesFolder(_Cityscapes):
    """The real Cityscapes fine annotations, read from the official folder layout.

    Expects ``root/leftImg8bit/{split}/{city}/{city}_{seq}_{frame}_leftImg8bit.png`` and, for
    each, ``root/gtFine/{split}/{city}/{city}_{seq}_{frame}_gtFine_labelIds.png`` (as unpacked
    from the official zips); labelIds become trainIds (:data:`LABEL_ID_TO_TRAIN_ID`). Sorted by
    file name, so index ``i`` is the same file on every rank. ``size``: None keeps 1024x2048,
    ``(H, W)`` resizes (the image bilinearly, the labels nearest-neighbour); ``max_samples``
    keeps the first files only. ``dataset[i]`` is as :class:`SyntheticCityscapes`'s.

    Raises:
        FileNotFoundError: ``root`` or its split folder missing (names the layout), no images,
            or an image without its label file (names both).
        ValueError: a bad ``size`` or ``max_samples``.
    """

    def __init__(self, root, split: str = "train", size: Sequence[int] | None = None,
                 max_samples: int | None = None):
        self.root = Path(root)
        self.split = split
        self.size = None if size is None else _check_size(size, minimum=1)
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(
                max_samples, (int, np.integer)) or max_samples < 0):
            raise ValueError(f"max_samples must be None or an int >= 0, got {max_samples!r}")
        self.files = self._find_pairs()[:max_samples]

    def _find_pairs(self) -> list[tuple[Path, Path]]:
        """Every ``(image, label)`` path pair of the split, sorted by image name."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"Cityscapes root {self.root} does not exist; expected "
                                    f"{_layout(self.root, self.split)}")
        image_dir = self.root / "leftImg8bit" / self.split
        if not image_dir.is_dir():
            raise FileNotFoundError(f"no folder {image_dir} for split {self.split!r}; expected "
                                    f"{_layout(self.root, self.split)}")
        images = sorted(image_dir.glob(f"*/*{_IMAGE_SUFFIX}"))
        if not images:
            raise FileNotFoundError(f"no images for split {self.split!r}: nothing matches "
                                    f"{image_dir}/<city>/*{_IMAGE_SUFFIX}")
        pairs = []
        for image in images:
            prefix = image.name[: -len(_IMAGE_SUFFIX)]  # "{city}_{seq}_{frame}"
            label = self.root / "gtFine" / self.split / image.parent.name / (prefix + _LABEL_SUFFIX)
            if not label.is_file():
                raise FileNotFoundError(f"image {image} has no label file: expected {label}")
            pairs.append((image, label))
        return pairs

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read, resize and normalise sample ``index``: float32 ``(3, H, W)``, int64 ``(H, W)``.

        Raises:
            IndexError: ``index`` outside ``[-len, len)``.
            ValueError: the label file is not single-channel or not the image's size (names both).
        """
        from PIL import Image

        index = _check_index(index, len(self.files), type(self).__name__)
        image_path, label_path = self.files[index]
        with Image.open(image_path) as f:
            image = f.convert("RGB")
        with Image.open(label_path) as f:
            label = f.copy()
        if label.mode not in ("L", "P", "I", "I;16"):
            raise ValueError(f"label file {label_path} has mode {label.mode}; expected a "
                             f"single-channel labelIds image")
        if label.size != image.size:
            raise ValueError(f"label file {label_path} is {label.size[0]}x{label.size[1]} but "
                             f"image {image_path} is {image.size[0]}x{image.size[1]} (WxH)")
        if self.size is not None:
            height, width = self.size
            image = image.resize((width, height), Image.BILINEAR)
            label = label.resize((width, height), Image.NEAREST)  # never blend two ids
        rgb = np.asarray(image, dtype=np.float32) / 255.0
        target = label_ids_to_train_ids(np.asarray(label))
        return normalize_image(rgb), torch.from_numpy(target.astype(np.int64))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(root={str(self.root)!r}, split={self.split!r}, "
                f"size={self.size}, len={len(self)})")


def make_datasets(num_train: int | None, num_val: int | None, size: Sequence[int] | None,
                  seed: int, data_root=None) -> tuple[Dataset, Dataset]:
    """``(train_ds, val_ds)`` for the lessons and ``ddp_lesson.train``: two
    :class:`SyntheticCityscapes` (``data_root`` None; train and val from different streams) or
    two :class:`CityscapesFolder` (splits "train" and "val"; ``num_train``/``num_val`` are caps,
    None for all, and ``size`` None keeps 1024x2048).

    Raises:
        ValueError: synthetic data without a sample count, or a bad size or seed.
        FileNotFoundError: as :class:`CityscapesFolder`.
    """
    if data_root is None:
        if num_train is None or num_val is None or size is None:
            raise ValueError(f"synthetic data needs num_train, num_val and size, got "
                             f"num_train={num_train}, num_val={num_val}, size={size}")
        return (SyntheticCityscapes(num_train, size, seed, split="train"),
                SyntheticCityscapes(num_val, size, seed, split="val"))
    return (CityscapesFolder(data_root, "train", size, max_samples=num_train),
            CityscapesFolder(data_root, "val", size, max_samples=num_val))


def load_datasets(cfg) -> tuple[Dataset, Dataset]:
    """``(train, val)`` for a :class:`~ddp_lesson.config.TrainConfig` (:func:`make_datasets`).

    Raises:
        TrainInputError: a missing or malformed ``--data-root`` (named), or bad sizes.
    """
    try:
        return make_datasets(cfg.num_train, cfg.num_val, cfg.size, cfg.seed,
                             data_root=cfg.data_root)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        where = "" if cfg.data_root is None else f"--data-root {cfg.data_root!r}: "
        raise TrainInputError(f"{where}{exc}") from None
