"""The run's result beside the paper's: a recipe's `reported` values matched with what the run evaluated. No torch.

A reported metric is compared only when the run measured the same thing on the same split: the paper's
validation split (`val`, `validation`, `dev`, or none stated) and a metric the run computes
(recipe.REPORTED_METRICS by task). Accuracy is a fraction everywhere a user reads it (0.9306); a recipe's rate above
1 is the paper's percentage, carried here as a fraction with its tolerance (`as_written` keeps the recipe's)."""

from __future__ import annotations

from typing import Any

from .recipe import Recipe, Reported

EVAL_SPLITS = (None, "val", "valid", "validation", "dev", "eval")


# reported metrics that are rates (accuracy, error, IoU): fractions in the run, usually percentages in a paper
RATES = ("top1_accuracy", "accuracy", "eval_accuracy", "top1_error", "error", "miou", "pixel_accuracy", "eval_miou",
         "eval_pixel_accuracy")


def paper_scale(metric: str, value: float) -> float:
    """What a reported value is multiplied by to be in the run's scale: 1/100 for a rate written as a percentage."""
    return 0.01 if metric in RATES and value > 1 else 1.0


# reported metric -> (the run's metric, its label); top1_error is the complement of the run's accuracy
METRICS: dict[str, tuple[str, str]] = {
    "val_loss": ("eval_loss", "eval loss"),
    "eval_loss": ("eval_loss", "eval loss"),
    "loss": ("eval_loss", "eval loss"),
    "top1_accuracy": ("eval_accuracy", "eval top-1 accuracy"),
    "accuracy": ("eval_accuracy", "eval accuracy"),
    "eval_accuracy": ("eval_accuracy", "eval accuracy"),
    "top1_error": ("eval_accuracy", "eval top-1 error"),
    "miou": ("eval_miou", "eval mIoU"),
    "pixel_accuracy": ("eval_pixel_accuracy", "eval pixel accuracy"),
    "eval_miou": ("eval_miou", "eval mIoU"),
    "eval_pixel_accuracy": ("eval_pixel_accuracy", "eval pixel accuracy"),
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
        key, label = known
        run = 1 - final[key] if reported.metric == "top1_error" else final[key]
        scale = paper_scale(reported.metric, reported.value)
        tolerance = None if reported.tolerance is None else round(reported.tolerance * scale, 12)
        rows.append({"metric": reported.metric, "split": reported.split, "paper": round(reported.value * scale, 12),
                     "as_written": as_written(reported, scale), "run_metric": key, "label": label,
                     "run": run, "step": step, "planned_steps": planned_steps, "tolerance": tolerance})
    return rows


def as_written(reported: Reported, scale: float) -> str | None:
    """The recipe's own figure (`23.74 +- 0.09`) when the row shows it in another scale, else None."""
    if scale == 1.0:
        return None
    return f"{reported.value:g}" + (f" +- {reported.tolerance:g}" if reported.tolerance else "")


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
    written = row.get("as_written")  # a percentage in the recipe: as the paper printed it, beside the fraction
    percent = f" ({written}%)" if written else ""
    return (f"{row['label']} {row['run']:.4g}; the paper reports {row['metric']} {row['paper']:g}{tolerance}{percent}"
            f"{split}{at}; {where}")
