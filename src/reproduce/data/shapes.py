"""The shapes of the datasets the papers use, so a recipe whose data is not on this machine can still be probed.

Keyed by `data.name` (case and separators forgiven); a recipe's own `data.channels`, `data.image_size` and
`data.classes` take precedence. No torch here.
"""

from __future__ import annotations

# name -> (channels, image size, classes), with where each figure comes from
IMAGE_DATASETS: dict[str, tuple[int, int, int]] = {
    # ILSVRC-2012 (Russakovsky et al. 2015): 1000 classes, 1,281,167 training images; the papers here train on
    # random 224 x 224 RGB crops (He et al. 2016 sec. 3.4, Goyal et al. 2017, ViT, DeiT, MAE).
    "imagenet-1k": (3, 224, 1000),
    # ImageNet-21k as ViT pre-trains on it (Dosovitskiy et al. 2021 sec. 4.1: "21k classes and 14M images";
    # google-research/vision_transformer's num_classes 21843), at resolution 224 (Table 3).
    "imagenet-21k": (3, 224, 21843),
}
ALIASES = {"imagenet": "imagenet-1k", "ilsvrc2012": "imagenet-1k", "ilsvrc-2012": "imagenet-1k",
           "imagenet1k": "imagenet-1k", "imagenet21k": "imagenet-21k", "imagenet-22k": "imagenet-21k"}


def image_dataset(name: str | None) -> dict | None:
    """{"channels", "image_size", "classes"} of a known image dataset, or None."""
    if not name:
        return None
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in IMAGE_DATASETS:
        return None
    channels, size, classes = IMAGE_DATASETS[key]
    return {"channels": channels, "image_size": size, "classes": classes}
