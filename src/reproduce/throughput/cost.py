"""What a plan costs on the probed device, from the step times its trials measured. No torch.

A micro-step of size m takes t(m) seconds: interpolated between the two measured sizes around m (or
scaled in proportion from the nearest one). An optimizer step is N micro-steps on each of the W
processes at once: N x t(m) seconds, ignoring the gradient all-reduce between processes. From it:
samples (and tokens) per second, and the wall time of the whole schedule. For a plan: `plan --json`'s `cost`, the
cost lines of `plan` and `probe` (values and lines to show; nothing printed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan.planner import Plan
    from ..probe.runner import ProbeResult


@dataclass(frozen=True)
class Cost:
    micro_batch: int
    accumulation_steps: int
    micro_step_seconds: float
    step_seconds: float  # one optimizer step: N micro-steps
    samples_per_second: float
    tokens_per_second: float | None
    optimizer_steps: int | None
    total_seconds: float | None  # the whole schedule, on this device


def micro_step_seconds(timings: Iterable[tuple[int, float]], micro_batch: int) -> float | None:
    """t(micro_batch) from measured (size, seconds) pairs; None when nothing was timed."""
    points = sorted({size: seconds for size, seconds in timings if seconds}.items())
    if not points:
        return None
    below = [p for p in points if p[0] <= micro_batch]
    above = [p for p in points if p[0] >= micro_batch]
    if below and above:
        (b0, t0), (b1, t1) = below[-1], above[0]
        if b0 == b1:
            return t0
        return t0 + (t1 - t0) * (micro_batch - b0) / (b1 - b0)
    size, seconds = (below or above)[-1 if below else 0]
    return seconds * micro_batch / size


def cost(
    timings: Iterable[tuple[int, float]],
    micro_batch: int,
    accumulation_steps: int,
    effective_batch: int,
    sequence_length: int | None,
    optimizer_steps: int | None,
) -> Cost | None:
    micro = micro_step_seconds(timings, micro_batch)
    if micro is None:
        return None
    step = accumulation_steps * micro
    samples = effective_batch / step
    return Cost(
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        micro_step_seconds=micro,
        step_seconds=step,
        samples_per_second=samples,
        tokens_per_second=samples * sequence_length if sequence_length else None,
        optimizer_steps=optimizer_steps,
        total_seconds=step * optimizer_steps if optimizer_steps is not None else None,
    )


def format_duration(seconds: float) -> str:
    """3.2 s, 4 min 10 s, 2 h 05 min, 3 d 4 h."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


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
            timed or timings,
            plan.micro_batch,
            plan.accumulation_steps,
            plan.effective_batch,
            seq,
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
    return (
        ways is not None
        and ways["chosen"] == (plan.recipe.data.packing or "none")
        and (ways["samples_per_step"], ways["micro_batch"]) == (plan.per_rank_batch, plan.micro_batch)
    )


def costs_json(costs: dict[str, Cost | None]) -> dict:
    return {policy: (asdict(c) if c else None) for policy, c in costs.items()}


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
            f"; {c.optimizer_steps:,} steps: {format_duration(c.total_seconds)}"
            if c.total_seconds is not None
            else "; total unknown (the number of steps needs the dataset size)"
        )
        lines.append(
            f"cost on {result.device} ({policy}, {c.micro_batch} x {c.accumulation_steps}): {c.step_seconds:.3g} s "
            f"per optimizer step ({c.accumulation_steps} x {c.micro_step_seconds:.3g} s), {rate}{total}"
            + (
                f"; timed as the run groups its windows ({plan.recipe.data.packing}: whole optimizer steps, the least "
                f"of {result.ways['passes']} passes)"
                if policy == plan.policy and not plan.throughput and way_timed(plan, result)
                else ""
            )  # type: ignore[index]
        )
    return lines
