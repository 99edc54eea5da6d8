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
    if not timed and way_timed(plan, result):  # the way the run groups its windows, timed in whole steps
        step = result.ways["ways"][result.ways["chosen"]]["step_seconds"]  # type: ignore[index]
        timed = [(plan.micro_batch, step / plan.accumulation_steps)]
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


def way_timed(plan: Plan, result: ProbeResult) -> bool:
    """Whether the plan's cost is its way's whole optimizer steps timed after the probe (throughput/ways.py: the
    plan's data.packing, at its micro-batch and per-process batch), rather than the probe's trials."""
    ways = result.ways
    return (ways is not None and ways["chosen"] == (plan.recipe.data.packing or "none")
            and (ways["samples_per_step"], ways["micro_batch"]) == (plan.per_rank_batch, plan.micro_batch))


def costs_json(costs: dict[str, Cost | None]) -> dict:
    return {policy: (c.to_json() if c else None) for policy, c in costs.items()}


def cost_lines(plan: Plan, result: ProbeResult) -> list[str]:
    """What the plan costs on the probed device, one line per policy."""
    costs = plan_costs(plan, result)
    if all(c is None for c in costs.values()):
        why = "the estimate meter runs no real step" if result.meter == "estimate" else "no step was timed"
        return [f"cost: not measured ({why}); probe with `meter` cuda or cpu for step times"]
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
            + (f"; timed as the run groups its windows ({plan.recipe.data.packing}: whole optimizer steps, the least "
               f"of {result.ways['passes']} passes)" if policy == plan.policy and not plan.throughput
               and way_timed(plan, result) else "")  # type: ignore[index]
        )
    return lines
