"""The run's loss against a target: its own start (divergence) and an earlier run of the same recipe (reference).

Divergence: one warning line when the loss is not finite, or stays above `FACTOR` x its first value (step 1's,
before any update) for `STEPS` steps in a row; the run goes on unless `--stop-on-divergence`. The watch is in the
checkpoint, so a resume compares with the run's first loss. Reference: `--reference RUN_DIR` (or `reference.runs`),
runs of the recipe at any micro-batch (the batch is exact, so curves agree up to rounding): at each of their logged
steps the metric is compared with their mean within `reference.band` (absolute or `relative`) or `reference.spread`
x their seed spread; the first step outside is an event like a gate's (`name: reference`, `warn` or `pause`), and
summary.json's `reference` counts the steps compared and outside.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import yaml

from ..errors import UserError
from ..plan.recipe import Gate, GateAt, Recipe, Reference
from .outputs import read_metrics

REFERENCE_GATE = "reference"


class ReferenceCurve:
    """The reference runs' curve, and this run's comparison with it so far."""

    def __init__(self, spec: Reference, runs: list[str], recipe: Recipe):
        if spec.band is None and len(runs) < 2:
            raise UserError("reference.band: one reference run gives no seed spread; give reference.band (the "
                            "largest difference allowed) or two reference runs or more of other seeds")
        self.spec, self.runs = spec, runs
        curves = []
        for run in runs:  # each an earlier run of the same batch (its plan.yaml's), its metric by optimizer step
            folder = Path(run)
            if not (folder / "plan.yaml").is_file():
                raise UserError(f"{folder}: no plan.yaml (the folder of an earlier `reproduce run`)", field="reference")
            saved = (yaml.safe_load((folder / "plan.yaml").read_text(encoding="utf-8")) or {}).get("recipe", {})
            effective = saved.get("batch", {}).get("effective")
            if effective != recipe.batch.effective:
                raise UserError(f"{folder} ran effective batch {effective}, this recipe {recipe.batch.effective}: a "
                                "reference is a run of the same recipe", field="reference")
            if not (folder / "metrics.jsonl").is_file():
                raise UserError(f"{folder}: no metrics.jsonl (the folder of an earlier `reproduce run`)",
                                field="reference")
            curves.append({int(r["step"]): float(r[spec.metric]) for r in read_metrics(folder / "metrics.jsonl")
                           if "event" not in r and isinstance(r.get(spec.metric), (int, float)) and "step" in r})
        common = sorted(set.intersection(*(set(curve) for curve in curves)))
        if not common:
            raise UserError(f"{', '.join(runs)}: no step logged {spec.metric} in every reference run",
                            field="reference")
        self.steps = common[::spec.every]
        self.mean = {step: statistics.fmean(curve[step] for curve in curves) for step in common}
        self.band = {step: self._band(step, [curve[step] for curve in curves]) for step in common}
        self.values: dict[int, float] = {}  # this run's, at the reference's steps
        self.compared, self.outside, self.worst, self.first_outside = 0, 0, 0.0, None
        self.gate = Gate(name=REFERENCE_GATE, at=GateAt(step=1), metric=spec.metric, max=0.0,
                         action=spec.action, source=f"reference runs {', '.join(runs)}")

    def _band(self, step: int, values: list[float]) -> float:
        if self.spec.band is not None:
            return self.spec.band * (abs(self.mean[step]) if self.spec.relative else 1.0)
        return self.spec.spread * statistics.stdev(values)

    def check(self, step: int, record: dict) -> dict | None:
        """After optimizer step `step`: compare at a reference step; the event of the first step outside the band."""
        value = record.get(self.spec.metric)
        if isinstance(value, (int, float)):
            self.values[step] = float(value)
        if step not in self.steps or step not in self.values:
            return None
        own = [self.values[s] for s in sorted(self.values) if s <= step][-self.spec.smooth:]
        theirs = [self.mean[s] for s in sorted(self.mean) if s <= step][-self.spec.smooth:]
        mine, reference, band = statistics.fmean(own), statistics.fmean(theirs), self.band[step]
        difference = abs(mine - reference)
        self.compared += 1
        self.worst = max(self.worst, difference / band if band > 0 else float("inf") if difference else 0.0)
        if difference <= band:
            return None
        self.outside += 1
        if self.first_outside is not None:
            return None
        self.first_outside = step
        return {"event": "gate", "step": step, "name": REFERENCE_GATE, "metric": self.spec.metric,
                "value": round(mine, 8), "bound": f"within {band:.4g} of the reference's {reference:.5g}",
                "action": self.spec.action, "status": "warned" if self.spec.action == "warn" else "paused",
                "source": self.gate.source}

    def state_dict(self) -> dict:
        return {"values": {str(k): v for k, v in self.values.items()}, "compared": self.compared,
                "outside": self.outside, "worst": self.worst, "first_outside": self.first_outside}

    def load_state_dict(self, state: dict) -> None:
        self.values = {int(k): v for k, v in state.get("values", {}).items()}
        self.compared, self.outside = state.get("compared", 0), state.get("outside", 0)
        self.worst, self.first_outside = state.get("worst", 0.0), state.get("first_outside")

    def summary(self) -> dict:
        """summary.json's `reference`: the runs, the band's source, the steps compared and outside it."""
        return {"runs": self.runs, "metric": self.spec.metric,
                "band": (f"{self.spec.band:g}" + (" x the reference's value" if self.spec.relative else "")
                         if self.spec.band is not None else f"{self.spec.spread:g} x the seed spread of "
                         f"{len(self.runs)} runs"),
                "compared": self.compared, "outside": self.outside, "first_outside": self.first_outside,
                "worst": round(self.worst, 6) if self.worst != float("inf") else None,
                "within": self.outside == 0}


def reference_curve(recipe: Recipe, runs: tuple[str, ...]) -> ReferenceCurve | None:
    """`runs` (`--reference`) or the recipe's `reference.runs`, compared as its `reference:` says; None without."""
    spec = recipe.reference or Reference()
    chosen = list(runs) or list(spec.runs)
    if not chosen:
        return None
    return ReferenceCurve(spec, chosen, recipe)


FACTOR = 2.0  # the loss at twice its starting value ...
STEPS = 10  # ... for this many optimizer steps in a row


class DivergenceWatch:
    """Each step's loss in; a warning (once per run) out when the run diverges."""

    def __init__(self, factor: float = FACTOR, steps: int = STEPS):
        self.factor, self.steps = factor, steps
        self.first_loss: float | None = None
        self.above = 0  # steps in a row above factor x first_loss
        self.diverged: dict | None = None  # {"step", "reason"} once it has

    def update(self, step: int, loss: float) -> str | None:
        """`step`: 1-based optimizer step. The warning text the first time the run diverges, else None."""
        if self.diverged is not None:
            return None
        if not math.isfinite(loss):
            return self._diverge(step, f"the loss is not finite ({loss}) at optimizer step {step}")
        if self.first_loss is None:
            self.first_loss = loss
            return None
        self.above = self.above + 1 if loss > self.factor * self.first_loss else 0
        if self.above >= self.steps:
            return self._diverge(
                step, f"the loss has stayed above {self.factor:g}x its first value ({self.first_loss:.4g}) for "
                f"{self.steps} optimizer steps, up to {loss:.4g} at step {step}")
        return None

    def _diverge(self, step: int, reason: str) -> str:
        self.diverged = {"step": step, "reason": reason}
        return f"the run is diverging: {reason}"

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "above": self.above, "diverged": self.diverged}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss, self.above, self.diverged = state.get("first_loss"), state.get("above", 0), state.get(
            "diverged")

    @classmethod
    def from_records(cls, records: list[dict]) -> DivergenceWatch:
        """The watch as it stood after the steps in metrics.jsonl (for a checkpoint that holds no watch state)."""
        watch = cls()
        for record in records:
            if "loss" in record and "step" in record:
                watch.update(record["step"], record["loss"])
        return watch
