"""The paper's reported metric beside the run's final value, with its tolerance and the verdict.

Papers report `top1_accuracy` / `top1_error` in percent, `val_loss`, ...; runs record `eval_accuracy` as a
fraction and `eval_loss`. The reported name is matched to the run's field here, in one table.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runs import RunFolder

# reported metric -> (the run's field, how the run's value becomes the paper's: "percent", "error %", "same")
MATCHES = {
    "top1_accuracy": ("eval_accuracy", "percent"),
    "accuracy": ("eval_accuracy", "percent"),
    "top1_error": ("eval_accuracy", "error %"),
    "error": ("eval_accuracy", "error %"),
    "val_loss": ("eval_loss", "same"),
    "eval_loss": ("eval_loss", "same"),
    "test_loss": ("eval_loss", "same"),
}


@dataclass
class Verdict:
    run: str
    metric: str
    split: str | None
    reported: float
    tolerance: float | None
    field: str | None  # the run's value compared, as a formula of its field (None: the run does not measure it)
    value: float | None  # the run's final value, in the paper's unit
    step: int | None
    verdict: str  # "within tolerance", "outside tolerance", "no tolerance stated", "not measured by this run"
    note: str = ""

    @property
    def passed(self) -> bool | None:
        return {"within tolerance": True, "outside tolerance": False}.get(self.verdict)


def convert(value: float, how: str, reported: float, field: str) -> tuple[float, str]:
    """The run's value in the paper's unit (percent when the paper's number is one: above 1), and the formula."""
    scale, times = (100.0, "100 x ") if reported > 1.0 else (1.0, "")
    if how == "error %":
        return (1.0 - value) * scale, f"{times}(1 - {field})"
    if how == "percent":
        return value * scale, f"{times}{field}"
    return value, field


def verdicts(run: RunFolder) -> list[Verdict]:
    found = []
    for reported in run.plan.recipe.reported:
        field, how = MATCHES.get(reported.metric, (None, "same"))
        candidates = [field] if field else [f"eval_{reported.metric}", reported.metric]
        final = None
        for candidate in candidates:
            final = run.final(candidate)
            if final is not None:
                field = candidate
                break
        common = dict(run=run.name, metric=reported.metric, split=reported.split, reported=reported.value,
                      tolerance=reported.tolerance)
        if final is None:
            found.append(Verdict(**common, field=None, value=None, step=None, verdict="not measured by this run",
                                 note=f"the run records no {' or '.join(candidates)}"))
            continue
        step, raw = final
        value, formula = convert(raw, how, reported.value, field)
        if reported.tolerance is None:
            verdict = "no tolerance stated"
        else:
            verdict = "within tolerance" if abs(value - reported.value) <= reported.tolerance else "outside tolerance"
        note = "" if run.complete else f"the run has not trained the paper's {run.plan.optimizer_steps} steps"
        found.append(Verdict(**common, field=formula, value=value, step=step, verdict=verdict, note=note))
    return found
