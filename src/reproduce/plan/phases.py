"""A batch that changes during training: `batch.phases` and `batch.ramp` planned as segments (segments.py).

Pure Python, no torch. Phases (BERT: 90% of the steps at 128 tokens, then 512) are one segment each; a ramp (GPT-3:
the batch grows linearly from 32k tokens) is one segment per distinct batch, each step's batch rounded down to
`batch.ramp.granularity` (default one sequence per process; never above the target), then one at the target. The
granularity never depends on the micro-batch: a process's share that is not a multiple of it ends with a smaller
micro-batch (the window's loss is normalised over all of it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..errors import UserError
from .overlay import phase_recipe
from .recipe import Length, Recipe
from .recipe.schedule import Decay, Warmup
from .schedules import StepSchedule
from .segments import MicroBatchMax, Segment, epoch_steps, lengths_to_steps, micro_batch_cap, own_steps, size_at
from .split import Choice, SplitPolicy, split

# ---- planning ----------------------------------------------------------------------------------------------


def plan_phases(
    recipe: Recipe,
    micro_batch_max: MicroBatchMax,
    world_size: int,
    dataset_size: int | None,
    sizes: Mapping[int | None, int] | None,
    policy: SplitPolicy,
    target: Choice,
    warnings: list[str],
) -> list[Segment]:
    """The segments of `recipe.batch.phases` or `.ramp` (empty without either), each split by the policy's rule.

    `micro_batch_max` and `sizes` may be per sequence length; `dataset_size` is the samples at the recipe's own
    length; `target` is the main batch's split (the ramp's last segment)."""
    batch = recipe.batch
    if not batch.phases and not batch.ramp:
        return []
    drop_last = recipe.data.drop_last

    def cap_at(length: int | None) -> int:
        if isinstance(micro_batch_max, Mapping):
            return micro_batch_max.get(length, micro_batch_max[batch.sequence_length])
        return micro_batch_max

    def segment(kind: Literal["phase", "ramp", "whole"], start: int, steps: int | None, choice: Any,
                paper: int | None, length: int | None, cap: int, exact: bool | None) -> Segment:
        size = size_at(length, recipe, dataset_size, sizes)
        per_epoch, _ = epoch_steps(size, choice.effective_batch, world_size, drop_last)
        return Segment(
            kind=kind, start_step=start, steps=steps, micro_batch_max=cap, micro_batch=choice.micro_batch,
            accumulation_steps=choice.accumulation_steps, effective_batch=choice.effective_batch,
            paper_effective_batch=paper, sequence_length=length, exact=exact, lr_factor=choice.lr_factor,
            dataset_size=size, steps_per_epoch=per_epoch,
        )

    segments: list[Segment] = []
    if batch.phases:
        start = 0
        for index, phase in enumerate(batch.phases):
            length = phase.sequence_length or batch.sequence_length
            paper = batch.phase_sequences(phase)
            if world_size > paper:
                raise UserError(f"{world_size} processes exceed batch.phases[{index}]'s batch of "
                                f"{paper} {batch.count_unit}: each process needs at least one", field="world_size")
            cap = cap_at(length)
            choice = split(phase_recipe(recipe, paper, length), micro_batch_cap(cap, paper, world_size), world_size,
                           policy)
            placed = segment("phase", start, None, choice, paper, length, cap, choice.exact)
            if index < len(batch.phases) - 1:
                steps = own_steps(phase, placed, f"batch.phases[{index}]")
                if steps == 0:
                    warnings.append(f"batch.phases[{index}] ({phase.label()}) is shorter than one optimizer step of "
                                    f"{placed.effective_batch}: it never runs")
                placed = placed.model_copy(update={"steps": steps})
                start += steps
            if not choice.exact:
                warnings.append(
                    f"batch.phases[{index}]: effective batch {choice.effective_batch} is not the paper's {paper} "
                    f"(x{choice.effective_batch / paper:.4g}): its LR x{choice.lr_factor:.4g}")
            segments.append(placed)
        return segments
    return _ramp(recipe, target, cap_at(batch.sequence_length), world_size, segment, warnings)


def _ramp(recipe: Recipe, target: Choice, cap: int, world_size: int, segment: Any,
          warnings: list[str]) -> list[Segment]:
    """One segment per distinct batch of the ramp, then the target batch to the end."""
    batch, ramp = recipe.batch, recipe.batch.ramp
    assert ramp is not None  # (plan_phases calls it for a ramp)
    length = batch.sequence_length
    final = batch.sequences
    given = ramp.granularity  # by default one sequence per process; never the micro-batch: the same ramp anywhere
    grain = world_size if given is None else given // batch.token_length if batch.unit == "tokens" else given
    if grain % world_size:
        raise UserError(f"{world_size} processes cannot share batch.ramp.granularity's {grain} "
                        f"{batch.count_unit} equally; use a world size that divides it", field="world_size")
    start = ramp.start // batch.token_length if batch.unit == "tokens" else ramp.start
    last = segment("phase", 0, None, target, final, length, cap, target.exact)
    if not target.exact:
        warnings.append(f"batch.ramp: the ramp ends at this plan's batch {target.effective_batch}, not the paper's "
                        f"{final}")
    if grain >= target.effective_batch:
        warnings.append(f"batch.ramp: not followed: its granularity of {grain} {batch.count_unit} is already the "
                        f"whole batch of {target.effective_batch}")
        return [last]
    if start >= target.effective_batch:  # this plan's batch fell to the ramp's start or below (not exact)
        warnings.append(f"batch.ramp: not followed: it starts at {start} {batch.count_unit}, not below this plan's "
                        f"batch of {target.effective_batch}")
        return [last]
    if start < grain:
        warnings.append(f"batch.ramp.start: {start} {batch.count_unit} is less than the ramp's granularity of "
                        f"{grain} {batch.count_unit}: the ramp starts at {grain}")
    unit, value = ramp.length.unit, ramp.length.value
    if unit == "epochs":
        if last.dataset_size is None:  # (the target's segment: the samples at the recipe's own length)
            raise UserError("batch.ramp.length: counted in epochs, but the dataset size is unknown (set "
                            "data.train_size)")
        value, unit = value * last.dataset_size, "samples"
    elif unit == "tokens":
        value, unit = value / batch.token_length, "samples"
    target_batch = target.effective_batch

    def batch_at(position: float) -> int:
        """The step's batch once `position` (samples read, or steps taken) of the ramp's `value` is behind."""
        wanted = start + (target_batch - start) * position / value
        return min(target_batch, max(grain, int(wanted // grain) * grain))

    # Each distinct batch at once (not step by step: a long ramp of small batches would take millions of steps):
    # steps of batch b go on while the position is below the one where the ramp's value reaches b + grain.
    segments, steps, read = [], 0, 0
    while (steps if unit == "steps" else read) < value:
        position = steps if unit == "steps" else read
        effective = batch_at(position)
        stride = 1 if unit == "steps" else effective  # how far one step moves the position
        limit = min(value, value * (effective + grain - start) / (target_batch - start))
        count = max(1, math.ceil((limit - position) / stride))
        while count > 1 and batch_at(position + (count - 1) * stride) != effective:  # float rounding at the edge
            count -= 1
        while position + count * stride < value and batch_at(position + count * stride) == effective:
            count += 1
        share = effective // world_size  # each process's; above the micro-batch, the last micro-batch is smaller
        micro = min(target.micro_batch, share)
        # micro-batches of the target's size (one smaller when the share is below it, or the last one smaller when
        # the share is not a multiple of it), at the target's LR factor
        choice = target.model_copy(update={"micro_batch": micro, "accumulation_steps": -(-share // micro),
                                           "effective_batch": effective, "exact": False})
        segments.append(segment("ramp", steps, count, choice, None, length, cap, None))
        steps, read = steps + count, read + count * effective
    return [*segments, last.model_copy(update={"start_step": steps})]


# ---- planning the phases' own schedules ---------------------------------------------------------------------


def attach_phase_schedules(recipe: Recipe, phases: list[Segment], total: int | None, warnings: list[str],
                           source: str | None = None, first_warmup: int = 0) -> list[Segment]:
    """`phases` with each phase's own schedule (`batch.phases[i].lr / warmup / decay`) planned into its steps;
    errors name `source` (the recipe's file). `first_warmup`: the recipe's own warm-up, in steps."""
    specs = recipe.batch.phases or []
    if not any(spec.has_schedule for spec in specs):
        return phases
    starts = [phase.start_step for spec, phase in zip(specs, phases, strict=True) if spec.has_schedule]
    if first_warmup > starts[0]:
        first = next(index for index, spec in enumerate(specs) if spec.has_schedule)
        warnings.append(f"schedule.warmup: {first_warmup} steps, but batch.phases[{first}] starts its own schedule at "
                        f"step {starts[0] + 1}: the recipe's warm-up never reaches its peak")
    result = list(phases)
    for index, (spec, phase) in enumerate(zip(specs, phases, strict=True)):
        if not spec.has_schedule:
            continue
        what = f"{source}: batch.phases[{index}]" if source else f"batch.phases[{index}]"
        later = [start for start in starts if start > phase.start_step]
        end = later[0] if later else total
        if end is None:
            raise UserError(f"{what}: its own schedule needs the run's length in optimizer steps, which is unknown "
                            "(set data.train_size)")
        if end <= phase.start_step:
            raise UserError(f"{what}: its own schedule has no length to run over: the phase starts at step "
                            f"{phase.start_step + 1}, but " + (f"the run ends after {end} optimizer steps" if not later
                                                               else f"the next schedule starts at step {end + 1}"))
        peak = (spec.lr if spec.lr is not None else recipe.optimizer.lr) * phase.lr_factor
        # no decay given: the recipe's kind and its final LR, over the phase's own schedule
        decay = spec.decay or recipe.schedule.decay.model_copy(update={"until": None, "milestones": None})

        def to_step(length: Length, name: str, phase: Segment = phase) -> int:  # a length in the phase's own units
            return phase.start_step + own_steps(length, phase, name)

        schedule = step_schedule(phase.start_step, end, peak, phase.lr_factor, spec.warmup, decay, end, f"{what}.",
                                 to_step)
        if schedule.warmup_steps > end - phase.start_step:
            warnings.append(f"{what}.warmup: {schedule.warmup_steps} steps, longer than the {end - phase.start_step} "
                            "steps its schedule runs")
        if spec.decay is None and recipe.schedule.decay.kind == "step":
            raise UserError(f"{what}.decay: required: the recipe's step decay counts its milestones from the run's "
                            "start; give the phase's own (e.g. {kind: step, milestones: {steps: [...]}})")
        result[index] = phase.model_copy(update={"schedule": schedule})
    return result


def phase_lines(segments: list[Segment], world_size: int, unit: str) -> list[str]:
    """The batch phases in a few lines: each phase's steps and split; a ramp as its first and last batches (none for
    a plan without batch phases)."""
    lines, ramp = [], [phase for phase in segments if phase.kind == "ramp"]
    if ramp:
        lines.append(f"batch ramp: steps 1-{ramp[-1].end_step}, {len(ramp)} batches from {ramp[0].effective_batch} "
                     f"to {ramp[-1].effective_batch} {unit} (micro {ramp[0].micro_batch} x accumulation "
                     f"{ramp[0].accumulation_steps} to {ramp[-1].accumulation_steps})")
    for phase in segments:
        if phase.kind == "phase":
            end = phase.end_step if phase.end_step is not None else "end"
            length = f" of {phase.sequence_length} tokens" if phase.sequence_length else ""
            lines.append(f"batch phase: steps {phase.start_step + 1}-{end}: micro {phase.micro_batch} x accumulation "
                         f"{phase.accumulation_steps} x world {world_size} = {phase.effective_batch} "
                         f"{'sequences' if length else unit}{length}")
    return lines


def step_schedule(start: int, end: int | None, peak: float, factor: float, warmup: Warmup | None, decay: Decay,
                  decay_end: int | None, what: str, to_step: Callable[[Length, str], int]) -> StepSchedule:
    """A schedule from optimizer step `start` to `end` at its `peak` LR (the LR rule's `factor` included): its
    lengths (`what` + warmup, decay.milestones, decay.until) become the run's steps by `to_step`, its decay ends at
    `decay_end` without decay.until, and its warm-up's start LR and minimum LR follow from the peak."""
    warmup_steps, start_lr = 0, 0.0
    if warmup is not None:
        warmup_steps = ((round(warmup.ratio * (end - start)) if end is not None else 0) if warmup.ratio is not None
                        else to_step(warmup, f"{what}warmup") - start)
        start_lr = warmup.start_lr if warmup.start_lr is not None else (warmup.start_factor or 0.0) * peak
    milestones = [to_step(Length.model_validate({decay.milestones.unit: value}), f"{what}decay.milestones")
                  for value in decay.milestones.values] if decay.milestones is not None else []
    if decay.until is not None:
        decay_end = to_step(decay.until, f"{what}decay.until")
    min_lr = decay.min_lr * factor if decay.min_lr is not None else (decay.min_ratio or 0.0) * peak
    return StepSchedule(start_step=start, end_step=end, lr=peak, warmup_steps=warmup_steps, warmup_start_lr=start_lr,
                        decay_kind=decay.kind, decay_milestones=milestones, decay_factor=decay.factor,
                        decay_end_step=decay_end, min_lr=min_lr, power=decay.power)


MOST_STEPS = 10**9  # a value past this is a typo (epochs: 1e18), never a run


def schedule_in_steps(recipe: Recipe, recipe_path: str | None, chosen: Choice, segments: list[Segment],
                      phases: list[Segment], steps_per_epoch: int | None,
                      warnings: list[str]) -> tuple[StepSchedule, list[Segment]]:
    """The recipe's schedule from step 0, every length of `schedule` (total, warm-up, milestones, end of decay) in
    optimizer steps over `segments`; and `phases` with each phase's own schedule (`attach_phase_schedules`)."""

    def steps(length: Length, what: str) -> int:
        value = lengths_to_steps(segments, length, what, warnings)
        if value is None:
            raise UserError(f"{recipe_path or 'recipe'}: data.train_size: required: {what} is counted in epochs, and "
                            "the plan needs the training samples per epoch to count its optimizer steps (or plan the "
                            "run with its data)")
        return value

    total = steps(recipe.schedule.total, "schedule.total")
    if total == 0 and (recipe.schedule.total.unit != "epochs" or steps_per_epoch):  # (an epoch of no step: warned)
        one_step = f"{chosen.effective_batch} {recipe.batch.count_unit}"
        if recipe.batch.sequence_length:
            one_step += f" ({chosen.effective_batch * recipe.batch.sequence_length:,} tokens)"
        if recipe.schedule.total.unit == "epochs" and steps_per_epoch:
            one_step += f"; an epoch is {steps_per_epoch} optimizer steps"
        raise UserError(f"schedule.total: {recipe.schedule.total.label()} is less than one optimizer step, which reads "
                        f"{one_step}: the run would take 0 optimizer steps; give a longer total")
    # the recipe's schedule decays until a batch phase starts its own, else to the end of the run
    own_start = next((phase.start_step for spec, phase in zip(recipe.batch.phases or [], phases, strict=False)
                      if spec.has_schedule), None)
    schedule = step_schedule(0, total, chosen.lr, chosen.lr_factor, recipe.schedule.warmup, recipe.schedule.decay,
                             total if own_start is None else own_start, "schedule.", steps)
    if total is not None and schedule.warmup_steps > total:
        warnings.append(f"warm-up ({schedule.warmup_steps} steps) is longer than the whole run ({total} steps)")
    if phases:
        phases = attach_phase_schedules(recipe, phases, total, warnings, recipe_path, schedule.warmup_steps)
    if total is not None and total > MOST_STEPS:
        raise UserError(f"{recipe_path}: schedule.total: {total:.3g} optimizer steps; no run takes more than "
                        f"{MOST_STEPS:.0e} (at a millisecond a step, {MOST_STEPS / 1000 / 86400:.0f} days)")
    return schedule, phases

