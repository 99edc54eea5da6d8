"""Evaluation in a run: the eval split's mean loss (and accuracy; segmentation: mIoU, pixel accuracy), and
the plateau decay stepped on it. A segmentation model sees the images (`evaluation.mode`, `output_stride`):
- `whole`: each image at its own size (torchvision's reference evaluation);
- `slide`: MMSegmentation's `slide_inference`: windows of `crop` every `stride` pixels, the last of a row or column
  moved back to the image's edge, each pixel's logits the mean over its windows; a smaller image is one window;
- `output_stride`: the same weights rebuilt at another stride (DeepLabV3 trains at 16, evaluates at 8, sec. 4.1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import build_data
from ..data.batches import to_device
from ..data.loader import default_workers, eval_batches
from ..errors import UserError
from ..models import build_model, place
from ..models.segmentation import output_of
from ..plan.overlay import Change, overlay, variant
from ..plan.planfile import load_plan
from .setup import Setup, build, resolve_device


@torch.no_grad()
def evaluate(setup: Setup, batch: int | None = None, workers: int | None = None) -> dict | None:
    """Mean loss (and accuracy) over the eval split, in batches of `batch` (default: the micro-batch)."""
    dataset = setup.data.eval
    if dataset is None or len(dataset) == 0:
        return None
    model = setup.unwrapped_model
    was_training = model.training
    model.eval()
    total_loss, total_count, correct = 0.0, 0, 0
    batch = max(batch or setup.plan.micro_batch, 1)
    task = setup.plan.recipe.task
    pixels = PixelMetrics(setup) if task == "segmentation" else None
    if getattr(dataset, "sizes_differ", False):  # images of several sizes, each at its own: one at a time
        batch = 1
    workers = default_workers(dataset) if workers is None else workers
    # segmentation: whole images or MMSeg's sliding window, at the evaluation's output stride (evaluation_forward)
    forward = evaluation_forward(setup) if pixels is not None else model
    for cpu_batch in eval_batches(dataset, batch, workers=workers, pin_memory=setup.device.type == "cuda"):
        inputs, target = to_device(cpu_batch, setup.device, setup.dtype)
        with setup.autocast():
            output = forward(inputs)
        if pixels is not None:
            output = pixels.update(output, target)  # the main head's logits: its loss alone is the eval loss
        total_loss += float(setup.loss(output, target))
        total_count += setup.loss.count(target)
        if task == "classification":
            correct += int((output.argmax(-1) == target).sum())
    model.train(was_training)
    result = {"eval_loss": total_loss / max(total_count, 1), "eval_items": total_count}
    if task == "classification":
        result["eval_accuracy"] = correct / max(total_count, 1)
    if pixels is not None:
        result.update(pixels.compute())
    return result


class PixelMetrics:
    """mIoU, per-class IoU and pixel accuracy as MMSegmentation reports them: one confusion matrix
    summed over the whole split (ignore_index excluded), not a mean of per-image scores; a class absent from both
    predictions and targets has no IoU (None) and is left out of the mean (MMSeg's nanmean). Each evaluating rank
    evaluates the whole split, so the matrix is not reduced over ranks."""

    def __init__(self, setup: Setup):
        from torchmetrics.classification import MulticlassConfusionMatrix

        recipe = setup.plan.recipe
        classes, ignore = recipe.data.classes, recipe.ignore_index
        self.matrix = MulticlassConfusionMatrix(classes, ignore_index=ignore, sync_on_compute=False).to(setup.device)

    def update(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output_of(output)
        self.matrix.update(logits.argmax(1), target)
        return logits

    def compute(self) -> dict:
        """eval_miou, eval_pixel_accuracy and eval_class_iou of the confusion matrix (rows: targets)."""
        matrix = self.matrix.compute().double()
        hits = matrix.diagonal()
        union = matrix.sum(0) + matrix.sum(1) - hits
        ious = [float(h / u) if u > 0 else None for h, u in zip(hits.tolist(), union.tolist(), strict=True)]
        present = [iou for iou in ious if iou is not None]
        total = float(matrix.sum())
        return {"eval_miou": sum(present) / len(present) if present else 0.0,
                "eval_pixel_accuracy": float(hits.sum()) / total if total else 0.0, "eval_class_iou": ious}


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
    """The run's model rebuilt at output stride `stride` (torch's generator forked) with the trained
    state dict, in its mode, device and dtype."""
    recipe = setup.plan.recipe
    at_stride = variant(recipe, {"model.output_stride": stride, "model.weights": None, "model.backbone_weights": None})
    with torch.random.fork_rng(devices=[setup.device] if setup.device.type == "cuda" else []):
        model = place(build_model(at_stride, setup.data.info), recipe, setup.device, setup.dtype)
    model.load_state_dict(setup.unwrapped_model.state_dict())
    return model.train(setup.unwrapped_model.training)


def evaluation_forward(setup) -> callable:
    """The evaluation's forward: the model's, or the sliding window's, at the evaluation's
    stride."""
    evaluation = setup.plan.recipe.evaluation
    model = setup.unwrapped_model
    if evaluation.output_stride is not None and evaluation.output_stride != (setup.plan.recipe.model.output_stride
                                                                             or 0):
        model = model_at_stride(setup, evaluation.output_stride)
        model.eval()
    if evaluation.mode == "slide":
        return lambda images: slide_logits(model, images, evaluation.crop, evaluation.stride)
    return model


def evaluation_due(setup: Setup, step: int, done: bool) -> bool:
    """Whether the run evaluates after step `step` (from 1): every `every_steps`, and at the end."""
    evaluation = setup.plan.recipe.evaluation
    return bool((evaluation.every_steps and step % evaluation.every_steps == 0) or (done and evaluation.at_end))


def evaluate_after(run: Any, step: int) -> dict:
    """The eval split's metrics after step `step` (from 0), in that step's micro-batches: on rank 0, or every rank
    of a sharded model; {} on the other ranks and without evaluation data."""
    if not (run.world.is_main or run.setup.sharded):
        return {}
    return evaluate(run.setup, run.micro_batch(max(step, 0)), run.workers) or {}


def evaluate_run(run_dir: Path, data_path: str | None = None, eval_data_path: str | None = None,
                 device: str = "auto", workers: int | None = None) -> dict:
    """A finished run's model.pt evaluated again on its evaluation data (or `--data` / `--eval-data`),
    its plan.yaml's recipe and micro-batch, so the metrics are the run's; a folder or recipe that lacks one is one
    line."""
    for name in ("plan.yaml", "model.pt"):
        if not (run_dir / name).is_file():
            raise UserError(f"RUN_DIR: {run_dir} has no {name} (the folder of a finished `reproduce run`)")
    plan = load_plan(run_dir / "plan.yaml")
    source = str(run_dir / "plan.yaml")
    changes = [Change("model.backbone_weights", None), Change("model.weights", str(run_dir / "model.pt")),
               *(Change(path, value, f"`{path}`") for path, value in (("data.path", data_path),
                                                                      ("data.eval_path", eval_data_path))
                 if value is not None)]  # (named by the flag the user typed: cli/options.py)
    recipe = overlay(plan.recipe, changes, source)
    data = build_data(recipe)
    if data.eval is None or len(data.eval) == 0:
        raise UserError(f"{source}: the run's recipe has no evaluation data (data.eval_path, or a voc folder's "
                        "val list): give `eval_data_path` PATH")
    setup = build(plan, resolve_device(device), data=data, recipe=recipe)
    return evaluate(setup, workers=workers) or {}
