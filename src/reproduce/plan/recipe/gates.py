"""The recipe's `gates:` and `reference:` sections: targets set before the run, checked while it runs.

A gate says when (`at`: a step, an epoch, a fraction of the run, samples or tokens), what (`metric`), the bound
(`max`, `min`, or both), where the bound comes from (`source`: the paper's `[P]` figure, a reference run, the user)
and what a miss does (`action`: `warn` or `pause`):

    gates: [{name: early, at: {step: 20}, metric: loss, max: 1.0, action: pause}]"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .common import OneUnit, Strict

# every task's metrics a gate can watch besides the evaluation's (recipe.PLATEAU_METRICS by task)
RUN_METRICS = ("loss", "samples_per_second", "tokens_per_second", "gpu_hours", "forecast_gpu_hours")
AT_UNITS = ("step", "epoch", "fraction", "samples", "tokens")
_PLURALS = {"steps": "step", "epochs": "epoch", "fractions": "fraction"}
GATE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class GateAt(OneUnit):
    """When a gate is checked: after exactly one of these (an optimizer step counted from 1, an epoch, a fraction
    of the planned run, samples or tokens of training data seen)."""

    step: int | None = Field(default=None, ge=1)
    epoch: float | None = Field(default=None, gt=0)
    fraction: float | None = Field(default=None, gt=0, le=1)
    samples: int | None = Field(default=None, ge=1)
    tokens: int | None = Field(default=None, ge=1)

    UNITS: ClassVar[tuple[str, ...]] = AT_UNITS

    @model_validator(mode="before")
    @classmethod
    def _plurals(cls, value: Any) -> Any:
        """`steps: 20` and `epochs: 5` read as `step` and `epoch` (the schedule's lengths are plural)."""
        if isinstance(value, dict):
            value = {_PLURALS.get(key, key) if isinstance(key, str) and _PLURALS.get(key) not in value else key: item
                     for key, item in value.items()}
        return value

    def label(self) -> str:
        return f"{self.unit} {self.value:g}"


class Gate(Strict):
    name: str = Field(description="the gate's name: its checkpoint is "
                      "checkpoints/gate-NAME.pt, `--accept-gate NAME` and `--resume --from NAME` name it")
    at: GateAt
    metric: str = Field(description="loss (the training loss, smoothed over `smooth` steps), an evaluation metric "
                        "(eval_loss, eval_accuracy, eval_error, eval_miou, ...), samples_per_second, "
                        "tokens_per_second, gpu_hours (spent so far), forecast_gpu_hours (the whole run at the "
                        "measured pace)")
    max: float | None = Field(default=None, description="the metric must be at most this")
    min: float | None = Field(default=None, description="the metric must be at least this")
    action: Literal["warn", "pause"] = Field(default="pause", description="what a miss does: warn (one line, the "
                                             "run goes on) or pause (checkpoint, one line, exit status 4)")
    source: str | None = Field(default=None, description="where the bound comes from: the paper's figure with its "
                               "[P] mark, a reference run, the user")
    smooth: int = Field(default=10, ge=1, description="loss: the mean of the training loss over the last K steps")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.match(GATE_NAME, name) or len(name) > 64:
            raise ValueError(f"expected letters, digits, '_', '-' or '.', at most 64, starting with a letter or digit "
                             f"(got {name!r}): the name is the gate's checkpoint file's")
        return name

    @model_validator(mode="after")
    def _bound(self) -> Gate:
        if self.max is None and self.min is None:
            raise ValueError("give max (the metric must be at most), min (at least), or both (a band)")
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}")
        return self

    def bound_label(self) -> str:
        if self.max is not None and self.min is not None:
            return f"within [{self.min:.10g}, {self.max:.10g}]"
        return f"<= {self.max:.10g}" if self.max is not None else f">= {self.min:.10g}"

    def holds(self, value: float) -> bool:
        return (self.max is None or value <= self.max) and (self.min is None or value >= self.min)


class Reference(Strict):
    """`reference:`: earlier runs of the same recipe whose curve this run must follow (`--reference RUN_DIR`)."""

    runs: list[str] = Field(default=[], description="run folders (their metrics.jsonl), any machine, any "
                            "micro-batch; `reproduce run --reference RUN_DIR` gives them instead")
    metric: Literal["loss", "eval_loss"] = "loss"
    band: float | None = Field(default=None, gt=0, description="the largest difference allowed at each of the "
                               "reference's logged steps; none: `spread` x the reference runs' seed spread (two "
                               "runs or more)")
    relative: bool = Field(default=False, description="band as a fraction of the reference's value")
    spread: float = Field(default=3.0, gt=0, description="without band: the band is this many times the reference "
                          "runs' largest standard deviation at a step")
    smooth: int = Field(default=1, ge=1, description="compare the mean of the last K steps' values, each side")
    action: Literal["warn", "pause"] = "warn"
    every: int = Field(default=1, ge=1, description="compare at every K-th of the reference's logged steps")

    @model_validator(mode="before")
    @classmethod
    def _one_run(cls, value: Any) -> Any:
        """`reference: {runs: runs/a}`, a single folder, reads as a list of one."""
        if isinstance(value, dict) and isinstance(value.get("runs"), str):
            value = {**value, "runs": [value["runs"]]}
        return value

    @model_validator(mode="after")
    def _band_source(self) -> Reference:
        if self.band is None and len(self.runs) == 1:
            raise ValueError("runs: one reference run gives no seed spread; give band (the largest difference "
                             "allowed), or two or more runs of other seeds")
        return self


def gates_problem(gates: list[Gate], task: str, plateau_metrics: tuple[str, ...]) -> str | None:
    """The first problem of the recipe's gates as a whole (names given twice, a metric the task does not measure)."""
    known, seen = (*RUN_METRICS, *plateau_metrics), set()  # the metrics a gate of a run of `task` can watch
    for index, gate in enumerate(gates):
        if gate.name in seen:
            return f"gates.{index}.name: {gate.name!r} names two gates; each gate's name is its checkpoint's"
        seen.add(gate.name)
        if gate.metric not in known:
            return (f"gates.{index}.metric: unknown metric {gate.metric!r} for task {task}; expected one of "
                    f"{', '.join(known)}")
    return None
