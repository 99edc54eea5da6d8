"""Segmentation data made here: shapes on backgrounds, written in Pascal VOC's layout (`samples segmentation`).

Each scene is a smooth grey-ish random background with one to three shapes (class 1 disc, 2 square, 3 triangle; 0
the background), each in a jittered colour of its class (reddish, greenish, bluish), so a small model learns them
in a minute on a CPU from colour and shape together. As in VOC's
SegmentationClass/, every shape's outline is marked 255 (ignored, `BORDER` pixels wide), and the masks are palette
PNGs whose palette index is the class id. The training scenes' masks are written again as the augmented set that
DeepLabV3 trains on lays them out (SegmentationClassAug/, greyscale PNGs of the label ids, and
ImageSets/Segmentation/trainaug.txt: `split: trainaug`, `masks: SegmentationClassAug`), the same labels. Image sizes
vary between scenes (`MIN_SIDE` .. `MAX_SIDE`), so random crops, padding and evaluation at the image's own size are
all exercised. Deterministic from the seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = ("background", "disc", "square", "triangle")
CLASS_COLOURS = {1: (200, 60, 60), 2: (60, 190, 70), 3: (60, 80, 210)}  # RGB, jittered per shape
IGNORE = 255
BORDER = 1  # outline pixels marked IGNORE on each side of a shape's edge
MIN_SIDE, MAX_SIDE = 64, 88


def voc_palette() -> list[int]:
    """Pascal VOC's colour map (the bit-interleaving of the class id), 256 entries; 255 is VOC's border colour."""
    palette = []
    for index in range(256):
        red = green = blue = 0
        value = index
        for bit in range(8):
            red |= ((value >> 0) & 1) << (7 - bit)
            green |= ((value >> 1) & 1) << (7 - bit)
            blue |= ((value >> 2) & 1) << (7 - bit)
            value >>= 3
        palette += [red, green, blue]
    palette[IGNORE * 3:IGNORE * 3 + 3] = [224, 224, 192]
    return palette


def _shape(kind: int, ys: np.ndarray, xs: np.ndarray, cy: float, cx: float, radius: float) -> np.ndarray:
    if kind == 1:
        return (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2
    if kind == 2:
        return (np.abs(ys - cy) <= radius * 0.85) & (np.abs(xs - cx) <= radius * 0.85)
    # an upward triangle: below its apex, above its base, within the two slanted edges
    top, base = cy - radius, cy + radius * 0.8
    half = (ys - top) / (base - top) * radius
    return (ys >= top) & (ys <= base) & (np.abs(xs - cx) <= half)


def _edge(region: np.ndarray) -> np.ndarray:
    """Pixels within BORDER of the region's boundary, on either side."""
    grown, shrunk = region.copy(), region.copy()
    for _ in range(BORDER):
        padded = np.pad(grown, 1)
        grown = padded[1:-1, 1:-1] | padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
        padded = np.pad(shrunk, 1, constant_values=True)
        shrunk = padded[1:-1, 1:-1] & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return grown & ~shrunk


def scene(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(image uint8 H x W x 3, mask uint8 H x W) of one scene."""
    height, width = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    # a bilinear gradient of low-saturation colours, with noise
    corners = rng.uniform(60, 200, size=(2, 2, 1)) + rng.uniform(-15, 15, size=(2, 2, 3))
    fy, fx = (ys / height)[..., None], (xs / width)[..., None]
    image = ((1 - fy) * ((1 - fx) * corners[0, 0] + fx * corners[0, 1]) + fy * ((1 - fx) * corners[1, 0]
             + fx * corners[1, 1]))
    image += rng.normal(0, 12, size=image.shape)
    mask = np.zeros((height, width), dtype=np.uint8)
    edges = np.zeros((height, width), dtype=bool)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(1, len(CLASSES)))
        radius = rng.uniform(6, min(height, width) / 3)
        cy, cx = rng.uniform(radius, height - radius), rng.uniform(radius, width - radius)
        region = _shape(kind, ys, xs, cy, cx, radius)
        colour = np.array(CLASS_COLOURS[kind]) + rng.uniform(-40, 40, size=3)
        image[region] = colour + rng.normal(0, 12, size=(int(region.sum()), 3))
        mask[region] = kind
        edges |= _edge(region)
    mask[edges] = IGNORE
    return np.clip(image, 0, 255).astype(np.uint8), mask


def write_voc(folder: Path, train: int = 160, val: int = 40, seed: int = 0) -> dict:
    """`train` + `val` scenes as a VOC folder: JPEGImages/, SegmentationClass/, ImageSets/Segmentation/, and the
    training scenes as the augmented set too (SegmentationClassAug/, trainaug.txt)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for sub in ("JPEGImages", "SegmentationClass", "SegmentationClassAug", "ImageSets/Segmentation"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    palette = voc_palette()
    names = {"train": [f"scene_{i:05d}" for i in range(train)],
             "val": [f"scene_{i:05d}" for i in range(train, train + val)]}
    for split, ids in names.items():
        for name in ids:
            image, mask = scene(rng)
            Image.fromarray(image, mode="RGB").save(folder / "JPEGImages" / f"{name}.jpg", quality=95)
            picture = Image.fromarray(mask, mode="P")
            picture.putpalette(palette)
            picture.save(folder / "SegmentationClass" / f"{name}.png")
            if split == "train":
                Image.fromarray(mask, mode="L").save(folder / "SegmentationClassAug" / f"{name}.png")
        (folder / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{n}\n" for n in ids))
    (folder / "ImageSets" / "Segmentation" / "trainaug.txt").write_text("".join(f"{n}\n" for n in names["train"]))
    return {"path": str(folder), "layout": "voc", "classes": len(CLASSES), "train": train, "val": val,
            "ignore_index": IGNORE}
