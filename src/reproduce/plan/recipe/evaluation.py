"""The recipe's `evaluation:` and `reported:` sections, and the metrics each task evaluates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import Sides, Strict


class Reported(Strict):
    metric: str
    value: float
    split: str | None = None
    tolerance: float | None = Field(default=None, ge=0)
    notes: str | None = None
    evaluated: bool = Field(
        default=True, description="false: a figure the run does not measure (a downstream benchmark, BLEU after "
        "generation), kept as documentation; true: one of the metrics the task evaluates, compared with the run's")


LOSS_METRICS = ("val_loss", "eval_loss", "loss")
# The `reported:` metrics the run evaluates, by task (reported.py puts them beside the run's values)
REPORTED_METRICS = {
    "classification": (*LOSS_METRICS, "top1_accuracy", "accuracy", "top1_error", "eval_accuracy"),
    "language-modeling": LOSS_METRICS,
    "custom": LOSS_METRICS,
    "segmentation": (*LOSS_METRICS, "miou", "pixel_accuracy", "eval_miou", "eval_pixel_accuracy"),
}


# The evaluation metrics a plateau decay can watch, by task (train/evaluation.evaluate; eval_error = 1 - eval_accuracy)
PLATEAU_METRICS = {
    "classification": ("eval_loss", "eval_accuracy", "eval_error"),
    "language-modeling": ("eval_loss",),
    "custom": ("eval_loss",),
    "segmentation": ("eval_loss", "eval_miou", "eval_pixel_accuracy"),
}


class Evaluation(Strict):
    every_steps: int | None = Field(default=None, gt=0, description="evaluate every K optimizer steps")
    at_end: bool = True
    # segmentation (docs/segmentation.md): how the evaluation images go through the model, as MMSegmentation's
    # test_cfg says (mode='whole' | 'slide', crop_size, stride), and at which output stride (DeepLabV3: 8)
    mode: Literal["whole", "slide"] = Field(
        default="whole", description="segmentation: whole (each image at its size) or slide (MMSegmentation's "
        "sliding window: crops of `crop` every `stride` pixels, the overlapping logits averaged)")
    crop: Sides = Field(default=None, description="slide: the window, [height, width] or one side")
    stride: Sides = Field(default=None, description="slide: the step between windows, [height, "
                                           "width] or one side")
    output_stride: Literal[8, 16] | None = Field(
        default=None, description="segmentation built-ins: evaluate at this output stride (DeepLabV3 trains at 16, "
        "evaluates at 8, sec. 4.1); the same weights, ResNet's dilation and ASPP's rates set for it")

    @model_validator(mode="after")
    def _slide(self) -> Evaluation:
        if self.mode == "slide" and (self.crop is None or self.stride is None):
            raise ValueError("mode: slide needs crop and stride (MMSegmentation's test_cfg crop_size and stride, "
                             "[height, width] or one side)")
        if self.mode == "whole" and (self.crop is not None or self.stride is not None):
            raise ValueError("crop, stride: only used with mode: slide")
        if self.crop is not None and min(self.crop) <= 0 or self.stride is not None and min(self.stride) <= 0:
            raise ValueError("crop, stride: height and width must be > 0")
        return self
