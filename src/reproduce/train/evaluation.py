"""Evaluation in a run: the eval split's mean loss (and accuracy; segmentation: mIoU and pixel accuracy), and the
plateau decay stepped on it."""

from __future__ import annotations

from typing import Any

import torch

from ..data.batches import to_device
from ..data.loader import default_workers, eval_batches
from ..models.segmentation import output_of
from .plateau import step_plateau
from .setup import Setup


@torch.no_grad()
def evaluate(setup: Setup, batch: int | None = None, workers: int | None = None) -> dict | None:
    """Mean loss (and accuracy) over the eval split, in batches of `batch` (default: the micro-batch), fetched
    by `workers` loader processes (default: `data.loader.default_workers`)."""
    dataset = setup.data.get("eval")
    if dataset is None or len(dataset) == 0:
        return None
    model = setup.core
    was_training = model.training
    model.eval()
    total_loss, total_count, correct = 0.0, 0, 0
    batch = max(batch or setup.plan.micro_batch, 1)
    task = setup.plan.recipe.task
    pixels = PixelMetrics(setup) if task == "segmentation" else None
    if getattr(dataset, "sizes_differ", False):  # images of several sizes, each at its own: one at a time
        batch = 1
    workers = default_workers(dataset) if workers is None else workers
    for cpu_batch in eval_batches(dataset, batch, workers=workers, pin_memory=setup.device.type == "cuda"):
        inputs, target = to_device(cpu_batch, setup.device, setup.dtype)
        with setup.autocast():
            output = model(inputs)
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
    """mIoU and pixel accuracy over the whole eval split, as MMSegmentation reports them: one confusion matrix
    summed over every batch (torchmetrics' MulticlassJaccardIndex, average "macro": the mean IoU of the classes
    present in the targets or predictions; pixels at ignore_index excluded), not a mean of per-image scores.

    The split is evaluated whole on each evaluating rank (rank 0; under FSDP every rank, each the whole split), so
    the matrix is the split's with no reduction over ranks (sync_on_compute off: the other ranks are not here).
    """

    def __init__(self, setup: Setup):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

        recipe = setup.plan.recipe
        classes, ignore = recipe.data.classes, recipe.ignore_index
        self.iou = MulticlassJaccardIndex(classes, ignore_index=ignore, average="macro", sync_on_compute=False)
        self.accuracy = MulticlassAccuracy(classes, ignore_index=ignore, average="micro", sync_on_compute=False)
        self.iou, self.accuracy = self.iou.to(setup.device), self.accuracy.to(setup.device)

    def update(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output_of(output)
        predicted = logits.argmax(1)
        self.iou.update(predicted, target)
        self.accuracy.update(predicted, target)
        return logits

    def compute(self) -> dict:
        return {"eval_miou": float(self.iou.compute()), "eval_pixel_accuracy": float(self.accuracy.compute())}


def evaluation_due(setup: Setup, step: int, done: bool) -> bool:
    """Whether the run evaluates after optimizer step `step` (counted from 1): every `evaluation.every_steps`,
    and at the end when `evaluation.at_end`."""
    evaluation = setup.plan.recipe.evaluation
    return bool((evaluation.every_steps and step % evaluation.every_steps == 0) or (done and evaluation.at_end))


def evaluate_step(setup: Setup, step: int, micro_batch: int, workers: int | None, main: bool) -> dict:
    """The metrics record's fields of an evaluation after optimizer step `step` (counted from 1): the eval
    split's (rank 0 alone, or every rank of a sharded model, whose forward needs them all) and the plateau decay's
    (plateau.py: the LR of the steps after it)."""
    fields: dict = {}
    evaluation = None
    if main or setup.sharded:
        evaluation = evaluate(setup, micro_batch, workers)
        if evaluation:
            fields.update(evaluation)
    fields.update(step_plateau(setup, evaluation, step))
    return fields
