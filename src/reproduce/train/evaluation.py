"""Evaluation in a run: the eval split's mean loss (and accuracy), and the plateau decay stepped on it."""

from __future__ import annotations

import torch

from ..data.batches import to_device
from ..data.loader import default_workers, eval_batches
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
    workers = default_workers(dataset) if workers is None else workers
    for cpu_batch in eval_batches(dataset, batch, workers=workers, pin_memory=setup.device.type == "cuda"):
        inputs, target = to_device(cpu_batch, setup.device, setup.dtype)
        with setup.autocast():
            output = model(inputs)
        total_loss += float(setup.loss(output, target))
        total_count += setup.loss.count(target)
        if setup.plan.recipe.task == "classification":
            correct += int((output.argmax(-1) == target).sum())
    model.train(was_training)
    result = {"eval_loss": total_loss / max(total_count, 1), "eval_items": total_count}
    if setup.plan.recipe.task == "classification":
        result["eval_accuracy"] = correct / max(total_count, 1)
    return result


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
