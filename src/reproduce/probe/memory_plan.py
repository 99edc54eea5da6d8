"""The plan's own use of the memory knobs (activation checkpointing, sharded gradients), with its reasons: when
not even micro-batch 1 fits, the first way out that fits and keeps the run exact on the same hardware
(memory_ways.py), probed and explained (offload, bf16, LoRA, more GPUs stay offers); when the paper's per-device
batch fits only with checkpointing, checkpointing for BatchNorm, else the faster way (without, when untimed).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UserError
from ..plan.planner import make_plan
from ..plan.recipe import Recipe
from ..plan.split import split_text
from ..plan.units import format_size
from ..throughput.cost import cost
from .memory_ways import CHECKPOINTING, RECOMPUTE_COST, REDUCE_COST, changed_recipe, describe, plan_memory_change
from .runner import ProbeResult

Probe = Callable[[Recipe], ProbeResult]


def when_nothing_fits(recipe: Recipe, result: ProbeResult, probe: Probe) -> tuple[Recipe, ProbeResult, list[str]]:
    """The recipe with the knobs the report found to fit, probed again, and the note; else unchanged."""
    change = plan_memory_change((result.does_not_fit or {}).get("ways_out", []))
    if change is None:
        return recipe, result, []
    changed = changed_recipe(recipe, change)
    again = probe(changed)
    if again.micro_batch_max is None:
        return recipe, result, []
    needed = (result.does_not_fit or {}).get("peak_bytes")
    costs = [cost for key, cost in (("activation_checkpointing", RECOMPUTE_COST),
                                    ("sharded_gradients", REDUCE_COST))
             if change.get("model", {}).get(key) or change.get("batch", {}).get(key)]
    note = (f"memory: took {describe(change)}: without, not even micro-batch 1 fits"
            + (f" ({format_size(needed)} needed, limit {format_size(result.limit_bytes)})" if needed else "")
            + f"; with, micro-batch {again.micro_batch_max} fits (peak {format_size(again.peak_bytes)}); costs "
            + " and ".join(costs))
    return changed, again, [note]


def per_device_batch(recipe: Recipe, result: ProbeResult, probe: Probe, world_size: int
                     ) -> tuple[Recipe, ProbeResult, list[str]]:
    """Both ways when the paper's per-device batch fits only with checkpointing (see the module's notes)."""
    paper = recipe.batch.per_device
    found = result.micro_batch_max
    if (not paper or found is None or found >= paper or paper > result.cap or recipe.model.activation_checkpointing
            or recipe.batch.phases or recipe.batch.ramp):
        return recipe, result, []
    changed = changed_recipe(recipe, CHECKPOINTING)
    try:
        checkpointed = probe(changed)
    except UserError:  # (a model with nothing to checkpoint: the plan without it stands)
        return recipe, result, []
    what = "BatchNorm batch" if recipe.model.has_batchnorm else "per-device batch"
    if checkpointed.micro_batch_max is None or checkpointed.micro_batch_max < paper:
        return recipe, result, [f"memory: the paper's {what} of {paper} does not fit, with activation checkpointing "
                                f"either (largest micro-batch {checkpointed.micro_batch_max or 0})"]
    without = make_plan(recipe, found, world_size)
    with_it = make_plan(changed, paper, world_size)
    seq = recipe.batch.sequence_length
    times = {}
    for name, plan, probed in (("without", without, result), ("with", with_it, checkpointed)):
        c = cost(probed.timings(), plan.micro_batch, plan.accumulation_steps, plan.effective_batch, seq,
                 None)
        times[name] = c.step_seconds if c else None
    if recipe.model.has_batchnorm:
        take, why = "with", f"it keeps the paper's BatchNorm batch of {paper} (the statistics the paper normalised by)"
    elif None not in times.values():
        take = "with" if times["with"] < times["without"] else "without"
        why = "its optimizer step is the faster one measured"
    else:
        take, why = "without", ("no step was timed (estimate meter), and it recomputes nothing; "
                                "--activation-checkpointing takes the other")

    def line(name: str, plan) -> str:
        timed = f"{times[name]:.3g} s per optimizer step" if times[name] else "step time not measured"
        knob = "with activation checkpointing" if name == "with" else "without checkpointing"
        return f"{split_text(plan.micro_batch, plan.accumulation_steps, world_size)} {knob} ({timed})"

    notes = [f"memory: the paper's {what} of {paper} fits only with activation checkpointing: "
             f"{line('without', without)}; or {line('with', with_it)}; took {take} checkpointing: {why}"]
    return (changed, checkpointed, notes) if take == "with" else (recipe, result, notes)


def choose(recipe: Recipe, result: ProbeResult, probe: Probe, world_size: int) -> tuple[Recipe, ProbeResult, list[str]]:
    """The recipe and probe result the plan uses, and what it says about its memory knobs (see the module's notes)."""
    if result.micro_batch_max is None:
        return when_nothing_fits(recipe, result, probe)
    return per_device_batch(recipe, result, probe, world_size)
