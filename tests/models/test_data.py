"""Tests for ddp_lesson.data: the official tables, synthetic scenes, the real folder layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from cityscapesscripts.helpers.labels import labels as CS_LABELS
from PIL import Image

from ddp_lesson.data import (
    CITYSCAPES_CLASSES,
    CITYSCAPES_MEAN,
    CITYSCAPES_STD,
    IGNORE_INDEX,
    LABEL_ID_TO_TRAIN_ID,
    NUM_CLASSES,
    TRAIN_ID_COLORS,
    CityscapesFolder,
    SyntheticCityscapes,
    colorize_target,
    denormalize_image,
    label_ids_to_train_ids,
    make_datasets,
)


def official_train_id(label_id: int) -> int:
    """trainId of a labelId straight from cityscapesscripts (255 for 255 and -1)."""
    (label,) = [l for l in CS_LABELS if l.id == label_id]
    return label.trainId if 0 <= label.trainId < 255 else 255


# --------------------------------------------------------------------------------------
# The official tables
# --------------------------------------------------------------------------------------

def test_class_names_match_cityscapesscripts():
    evaluated = sorted((l for l in CS_LABELS if 0 <= l.trainId < 255), key=lambda l: l.trainId)
    assert CITYSCAPES_CLASSES == tuple(l.name for l in evaluated)
    assert NUM_CLASSES == 19 == len(CITYSCAPES_CLASSES)
    assert IGNORE_INDEX == 255
    assert CITYSCAPES_CLASSES[0] == "road" and CITYSCAPES_CLASSES[13] == "car"
    assert CITYSCAPES_CLASSES[-1] == "bicycle"
    assert TRAIN_ID_COLORS == tuple(tuple(l.color) for l in evaluated)


def test_label_table_matches_cityscapesscripts():
    expected = {l.id: official_train_id(l.id) for l in CS_LABELS if l.id >= 0}
    assert LABEL_ID_TO_TRAIN_ID == expected
    assert LABEL_ID_TO_TRAIN_ID[7] == 0 and LABEL_ID_TO_TRAIN_ID[26] == 13
    assert LABEL_ID_TO_TRAIN_ID[0] == 255 and LABEL_ID_TO_TRAIN_ID[9] == 255  # parking
    mapped = label_ids_to_train_ids(np.arange(256, dtype=np.uint8))
    for label_id in range(256):
        assert mapped[label_id] == expected.get(label_id, 255), label_id


def test_label_ids_out_of_range_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 300\]"):
        label_ids_to_train_ids(np.array([0, 300]))


def test_colorize_uses_official_colors_and_black_for_ignore():
    target = torch.tensor([[0, 13], [255, 18]])
    rgb = colorize_target(target)
    assert rgb.dtype == np.uint8 and rgb.shape == (2, 2, 3)
    assert tuple(rgb[0, 0]) == TRAIN_ID_COLORS[0] == (128, 64, 128)
    assert tuple(rgb[0, 1]) == TRAIN_ID_COLORS[13]
    assert tuple(rgb[1, 0]) == (0, 0, 0)
    assert tuple(rgb[1, 1]) == TRAIN_ID_COLORS[18]
    with pytest.raises(ValueError, match=r"\[19\] outside 0..18"):
        colorize_target(np.array([[19, 0]]))
    with pytest.raises(ValueError, match=r"\(H, W\)"):
        colorize_target(np.zeros((1, 2, 2), dtype=np.int64))


# --------------------------------------------------------------------------------------
# SyntheticCityscapes
# --------------------------------------------------------------------------------------

def assert_same_samples(a, b):
    for (image_a, target_a), (image_b, target_b) in zip(a, b, strict=True):
        assert torch.equal(image_a, image_b)
        assert torch.equal(target_a, target_b)


def test_sample_depends_only_on_seed_and_index():
    forward = SyntheticCityscapes(6, seed=3)
    backward = SyntheticCityscapes(40, seed=3)  # a longer data set: same first samples
    in_order = [forward[i] for i in range(6)]
    reversed_order = [backward[i] for i in reversed(range(6))][::-1]
    assert_same_samples(in_order, reversed_order)
    assert_same_samples(in_order, [forward[i] for i in range(6)])  # asked again


@pytest.mark.slow
def test_dataloader_workers_see_the_same_samples():
    dataset = SyntheticCityscapes(6, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2)
    images, targets = zip(*loader)
    assert torch.equal(torch.cat(images), torch.stack([dataset[i][0] for i in range(6)]))
    assert torch.equal(torch.cat(targets), torch.stack([dataset[i][1] for i in range(6)]))


def test_seeds_and_splits_give_different_samples():
    base = SyntheticCityscapes(3, seed=0)[2][1]
    assert not torch.equal(base, SyntheticCityscapes(3, seed=1)[2][1])
    assert not torch.equal(base, SyntheticCityscapes(3, seed=0, split="val")[2][1])
    assert not torch.equal(base, SyntheticCityscapes(3, seed=0)[1][1])


@pytest.mark.parametrize("size", [(64, 128), (16, 16), (37, 90)])
def test_shapes_dtypes_and_values(size):
    dataset = SyntheticCityscapes(4, size=size)
    assert len(dataset) == 4
    for image, target in dataset:
        assert image.dtype == torch.float32 and image.shape == (3, *size)
        assert target.dtype == torch.int64 and target.shape == size
        assert torch.isfinite(image).all()
        values = set(torch.unique(target).tolist())
        assert values <= set(range(NUM_CLASSES)) | {IGNORE_INDEX}, values


def test_scenes_cover_many_classes_and_mark_ignore_pixels():
    dataset = SyntheticCityscapes(16, seed=0)
    targets = torch.stack([dataset[i][1] for i in range(16)])
    present = set(torch.unique(targets).tolist()) - {IGNORE_INDEX}
    assert len(present) >= 8, sorted(present)
    for name in ("road", "sidewalk", "building", "vegetation", "sky", "car", "person", "pole"):
        assert CITYSCAPES_CLASSES.index(name) in present, name
    for target in targets:  # every frame has its ego-vehicle strip
        ignored = (target == IGNORE_INDEX).float().mean().item()
        assert 0.0 < ignored < 0.2, ignored


def test_normalisation_is_roughly_standard():
    images = torch.stack([image for image, _ in SyntheticCityscapes(32, seed=5)])
    mean = images.mean(dim=(0, 2, 3))
    std = images.std(dim=(0, 2, 3))
    assert (mean.abs() < 0.3).all(), mean
    assert ((std > 0.6) & (std < 1.4)).all(), std
    rgb = denormalize_image(images[0])
    assert rgb.dtype == np.uint8 and rgb.shape == (64, 128, 3)


def test_classes_differ_in_colour():
    """Each class has its own colour distribution: class means are well apart."""
    dataset = SyntheticCityscapes(16, seed=2)
    images = torch.stack([image for image, _ in dataset]).permute(0, 2, 3, 1).reshape(-1, 3)
    targets = torch.stack([target for _, target in dataset]).reshape(-1)
    names = ("road", "sidewalk", "building", "vegetation", "terrain", "sky", "car", "person")
    means = torch.stack([images[targets == CITYSCAPES_CLASSES.index(n)].mean(0) for n in names])
    distances = torch.cdist(means, means) + torch.eye(len(names)) * 1e3
    assert distances.min() > 0.3, distances.min()


def test_negative_index_and_out_of_range_index():
    dataset = SyntheticCityscapes(5)
    assert torch.equal(dataset[-1][1], dataset[4][1])
    with pytest.raises(IndexError, match=r"index 5 is out of range .* length 5"):
        dataset[5]
    with pytest.raises(IndexError, match=r"index -6 is out of range .* length 5"):
        dataset[-6]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=-1), r"num_samples must be an int >= 0, got -1"),
        (dict(num_samples=2.5), r"num_samples must be an int >= 0, got 2.5"),
        (dict(num_samples=4, size=(8, 128)), r">= 16, got \(8, 128\)"),
        (dict(num_samples=4, size=(64,)), r"\(height, width\) pair"),
        (dict(num_samples=4, seed=-3), r"seed must be an int >= 0, got -3"),
        (dict(num_samples=4, split="dev"), r"split must be one of .* got 'dev'"),
    ],
)
def test_bad_arguments_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticCityscapes(**kwargs)


def test_make_datasets_synthetic_train_and_val_do_not_overlap():
    train, val = make_datasets(5, 3, (32, 64), seed=7)
    assert (len(train), len(val)) == (5, 3)
    assert isinstance(train, SyntheticCityscapes) and train.size == (32, 64)
    assert_same_samples([train[i] for i in range(5)],
                        [SyntheticCityscapes(5, (32, 64), seed=7)[i] for i in range(5)])
    for i in range(3):
        for j in range(5):
            assert not torch.equal(val[i][1], train[j][1])
    with pytest.raises(ValueError, match="num_train=None"):
        make_datasets(None, 3, (32, 64), seed=7)


# --------------------------------------------------------------------------------------
# CityscapesFolder on a tiny tree in the official layout
# --------------------------------------------------------------------------------------

H, W = 8, 16
# labelId blocks of 2x2 pixels, so nearest-neighbour halving keeps every value.
# 7 road->0, 26 car->13, 0 unlabeled->255, 8 sidewalk->1, 9 parking->255, 33 bicycle->18.
LABEL_IDS = (7, 26, 0, 8, 9, 33)
FRAMES = [("aachen", "000000_000019"), ("aachen", "000001_000019"), ("bochum", "000000_000313")]


def write_frame(root, split, city, frame, index):
    rng = np.random.default_rng(index)
    prefix = f"{city}_{frame}"
    image = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    blocks = rng.choice(LABEL_IDS, size=(H // 2, W // 2)).astype(np.uint8)
    label_ids = np.kron(blocks, np.ones((2, 2), dtype=np.uint8))
    (root / "leftImg8bit" / split / city).mkdir(parents=True, exist_ok=True)
    (root / "gtFine" / split / city).mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(root / "leftImg8bit" / split / city / f"{prefix}_leftImg8bit.png")
    Image.fromarray(label_ids).save(
        root / "gtFine" / split / city / f"{prefix}_gtFine_labelIds.png")
    return image, label_ids


@pytest.fixture
def cityscapes_root(tmp_path):
    """A 3-frame train split and a 1-frame val split; returns (root, [(image, labelIds)])."""
    root = tmp_path / "cityscapes"
    frames = [write_frame(root, "train", city, frame, i) for i, (city, frame) in enumerate(FRAMES)]
    write_frame(root, "val", "frankfurt", "000000_000294", 99)
    return root, frames


def expected_train_ids(label_ids):
    table = np.vectorize(official_train_id)
    return torch.from_numpy(table(label_ids).astype(np.int64))


def test_folder_maps_label_ids_pixel_for_pixel(cityscapes_root):
    root, frames = cityscapes_root
    dataset = CityscapesFolder(root, "train")
    assert len(dataset) == 3
    assert [image.parent.name for image, _ in dataset.files] == ["aachen", "aachen", "bochum"]
    for (image, target), (rgb, label_ids) in zip(dataset, frames, strict=True):
        assert image.dtype == torch.float32 and image.shape == (3, H, W)
        assert target.dtype == torch.int64 and target.shape == (H, W)
        assert torch.equal(target, expected_train_ids(label_ids))
        assert denormalize_image(image).tolist() == rgb.tolist()  # mean/std undone exactly
    mean = torch.tensor(CITYSCAPES_MEAN).view(3, 1, 1)
    std = torch.tensor(CITYSCAPES_STD).view(3, 1, 1)
    first_rgb = torch.from_numpy(frames[0][0]).permute(2, 0, 1) / 255.0
    assert torch.allclose(dataset[0][0], (first_rgb - mean) / std, atol=1e-5)
    seen = set(torch.unique(torch.stack([t for _, t in dataset])).tolist())
    assert {0, 13, 255} <= seen
    assert dataset.colorize(dataset[0][1]).shape == (H, W, 3)


def test_folder_resizes_image_bilinear_and_labels_nearest(cityscapes_root):
    root, frames = cityscapes_root
    dataset = CityscapesFolder(root, "train", size=(H // 2, W // 2))
    image, target = dataset[2]
    assert image.shape == (3, H // 2, W // 2) and target.shape == (H // 2, W // 2)
    assert torch.equal(target, expected_train_ids(frames[2][1])[::2, ::2])
    upscaled = CityscapesFolder(root, "train", size=(3 * H, 5 * W))[0][1]
    assert set(torch.unique(upscaled).tolist()) <= {0, 1, 13, 18, 255}  # no blended ids


def test_make_datasets_reads_the_folder(cityscapes_root):
    root, _ = cityscapes_root
    train, val = make_datasets(2, None, None, seed=0, data_root=root)
    assert isinstance(train, CityscapesFolder) and isinstance(val, CityscapesFolder)
    assert (len(train), len(val)) == (2, 1)


def test_folder_errors_name_paths(cityscapes_root):
    root, _ = cityscapes_root
    missing = root.parent / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist.*leftImg8bit/train"):
        CityscapesFolder(missing)
    with pytest.raises(FileNotFoundError, match=r"no folder .*leftImg8bit/test for split 'test'"):
        CityscapesFolder(root, "test")
    (root / "leftImg8bit" / "empty" / "aachen").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"no images for split 'empty'"):
        CityscapesFolder(root, "empty")
    (root / "gtFine" / "train" / "bochum" / "bochum_000000_000313_gtFine_labelIds.png").unlink()
    with pytest.raises(FileNotFoundError,
                       match=r"bochum_000000_000313_leftImg8bit.png has no label file.*"
                             r"bochum_000000_000313_gtFine_labelIds.png"):
        CityscapesFolder(root, "train")
    with pytest.raises(ValueError, match=r">= 1, got \(0, 4\)"):
        CityscapesFolder(root, "val", size=(0, 4))
    with pytest.raises(ValueError, match=r"max_samples must be None or an int >= 0, got -1"):
        CityscapesFolder(root, "val", max_samples=-1)


def test_folder_index_and_size_mismatch_errors(cityscapes_root):
    root, _ = cityscapes_root
    dataset = CityscapesFolder(root, "val")
    with pytest.raises(IndexError, match=r"index 1 is out of range .* length 1"):
        dataset[1]
    label_path = dataset.files[0][1]
    Image.fromarray(np.zeros((H, W + 2), dtype=np.uint8)).save(label_path)
    with pytest.raises(ValueError, match=rf"is {W + 2}x{H} but image .* is {W}x{H}"):
        dataset[0]
