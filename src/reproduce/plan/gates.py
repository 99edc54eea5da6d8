"""The recipe's gates in optimizer steps: when each is checked, what it watches, its bound (no torch).

`planned_gates(plan)` resolves each gate's `at` to the optimizer step after which the run checks it, walking the
segments as the schedule's lengths do (`segments.lengths_to_steps`). A gate past the run, or in epochs of data of
unknown size, is one line at `plan` time. `budget.gpu_hours` is a gate too, checked at every step from
`BUDGET_FROM` on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from ..errors import GatePaused, UserError
from .recipe import Gate, GateAt, Length, Recipe
from .segments import Segment, lengths_to_steps


class Planned(Protocol):
    """What the gates read of a plan (planner.Plan, which imports this module to check its gates)."""

    @property
    def recipe(self) -> Recipe: ...
    @property
    def segments(self) -> list[Segment]: ...
    @property
    def optimizer_steps(self) -> int | None: ...

# the exit status of a run a `pause` gate stopped (0 done, 1 stopped, 2 bad input, 3 does not fit / disk full)
EXIT_PAUSED = GatePaused.exit_code
BUDGET_GATE = "budget"
# the cost gate compares the forecast from the measured pace, which the first steps (warm-up, caches) overstate:
# checked from this step (or the run's last, when shorter)
BUDGET_FROM = 10
EVAL_PREFIX = "eval_"


@dataclass(frozen=True)
class PlannedGate:
    """A gate at the optimizer step (counted from 1) after which the run checks it."""

    index: int  # its place in the recipe's `gates:` (None-like -1: the budget's cost gate)
    step: int
    gate: Gate
    every_step: bool = False  # the cost gate: checked at every step from `step` on

    @property
    def name(self) -> str:
        return self.gate.name

    @property
    def evaluated(self) -> bool:
        """Whether its metric is the evaluation's (measured at the gate's step, evaluating there when needed)."""
        return self.gate.metric.startswith(EVAL_PREFIX)

    def line(self) -> str:
        """`gate early: loss <= 1 at step 20 (step 20), pause; source: ...`, as `plan` and `run` show it."""
        gate = self.gate
        when = f"from step {self.step}, every step" if self.every_step else (
            f"at step {self.step}" + ("" if gate.at.unit == "step" else f" ({gate.at.label()})"))
        return (f"gate {gate.name}: {gate.metric} {gate.bound_label()} {when}, {gate.action}"
                + (f"; source: {gate.source}" if gate.source else ""))


def planned_gates(plan: Planned, budget_gpu_hours: float | None = None) -> list[PlannedGate]:
    """The recipe's gates at their optimizer steps, in the order the run meets them; the cost gate last when a
    budget is given. One line for a gate the plan cannot place."""
    total = plan.optimizer_steps
    planned = []
    for index, gate in enumerate(plan.recipe.gates):
        what = f"gates.{index}.at"
        at = gate.at
        if at.unit == "fraction":
            if total is None:
                raise UserError(f"{what}: a fraction of the run, whose length in steps is unknown (set "
                                "data.train_size)")
            step = max(1, math.ceil(at.value * total - 1e-9))
        else:
            unit = {"step": "steps", "epoch": "epochs"}.get(at.unit, at.unit)
            warnings: list[str] = []
            length = Length.model_validate({unit: at.value})
            counted = lengths_to_steps(plan.segments, length, what, warnings)
            if counted is None:
                raise UserError(warnings[0] if warnings else f"{what}: cannot be counted in optimizer steps")
            step = max(1, counted)
        if total and step > total:  # (a plan of no step at all has its own warning, and checks nothing)
            which = "" if at.unit == "step" else f" is optimizer step {step},"
            raise UserError(f"{what}: {at.label()}{which} past the run's {total} optimizer steps")
        planned.append(PlannedGate(index, step, gate))
    planned.sort(key=attrgetter("step", "index"))
    if budget_gpu_hours is not None:
        if any(gate.name == BUDGET_GATE for gate in plan.recipe.gates):
            raise UserError(f"gates: the name {BUDGET_GATE!r} is the budget's cost gate's; name the gate otherwise")
        gate = Gate(name=BUDGET_GATE, at=GateAt(step=1), metric="forecast_gpu_hours", max=budget_gpu_hours,
                    action="pause", source="budget.gpu_hours")
        planned.append(PlannedGate(-1, min(BUDGET_FROM, total or BUDGET_FROM), gate, every_step=True))
    return planned


def gate_by_name(planned: list[PlannedGate], name: str, option: str) -> PlannedGate:
    """The planned gate named `name`; one line naming the gates there are otherwise."""
    for gate in planned:
        if gate.name == name:
            return gate
    names = ", ".join(gate.name for gate in planned) or "none"
    raise UserError(f"no gate named {name!r} in the recipe (its gates: {names})", field=option)


def outcome_line(event: dict[str, Any], status: bool = True) -> str:
    """The one line the run prints as a gate passes or misses: `gate early at step 20: loss 2.31 > max 1, paused`."""
    value = event["value"]
    measured = f"{event['metric']} not measured" if value is None else f"{event['metric']} {value:.5g}"
    verb = "meets" if event["status"] == "passed" else "cannot check" if value is None else "misses"
    return (f"gate {event['name']} at step {event['step']}: {measured} {verb} {event['bound']}"
            + (f": {event['status']}" if status else "")
            + (f"; source: {event['source']}" if event.get("source") else ""))
