"""How a segmentation model sees the evaluation images (`evaluation.mode`, `evaluation.output_stride`).

- `whole`: each image at its own size through the model (torchvision's reference evaluation).
- `slide`: MMSegmentation's `slide_inference` (mmseg/models/segmentors/encoder_decoder.py): windows of
  `evaluation.crop` every `evaluation.stride` pixels, the last window of a row or column moved back to end at the
  image's edge, and each pixel's logits the mean over the windows that cover it. An image smaller than the window
  is one window of the image's own size, as MMSeg's `min(y1 + crop, height)` gives it.
- `output_stride`: the same weights at another output stride (DeepLabV3 trains at 16 and evaluates at 8, sec. 4.1):
  the model built again at that stride (ResNet's dilation, ASPP's rates; no tensor changes shape) and given the
  trained model's state dict, for the evaluation only.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.segmentation import output_of


def slide_logits(model: nn.Module, images: torch.Tensor, crop: tuple[int, int], stride: tuple[int, int]) -> dict:
    """The logits of `images` (B x C x H x W) as MMSeg's slide inference averages them over the windows."""
    height, width = images.shape[-2:]
    crop_h, crop_w = crop
    stride_h, stride_w = stride
    rows = max(height - crop_h + stride_h - 1, 0) // stride_h + 1
    columns = max(width - crop_w + stride_w - 1, 0) // stride_w + 1
    total, count = None, images.new_zeros((1, 1, height, width))
    for row in range(rows):
        for column in range(columns):
            bottom, right = min(row * stride_h + crop_h, height), min(column * stride_w + crop_w, width)
            top, left = max(bottom - crop_h, 0), max(right - crop_w, 0)
            logits = output_of(model(images[..., top:bottom, left:right]))
            if total is None:
                total = images.new_zeros((images.shape[0], logits.shape[1], height, width))
            total[..., top:bottom, left:right] += logits
            count[..., top:bottom, left:right] += 1
    return {"out": total / count}


def model_at_stride(setup, stride: int) -> nn.Module:
    """The run's model at output stride `stride` for evaluation: built again (random state kept: torch's generator
    is forked) and loaded with the trained model's state dict, in its mode, on its device and dtype."""
    from ..models import build_model, place
    from ..plan.overlay import variant

    recipe = setup.plan.recipe
    at_stride = variant(recipe, {"model.output_stride": stride, "model.weights": None, "model.backbone_weights": None})
    with torch.random.fork_rng(devices=[setup.device] if setup.device.type == "cuda" else []):
        model = place(build_model(at_stride, setup.data.info), recipe, setup.device, setup.dtype)
    model.load_state_dict(setup.unwrapped_model.state_dict())
    return model.train(setup.unwrapped_model.training)


def evaluation_forward(setup) -> callable:
    """The function the evaluation calls on a batch of images: the model's forward, or the sliding window's, on the
    model at the evaluation's output stride."""
    evaluation = setup.plan.recipe.evaluation
    model = setup.unwrapped_model
    if evaluation.output_stride is not None and evaluation.output_stride != (setup.plan.recipe.model.output_stride
                                                                             or 0):
        model = model_at_stride(setup, evaluation.output_stride)
        model.eval()
    if evaluation.mode == "slide":
        return lambda images: slide_logits(model, images, evaluation.crop, evaluation.stride)
    return model
