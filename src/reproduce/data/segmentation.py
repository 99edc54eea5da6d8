"""`format: segmentation`: images with a mask of class ids each, in Pascal VOC's layout, images/ and masks/, or
Cityscapes' (its labelTrainIds masks), found from the folder unless `data.layout` says (docs/segmentation.md).

Training samples are cut as DeepLabV3 and MMSegmentation cut them (rescale, normalise, pad, crop, flip), with the
loader's per-sample draws, so a sample's valid pixels are counted from its mask alone (`target_counts_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from ..errors import UserError
from .images import IMAGENET_MEAN, IMAGENET_STD, open_image
from .loader import seeded_samples

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff")
MASK_SUFFIX = ".png"
VOC_LISTS = Path("ImageSets") / "Segmentation"
VOC_MASKS = "SegmentationClass"
CITY_IMAGES, CITY_MASKS = "leftImg8bit", "gtFine"
CITY_IMAGE, CITY_MASK, CITY_RAW = "_leftImg8bit.png", "_gtFine_labelTrainIds.png", "_gtFine_labelIds.png"


@dataclass(frozen=True)
class Pair:
    image: Path
    mask: Path
    height: int
    width: int


@dataclass(frozen=True)
class Cut:
    """A training sample's draws: the rescale, the crop's corner in the padded image, the flip."""

    scale: float
    top: int
    left: int
    flip: bool


@dataclass(frozen=True)
class Augment:
    train: bool
    crop: tuple[int, int] | None = None
    scale: tuple[float, float] | None = None
    flip: bool = True
    pad: bool = False
    ignore_index: int = 255
    all_pixels: bool = False  # data.loss_pixels: all, the loss's count is every pixel of the crop


def _scaled(size: int, factor: float) -> int:
    return max(1, int(round(size * factor)))


class SegmentationData(torch.utils.data.Dataset):
    """(image float32 3 x H x W, normalised; mask int64 H x W) pairs, cut at random for training."""

    def __init__(self, pairs: list[Pair], augment: Augment):
        self.pairs, self.augment = pairs, augment
        self.sizes_differ = len({(p.height, p.width) for p in pairs}) > 1  # evaluation then runs one image at a time

    def __len__(self) -> int:
        return len(self.pairs)

    def draw(self, index: int) -> Cut | None:
        augment = self.augment
        if not augment.train or augment.crop is None:
            return None
        pair = self.pairs[index]
        factor = 1.0
        if augment.scale is not None:
            low, high = augment.scale
            factor = low + (high - low) * float(torch.rand((), dtype=torch.float64))
        height, width = _scaled(pair.height, factor), _scaled(pair.width, factor)
        crop_h, crop_w = augment.crop
        top = int(torch.randint(0, max(height, crop_h) - crop_h + 1, ()))
        left = int(torch.randint(0, max(width, crop_w) - crop_w + 1, ()))
        flip = bool(torch.rand(()) < 0.5) if augment.flip else False
        return Cut(factor, top, left, flip)

    def _resize(self, tensor: torch.Tensor, cut: Cut | None, pair: Pair, nearest: bool) -> torch.Tensor:
        if cut is None or cut.scale == 1.0:
            return tensor
        size = [_scaled(pair.height, cut.scale), _scaled(pair.width, cut.scale)]
        mode = InterpolationMode.NEAREST if nearest else InterpolationMode.BILINEAR
        return TF.resize(tensor, size, interpolation=mode, antialias=not nearest)

    def _place(self, tensor: torch.Tensor, cut: Cut | None, fill: float) -> torch.Tensor:
        if cut is None:
            return tensor
        crop_h, crop_w = self.augment.crop
        below, right = max(0, crop_h - tensor.shape[-2]), max(0, crop_w - tensor.shape[-1])
        if below or right:
            tensor = TF.pad(tensor, [0, 0, right, below], fill=fill)
        tensor = tensor[..., cut.top:cut.top + crop_h, cut.left:cut.left + crop_w]
        return TF.horizontal_flip(tensor) if cut.flip else tensor

    def mask(self, index: int, cut: Cut | None) -> torch.Tensor:
        pair = self.pairs[index]
        mask = torch.from_numpy(read_mask(pair.mask).astype(np.int64))[None]
        return self._place(self._resize(mask, cut, pair, nearest=True), cut, self.augment.ignore_index)[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.pairs[index]
        cut = self.draw(index)  # first: the draws target_counts_at repeats
        image = torch.from_numpy(np.asarray(open_image(str(pair.image), "RGB")).copy()).permute(2, 0, 1)
        image = self._resize(TF.to_dtype(image, torch.float32, scale=True), cut, pair, nearest=False)
        image = self._place(TF.normalize(image, list(IMAGENET_MEAN), list(IMAGENET_STD)), cut, 0.0)
        return image, self.mask(index, cut)

    def target_counts_at(self, seed: int, step: int, indices: torch.Tensor) -> torch.Tensor:
        """Each sample's valid pixels as the loader cuts it at `step`: the same seeded draws, the mask alone read."""
        if self.augment.all_pixels and self.augment.train and self.augment.crop is not None:
            return torch.full((len(indices),), self.augment.crop[0] * self.augment.crop[1], dtype=torch.int64)
        counts = []
        with seeded_samples() as seed_sample:
            for index in indices.tolist():
                seed_sample(seed, step, index)
                mask = self.mask(index, self.draw(index))
                counts.append(int((mask != self.augment.ignore_index).sum()))
        return torch.tensor(counts, dtype=torch.int64)


# ---- reading and checking the files -------------------------------------------------------------------------------


def read_mask(path: Path) -> np.ndarray:
    """A mask's class ids: a palette PNG's indices or a greyscale PNG's values, never its colours."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as mask:
            if mask.mode not in ("P", "L", "I", "I;16"):
                raise UserError(f"{path}: a {mask.mode} image; a mask is a palette or greyscale PNG of class ids "
                                "(VOC's SegmentationClass/, Cityscapes' *_labelTrainIds.png)")
            return np.asarray(mask)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise UserError(f"{path}: cannot read as a mask: {exc}") from None


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.height, image.width
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise UserError(f"{path}: cannot read as an image: {exc}") from None


def _pair(image: Path, mask: Path) -> Pair:
    height, width = _size(image)
    mask_height, mask_width = _size(mask)
    if (mask_height, mask_width) != (height, width):
        raise UserError(f"{mask}: the mask is {mask_width} x {mask_height}, its image {image} is {width} x {height} "
                        "(width x height); a mask has its image's size")
    return Pair(image, mask, height, width)


def voc_pairs(root: Path, split: str, masks: str = VOC_MASKS) -> list[Pair]:
    listing = root / VOC_LISTS / f"{split}.txt"
    if not listing.is_file():
        present = sorted(p.stem for p in (root / VOC_LISTS).glob("*.txt"))
        raise UserError(f"{listing}: no such list (the split's image ids, one a line; found: "
                        f"{', '.join(present) or 'none'})")
    ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    if not ids:
        raise UserError(f"{listing}: an empty list; expected the split's image ids, one a line")
    pairs = []
    for name in ids:
        paths = [root / "JPEGImages" / f"{name}{suffix}" for ext in IMAGE_SUFFIXES for suffix in (ext, ext.upper())]
        image = next((path for path in paths if path.is_file()), None)
        mask = root / masks / f"{name}{MASK_SUFFIX}"
        if image is None:
            raise UserError(f"{listing}: image id {name!r} has no image JPEGImages/{name}.jpg"
                            + (f" (its mask {mask} exists)" if mask.is_file() else ""))
        if not mask.is_file():
            raise UserError(f"{image}: no mask {masks}/{name}.png (listed in {listing})" + _not_png(mask))
        pairs.append(_pair(image, mask))
    return pairs


def _not_png(mask: Path) -> str:
    """Why a mask of another format in the expected .png's place is not read."""
    for suffix in IMAGE_SUFFIXES:
        if suffix != MASK_SUFFIX and mask.with_suffix(suffix).is_file():
            return (f"; {mask.with_suffix(suffix).name} is a {suffix[1:].upper()} file, and a mask is a PNG of class "
                    "ids (JPEG's lossy compression changes the ids along every edge): save the masks as PNG")
    return ""


def split_folders(root: Path) -> bool:
    """images/ and masks/ split into train/ and val/ sub-folders (read as the training and evaluation splits)."""
    return all((root / top / split).is_dir() for top in ("images", "masks") for split in ("train", "val"))


def folder_pairs(root: Path, split: str | None = None) -> list[Pair]:
    """Every image of images/[SPLIT/] with the mask of its relative name in masks/[SPLIT/], none left over."""
    images_root, masks_root = root / "images", root / "masks"
    if split is not None:
        images_root, masks_root = images_root / split, masks_root / split
    images = {p.relative_to(images_root).with_suffix(""): p for p in sorted(images_root.rglob("*"))
              if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES}
    masks = {p.relative_to(masks_root).with_suffix(""): p for p in sorted(masks_root.rglob("*"))
             if p.is_file() and p.suffix.lower() == MASK_SUFFIX}
    if not images:
        raise UserError(f"{images_root}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    for name, image in images.items():
        if name not in masks:
            raise UserError(f"{image}: no mask {masks_root / name.with_suffix(MASK_SUFFIX)}"
                            + _not_png(masks_root / name.with_suffix(MASK_SUFFIX)))
    for name, mask in masks.items():
        if name not in images:
            raise UserError(f"{mask}: a mask without an image (expected {images_root / name}.jpg or .png)")
    return [_pair(images[name], masks[name]) for name in images]


def find_layout(root: Path, field: str, masks: str = VOC_MASKS) -> str:
    if not root.is_dir():
        raise UserError(f"{field}: {root}: no such folder (expected the VOC layout, images/ and masks/, or "
                        "Cityscapes')")
    if (root / "JPEGImages").is_dir() and (root / masks).is_dir():
        return "voc"
    if (root / "images").is_dir() and (root / "masks").is_dir():
        return "images-masks"

    if (root / CITY_IMAGES).is_dir() and (root / CITY_MASKS).is_dir():
        return "cityscapes"
    raise UserError(f"{field}: {root}: neither the VOC layout (JPEGImages/, SegmentationClass/, "
                    "ImageSets/Segmentation/), nor images/ and masks/ folders, nor Cityscapes' leftImg8bit/ and "
                    "gtFine/")


def cityscapes_files(root: Path, split: str) -> list[tuple[Path, Path]]:
    folder = root / CITY_IMAGES / split
    if not folder.is_dir():
        present = sorted(p.name for p in (root / CITY_IMAGES).iterdir() if p.is_dir())
        raise UserError(f"{folder}: no such split folder (found: {', '.join(present) or 'none'})")
    images = sorted(folder.rglob(f"*{CITY_IMAGE}"))
    if not images:
        raise UserError(f"{folder}: no *{CITY_IMAGE} images (Cityscapes: {CITY_IMAGES}/{split}/CITY/*{CITY_IMAGE})")
    pairs = []
    for image in images:
        relative = image.relative_to(folder)
        stem = relative.name[: -len(CITY_IMAGE)]
        mask = root / CITY_MASKS / split / relative.parent / f"{stem}{CITY_MASK}"
        if not mask.is_file():
            raw = mask.with_name(f"{stem}{CITY_RAW}")
            if raw.is_file():
                raise UserError(f"{raw}: Cityscapes' labelIds (34 raw ids) without its {CITY_MASK[1:]} (the 19 "
                                "training classes, 255 void); make them with cityscapesscripts' "
                                "createTrainIdLabelImgs.py (pip install cityscapesscripts; CITYSCAPES_DATASET="
                                f"{root} python -m cityscapesscripts.preparation.createTrainIdLabelImgs)")
            raise UserError(f"{image}: no mask {mask}")
        pairs.append((image, mask))
    return pairs


def check_masks(pairs: list[Pair], classes: int, ignore_index: int) -> None:
    """Every mask value is a class id (0 .. classes - 1) or ignore_index."""
    for pair in pairs:
        values = np.unique(read_mask(pair.mask))
        wrong = values[(values >= classes) & (values != ignore_index)]
        if wrong.size:
            raise UserError(f"{pair.mask}: mask value {int(wrong[0])} is neither a class (data.classes {classes}: ids "
                            f"0 .. {classes - 1}) nor ignore_index {ignore_index}")


def check_crop(pairs: list[Pair], augment: Augment) -> None:
    """Without padding, every image at the lowest rescale holds the crop."""
    if augment.pad or augment.crop is None:
        return
    low = augment.scale[0] if augment.scale else 1.0
    crop_h, crop_w = augment.crop
    for pair in pairs:
        height, width = _scaled(pair.height, low), _scaled(pair.width, low)
        if height < crop_h or width < crop_w:
            scaled = f" ({width} x {height} at the lowest data.scale {low:g})" if low != 1.0 else ""
            raise UserError(f"{pair.image}: {pair.width} x {pair.height}{scaled} is smaller than data.crop "
                            f"{crop_w} x {crop_h} (width x height); state data.pad: true (pads the image with the "
                            "mean pixel and the mask with ignore_index, as DeepLabV3 and MMSegmentation do) or a "
                            "smaller crop")


def check_window(pairs: list[Pair], evaluation: Any, pad: bool) -> None:
    """`evaluation.mode: slide` without data.pad: every evaluation image holds the window."""
    if evaluation.mode != "slide" or pad:
        return
    crop_h, crop_w = evaluation.crop
    for pair in pairs:
        if pair.height < crop_h or pair.width < crop_w:
            raise UserError(f"{pair.image}: {pair.width} x {pair.height} is smaller than evaluation.crop {crop_w} x "
                            f"{crop_h} (width x height, mode slide); give a smaller evaluation.crop, or data.pad: true "
                            "(a smaller image is then one window of its own size, as MMSegmentation slides)")


def read_split(root: Path, field: str, layout: str | None, split: str,
               masks: str = VOC_MASKS) -> tuple[str, list[Pair]]:
    layout = layout or find_layout(root, field, masks)
    if not root.is_dir():
        raise UserError(f"{field}: {root}: no such folder (expected the {layout} layout)")
    if layout == "voc" and not (root / masks).is_dir():
        raise UserError(f"{field}: {root}: no mask folder {masks}/ (the voc layout: JPEGImages/, {masks}/, "
                        "ImageSets/Segmentation/)")
    if layout == "voc":
        return layout, voc_pairs(root, split, masks)
    if layout == "cityscapes":
        return layout, [_pair(image, mask) for image, mask in cityscapes_files(root, split)]
    return layout, folder_pairs(root, split if split_folders(root) else None)


def build_segmentation(recipe: Any) -> dict:
    spec = recipe.data
    classes, ignore = spec.classes, recipe.ignore_index
    root = Path(spec.path)
    layout, train_pairs = read_split(root, "data.path", spec.layout, spec.split or "train", spec.masks or VOC_MASKS)
    augment = Augment(True, tuple(spec.crop), tuple(spec.scale) if spec.scale else None, spec.flips, spec.pads,
                      ignore, spec.loss_pixels == "all")
    check_crop(train_pairs, augment)
    check_masks(train_pairs, classes, ignore)
    data: dict = {"train": SegmentationData(train_pairs, augment)}
    eval_root = Path(spec.eval_path) if spec.eval_path is not None else None
    eval_split = spec.eval_split or "val"
    if eval_root is None and ((layout == "voc" and (spec.eval_split or (root / VOC_LISTS / "val.txt").is_file()))
                              or (layout == "images-masks" and split_folders(root))
                              or (layout == "cityscapes" and (root / CITY_IMAGES / eval_split).is_dir())):
        eval_root = root
    if eval_root is not None:
        _, eval_pairs = read_split(eval_root, "data.eval_path", layout, eval_split)
        check_masks(eval_pairs, classes, ignore)
        check_window(eval_pairs, recipe.evaluation, spec.pads)
        data["eval"] = SegmentationData(eval_pairs, Augment(False, ignore_index=ignore))
    data["info"] = {
        "name": spec.name or root.name, "format": "segmentation", "layout": layout, "path": str(root),
        "eval_path": str(eval_root) if eval_root else None, "classes": classes, "channels": 3,
        "images": len(train_pairs), "eval_images": len(data["eval"]) if "eval" in data else None,
        "crop": list(spec.crop), "scale": list(spec.scale) if spec.scale else None, "flip": spec.flips,
        "pad": spec.pads, "ignore_index": ignore, "masks": spec.masks, "loss_pixels": spec.loss_pixels or "valid",
    }
    return data
