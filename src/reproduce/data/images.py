"""`format: imagefolder`: the ImageNet layout (one sub-folder per class), read with torchvision's `ImageFolder`.
`augment: imagenet` is the reference ResNet recipes' (RandomResizedCrop and a flip; evaluation resized to
image_size / 0.875 and centre-cropped), `none` a resize; for one channel the mean and std are ImageNet's averages.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from torchvision import transforms  # data.sources imports this module only for image data
from torchvision.datasets import ImageFolder

from ..errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875  # resize to image_size / 0.875, then centre-crop image_size (256 -> 224)


def transforms_for(augment: str, image_size: int, channels: int, train: bool) -> Any:
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (
        (sum(IMAGENET_MEAN) / 3,) * channels, (sum(IMAGENET_STD) / 3,) * channels)
    if augment == "imagenet" and train:
        steps = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    elif augment == "imagenet":
        steps = [transforms.Resize(round(image_size / EVAL_CROP_FRACTION)), transforms.CenterCrop(image_size)]
    else:
        steps = [transforms.Resize((image_size, image_size))]
    return transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(mean, std)])


def open_image(path: str, mode: str) -> Any:
    """An image file as a PIL image of `mode` (RGB or L); a file that is not an image is the user's error."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert(mode)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise UserError(f"{path}: cannot read as an image: {exc}") from None


class ImageFolderData(ImageFolder):
    """`ImageFolder` with a given class list (the training folder's: a class missing from evaluation shifts none)."""

    def __init__(self, root: str, classes: list[str], **kwargs: Any):
        self.fixed_classes = classes
        super().__init__(root, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        return list(self.fixed_classes), {name: index for index, name in enumerate(self.fixed_classes)}


def image_folder(root: Path, field: str, augment: str, image_size: int, channels: int, train: bool,
                 classes: list[str] | None = None) -> ImageFolderData:
    if not root.exists():
        raise UserError(f"{field}: {root}: no such folder (expected one sub-folder of images per class)")
    if not root.is_dir():
        raise UserError(f"{field}: {root}: is a file; expected a folder with one sub-folder of images per class")
    found = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    if not found:
        raise UserError(f"{field}: {root}: no class sub-folders; expected one sub-folder of images per class "
                        "(the ImageNet layout: train/n01440764/*.JPEG, ...)")
    if classes is not None:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise UserError(f"{field}: {root}: class folder {unknown[0]!r} is not among the training data's "
                            f"{len(classes)} classes")
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise UserError(f"data.channels: images are read with 1 (greyscale) or 3 (RGB) channels (got {channels})")
    try:
        return ImageFolderData(str(root), classes if classes is not None else found,
                               transform=transforms_for(augment, image_size, channels, train),
                               loader=functools.partial(open_image, mode=mode), allow_empty=classes is not None)
    except FileNotFoundError as exc:
        raise UserError(f"{field}: {root}: no image files in its class folders ({exc})") from None


def build_imagefolder(recipe: Any) -> dict:
    spec = recipe.data
    augment, channels = spec.augment or "imagenet", spec.channels or 3
    train_root = Path(spec.path)
    train = image_folder(train_root, "data.path", augment, spec.image_size, channels, train=True)
    if spec.classes is not None and spec.classes != len(train.classes):
        raise UserError(f"data.classes: the recipe says {spec.classes}, but {train_root} has {len(train.classes)} "
                        "class folders")
    data: dict = {"train": train}
    if spec.eval_path is not None:
        data["eval"] = image_folder(Path(spec.eval_path), "data.eval_path", augment, spec.image_size, channels,
                                    train=False, classes=list(train.classes))
    data["info"] = {
        "name": spec.name or train_root.name, "format": "imagefolder", "path": str(train_root),
        "eval_path": spec.eval_path, "classes": len(train.classes), "images": len(train),
        "eval_images": len(data["eval"]) if "eval" in data else None, "image_size": spec.image_size,
        "channels": channels, "augment": augment,
    }
    return data
