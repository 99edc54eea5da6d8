"""The paper's reported metric beside the run's final value, with its tolerance and the verdict: the reported name
matched to the run's field in one table, a paper's percentage shown as the run's fraction."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.reported import paper_scale
from .runs import RunFolder

# reported metric -> (the run's field, how the run's value becomes the reported metric: "same" or "error")
MATCHES = {
    "top1_accuracy": ("eval_accuracy", "same"),
    "accuracy": ("eval_accuracy", "same"),
    "top1_error": ("eval_accuracy", "error"),
    "error": ("eval_accuracy", "error"),
    "val_loss": ("eval_loss", "same"),
    "eval_loss": ("eval_loss", "same"),
    "test_loss": ("eval_loss", "same"),
}


@dataclass
class Verdict:
    run: str
    metric: str
    split: str | None
    reported: float  # the paper's value in the run's scale (a percentage as a fraction)
    tolerance: float | None
    field: str | None  # the run's value compared, as a formula of its field (None: the run does not measure it)
    value: float | None  # the run's final value of the reported metric (a rate as a fraction)
    step: int | None
    verdict: str  # "within tolerance", "outside tolerance", "no tolerance stated", "not measured by this run"
    note: str = ""

    @property
    def passed(self) -> bool | None:
        return {"within tolerance": True, "outside tolerance": False}.get(self.verdict)


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
        scale = paper_scale(reported.metric, reported.value)
        common = dict(run=run.name, metric=reported.metric, split=reported.split,
                      reported=round(reported.value * scale, 12),
                      tolerance=None if reported.tolerance is None else round(reported.tolerance * scale, 12))
        if final is None:
            found.append(Verdict(**common, field=None, value=None, step=None, verdict="not measured by this run",
                                 note=f"the run records no {' or '.join(candidates)}"))
            continue
        step, raw = final
        value, formula = (1.0 - raw, f"1 - {field}") if how == "error" else (raw, field)  # the reported metric
        if common["tolerance"] is None:
            verdict = "no tolerance stated"
        else:
            inside = abs(value - common["reported"]) <= common["tolerance"]
            verdict = "within tolerance" if inside else "outside tolerance"
        note = "" if run.complete else f"the run has not trained the paper's {run.plan.optimizer_steps} steps"
        found.append(Verdict(**common, field=formula, value=value, step=step, verdict=verdict, note=note))
    return found
