"""The Cityscapes layout of `format: segmentation` (`data.layout: cityscapes`, found from the folder):
`leftImg8bit/SPLIT/CITY/NAME_leftImg8bit.png` with `gtFine/SPLIT/CITY/NAME_gtFine_labelTrainIds.png`, the masks of the
19 training classes (255 void) that cityscapesscripts' `createTrainIdLabelImgs.py` writes beside the dataset's own
`*_gtFine_labelIds.png` (34 raw ids, which are not the classes a model is trained on). SPLIT is `data.split`
(default train) and `data.eval_split` (default val), as MMSegmentation's CityscapesDataset reads them.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

IMAGES, MASKS = "leftImg8bit", "gtFine"
IMAGE_SUFFIX, MASK_SUFFIX = "_leftImg8bit.png", "_gtFine_labelTrainIds.png"
RAW_SUFFIX = "_gtFine_labelIds.png"
CONVERT = ("make them with cityscapesscripts' createTrainIdLabelImgs.py (pip install cityscapesscripts; "
           "CITYSCAPES_DATASET={root} python -m cityscapesscripts.preparation.createTrainIdLabelImgs)")


def is_cityscapes(root: Path) -> bool:
    return (root / IMAGES).is_dir() and (root / MASKS).is_dir()


def cityscapes_files(root: Path, split: str) -> list[tuple[Path, Path]]:
    """The (image, labelTrainIds mask) paths of one split; a split of labelIds masks only is one line naming the
    script that converts them."""
    folder = root / IMAGES / split
    if not folder.is_dir():
        present = sorted(p.name for p in (root / IMAGES).iterdir() if p.is_dir())
        raise UserError(f"{folder}: no such split folder (found: {', '.join(present) or 'none'})")
    images = sorted(folder.rglob(f"*{IMAGE_SUFFIX}"))
    if not images:
        raise UserError(f"{folder}: no *{IMAGE_SUFFIX} images (Cityscapes: {IMAGES}/{split}/CITY/*{IMAGE_SUFFIX})")
    pairs = []
    for image in images:
        relative = image.relative_to(folder)
        stem = relative.name[: -len(IMAGE_SUFFIX)]
        mask = root / MASKS / split / relative.parent / f"{stem}{MASK_SUFFIX}"
        if not mask.is_file():
            raw = mask.with_name(f"{stem}{RAW_SUFFIX}")
            if raw.is_file():
                raise UserError(f"{raw}: Cityscapes' labelIds (34 raw ids) without its {MASK_SUFFIX[1:]} (the 19 "
                                f"training classes, 255 void); {CONVERT.format(root=root)}")
            raise UserError(f"{image}: no mask {mask}")
        pairs.append((image, mask))
    return pairs
