"""The run's result beside the paper's: a recipe's `reported` values matched with what the run evaluated.

A reported metric is compared only when the run measured the same thing on the same split: the evaluation
data is the paper's validation split (`val`, `validation`, `dev`, or no split stated), and the metric is one the
run computes (its eval loss, or its eval accuracy as top-1 accuracy or error, or segmentation's mIoU and pixel
accuracy, in the paper's scale; recipe.REPORTED_METRICS by task). No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .recipe import Recipe

EVAL_SPLITS = (None, "val", "valid", "validation", "dev", "eval")


def _percent_or_fraction(paper: float, fraction: float) -> float:
    """A fraction in the paper's scale: percent when the paper's value is above 1."""
    return fraction * 100 if paper > 1 else fraction


# reported metric -> (the run's metric, its label, the run's value in the paper's scale)
METRICS: dict[str, tuple[str, str, Callable[[float, float], float]]] = {
    "val_loss": ("eval_loss", "eval loss", lambda paper, value: value),
    "eval_loss": ("eval_loss", "eval loss", lambda paper, value: value),
    "loss": ("eval_loss", "eval loss", lambda paper, value: value),
    "top1_accuracy": ("eval_accuracy", "eval top-1 accuracy", _percent_or_fraction),
    "accuracy": ("eval_accuracy", "eval accuracy", _percent_or_fraction),
    "eval_accuracy": ("eval_accuracy", "eval accuracy", _percent_or_fraction),
    "top1_error": ("eval_accuracy", "eval top-1 error", lambda paper, value: _percent_or_fraction(paper, 1 - value)),
    "miou": ("eval_miou", "eval mIoU", _percent_or_fraction),
    "pixel_accuracy": ("eval_pixel_accuracy", "eval pixel accuracy", _percent_or_fraction),
    "eval_miou": ("eval_miou", "eval mIoU", _percent_or_fraction),
    "eval_pixel_accuracy": ("eval_pixel_accuracy", "eval pixel accuracy", _percent_or_fraction),
}


def compare_reported(recipe: Recipe, final: dict[str, Any], step: int, planned_steps: int | None
                     ) -> list[dict[str, Any]]:
    """Each `reported` value the run can be put beside: the paper's value, the run's, and where the run stopped."""
    rows = []
    for reported in recipe.reported:
        known = METRICS.get(reported.metric)
        split = reported.split.lower() if reported.split else None
        if known is None or not reported.evaluated or split not in EVAL_SPLITS or known[0] not in final:
            continue
        key, label, scale = known
        rows.append({"metric": reported.metric, "split": reported.split, "paper": reported.value,
                     "run_metric": key, "label": label, "run": scale(reported.value, final[key]), "step": step,
                     "planned_steps": planned_steps, "tolerance": reported.tolerance})
    return rows


def reported_line(row: dict[str, Any]) -> str:
    """`eval loss 1.89; the paper reports 1.47 at step 5000; this run stopped at step 40 of 5000`, and for a run
    that ran all its steps against a value with a tolerance, whether it lands within it."""
    planned, step = row["planned_steps"], row["step"]
    at = f" at step {planned}" if planned else ""
    tolerance = f" +- {row['tolerance']:g}" if row.get("tolerance") else ""
    stopped = bool(planned and step < planned)
    where = f"this run stopped at step {step} of {planned}" if stopped else f"this run ran all {step} steps"
    if row.get("tolerance") and not stopped:
        inside = abs(row["run"] - row["paper"]) <= row["tolerance"]
        where += f": {'within' if inside else 'outside'} the paper's tolerance"
    split = f" on {row['split']}" if row["split"] else ""
    return (f"{row['label']} {row['run']:.4g}; the paper reports {row['metric']} {row['paper']:g}{tolerance}{split}"
            f"{at}; {where}")
