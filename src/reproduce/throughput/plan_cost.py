"""What a plan costs on the probed device (`plan --json`'s `cost`, the cost lines of `plan` and `probe`), from the
step times the probe's trials measured (throughput/cost.py). Values and lines to show; nothing printed, no torch."""

from __future__ import annotations

from ..plan.planner import Plan
from ..probe.runner import ProbeResult
from .cost import Cost, cost, format_duration


def plan_costs(plan: Plan, result: ProbeResult) -> dict[str, Cost | None]:
    """The plan's cost, and its alternative's when it has one, keyed by policy."""
    seq, timings = plan.recipe.batch.sequence_length, result.timings()
    candidates = plan.throughput.candidates if plan.throughput else []
    timed = [(c.micro_batch, c.micro_step_seconds) for c in candidates if c.repeats]
    costs = {  # --policy throughput: its whole optimizer steps' medians, not the probe's trials
        plan.policy: cost(
            timed or timings, plan.micro_batch, plan.accumulation_steps, plan.effective_batch, seq,
            plan.optimizer_steps,
        )
    }
    alt = plan.alternative
    if alt is not None:
        steps = None
        if plan.optimizer_steps is not None:  # the same data, in steps of the other batch
            steps = round(plan.optimizer_steps * plan.effective_batch / alt.effective_batch)
        costs[alt.policy] = cost(timings, alt.micro_batch, alt.accumulation_steps, alt.effective_batch, seq, steps)
    return costs


def costs_json(costs: dict[str, Cost | None]) -> dict:
    return {policy: (c.to_json() if c else None) for policy, c in costs.items()}


def cost_lines(plan: Plan, result: ProbeResult) -> list[str]:
    """What the plan costs on the probed device, one line per policy."""
    costs = plan_costs(plan, result)
    if all(c is None for c in costs.values()):
        why = "the estimate meter runs no real step" if result.meter == "estimate" else "no step was timed"
        return [f"cost: not measured ({why}); probe with --meter cuda or cpu for step times"]
    unit = plan.unit
    lines = []
    for policy, c in costs.items():
        if c is None:
            continue
        rate = f"{c.samples_per_second:,.0f} {unit}/s" + (
            f" ({c.tokens_per_second:,.0f} tokens/s)" if c.tokens_per_second else ""
        )
        total = (
            f"; {c.optimizer_steps:,} steps: {format_duration(c.total_seconds)}" if c.total_seconds is not None
            else "; total unknown (the number of steps needs the dataset size)"
        )
        lines.append(
            f"cost on {result.device} ({policy}, {c.micro_batch} x {c.accumulation_steps}): {c.step_seconds:.3g} s "
            f"per optimizer step ({c.accumulation_steps} x {c.micro_step_seconds:.3g} s), {rate}{total}"
        )
    return lines
