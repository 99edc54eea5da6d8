"""A batch that changes during training: `batch.phases` and `batch.ramp` as a timeline of optimizer steps.

Pure Python, no torch. The planner turns the recipe's phases (BERT: 90% of the steps at 128 tokens, then 512) or
ramp (GPT-3: the batch grows linearly from 32k tokens) into `PlanPhase` segments: consecutive optimizer steps with
one micro-batch m, accumulation N and effective batch m x N x W each, and one sequence length. A ramp becomes one
segment per distinct batch: each step's batch is the ramp's value rounded down to the ramp's granularity (the
recipe's `batch.ramp.granularity`, by default one sequence per process; at least one grain, never above the target),
and a last segment at the target. The granularity never depends on the micro-batch, so neither does the ramp: a
process's share of a ramp step below the micro-batch runs as one smaller micro-batch, and a share that is not a
multiple of it ends with a smaller one (the window's loss is normalised over all of it either way).

Lengths (the phases', the schedule's warm-up, milestones and total) become optimizer steps by walking the segments:
a segment of n steps covers n x E samples (E x L tokens, n / steps-per-epoch epochs, n x E / B of the paper's own
steps of batch B; during a ramp a step is this plan's step). So a schedule counted in tokens stays exact while the
batch grows, and the learning-rate schedule continues across the phases.

The data: each sequence length has its own stream through its own dataset (the same data cut at that length),
epoch after epoch; a segment continues the stream of its length where the last segment of that length left it, so
a ramp reads the data once, in order, whatever its batches. `stream_window` says where step s reads.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from .errors import UserError
from .recipe import Length, Recipe, phase_recipe
from .schedules import StepSchedule

if TYPE_CHECKING:
    from .planner import Plan


class PlanPhase(BaseModel):
    """Consecutive optimizer steps with one batch: what `reproduce run` switches to at `start_step`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["phase", "ramp"]
    start_step: int
    steps: int | None = None  # None: to the end of the run (the last segment)
    micro_batch_max: int
    micro_batch: int
    accumulation_steps: int
    effective_batch: int  # samples (sequences) per optimizer step
    paper_effective_batch: int | None  # None during a ramp: the paper's batch grows continuously there
    sequence_length: int | None
    exact: bool | None  # None during a ramp: its batches are the ramp's values rounded to whole micro-batches
    lr_factor: float
    dataset_size: int | None
    steps_per_epoch: int | None
    schedule: StepSchedule | None = None  # its own LR schedule (batch.phases[i].lr / warmup / decay): schedules.py

    @property
    def end_step(self) -> int | None:
        return None if self.steps is None else self.start_step + self.steps

    def arithmetic(self, world_size: int) -> str:
        micro, count = self.micro_batch, self.accumulation_steps
        if micro * count * world_size != self.effective_batch:  # a ramp step: the last micro-batch is smaller
            last = self.effective_batch // world_size - micro * (count - 1)
            return f"({micro} x {count - 1} + {last}) x {world_size} = {self.effective_batch}"
        return f"{micro} x {count} x {world_size} = {self.effective_batch}"


def epoch_steps(dataset_size: int | None, batch: int, world_size: int, drop_last: bool) -> tuple[int | None, int]:
    """Optimizer steps per epoch of `dataset_size` samples at `batch`, and the samples of its last window."""
    if dataset_size is None:
        return None, 0
    full, partial = divmod(dataset_size, batch)
    keep_partial = not drop_last and partial >= world_size  # every process needs an item
    return (full + 1 if keep_partial and partial else full), partial


# ---- planning ----------------------------------------------------------------------------------------------


def plan_phases(
    recipe: Recipe,
    micro_batch_max: Callable[[int | None], int],
    world_size: int,
    dataset_size: Callable[[int | None], int | None],
    choose: Callable[[Recipe, int], Any],
    target: Any,
    warnings: list[str],
) -> list[PlanPhase]:
    """The segments of `recipe.batch.phases` or `.ramp`.

    `micro_batch_max(L)` and `dataset_size(L)` are the largest micro-batch and the training samples at sequence
    length L; `choose(phase_recipe, cap)` splits a fixed batch (the planner's exact or fast choice); `target` is the
    choice made for the recipe's main batch (the ramp's last segment).
    """
    batch = recipe.batch
    drop_last = recipe.data.drop_last

    def segment(kind: str, start: int, steps: int | None, choice: Any, paper: int | None, length: int | None,
                cap: int, exact: bool | None) -> PlanPhase:
        size = dataset_size(length)
        per_epoch, _ = epoch_steps(size, choice.effective_batch, world_size, drop_last)
        return PlanPhase(
            kind=kind, start_step=start, steps=steps, micro_batch_max=cap, micro_batch=choice.micro_batch,
            accumulation_steps=choice.accumulation_steps, effective_batch=choice.effective_batch,
            paper_effective_batch=paper, sequence_length=length, exact=exact, lr_factor=choice.lr_factor,
            dataset_size=size, steps_per_epoch=per_epoch,
        )

    segments: list[PlanPhase] = []
    if batch.phases:
        start = 0
        for index, phase in enumerate(batch.phases):
            length = phase.sequence_length or batch.sequence_length
            paper = batch.phase_sequences(phase)
            if world_size > paper:
                raise UserError(f"--world-size: {world_size} processes exceed batch.phases[{index}]'s batch of "
                                f"{paper} {batch.count_unit}: each process needs at least one")
            cap = micro_batch_max(length)
            choice = choose(phase_recipe(recipe, paper, length), min(cap, math.ceil(paper / world_size)))
            placed = segment("phase", start, None, choice, paper, length, cap, choice.exact)
            if index < len(batch.phases) - 1:
                steps = own_steps(phase, placed, paper, f"batch.phases[{index}]")
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
    return _ramp(recipe, target, micro_batch_max(batch.sequence_length), world_size, dataset_size, segment, warnings)


def own_steps(length: Length, phase: PlanPhase, paper: int, what: str) -> int:
    """A length in a phase's own units (its batch's steps, epochs of its data, samples, tokens) in optimizer steps of
    its batch: the phase's length, and the lengths of its own schedule."""
    unit, value = length.unit, length.value
    if unit == "epochs":
        if phase.steps_per_epoch is None:
            raise UserError(f"{what}: counted in epochs, but the dataset size is unknown (set data.train_size)")
        return round(value * phase.steps_per_epoch)
    samples = {"steps": value * paper, "samples": value}.get(unit)
    if samples is None:  # tokens
        samples = value / phase.sequence_length
    return round(samples / phase.effective_batch)


def _ramp(recipe: Recipe, target: Any, cap: int, world_size: int, dataset_size: Callable, segment: Callable,
          warnings: list[str]) -> list[PlanPhase]:
    """One segment per distinct batch of the ramp, then the target batch to the end."""
    batch, ramp = recipe.batch, recipe.batch.ramp
    length = batch.sequence_length
    final = batch.sequences
    grain = ramp_grain(recipe, world_size)  # the recipe's, not the micro-batch's: the same ramp on any machine
    start = ramp.start // length if batch.unit == "tokens" else ramp.start
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
        size = dataset_size(length)
        if size is None:
            raise UserError("batch.ramp.length: counted in epochs, but the dataset size is unknown (set "
                            "data.train_size)")
        value, unit = value * size, "samples"
    elif unit == "tokens":
        value, unit = value / length, "samples"
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
        choice = _Split(micro, -(-share // micro), effective, target.lr_factor)
        segments.append(segment("ramp", steps, count, choice, None, length, cap, None))
        steps, read = steps + count, read + count * effective
    return [*segments, last.model_copy(update={"start_step": steps})]


def ramp_grain(recipe: Recipe, world_size: int) -> int:
    """The ramp's granularity in samples (sequences): each ramp step's batch is a multiple of it. The recipe's
    `batch.ramp.granularity`, by default one sequence per process; never the micro-batch, so the ramp (and the run's
    optimizer steps) are the same whatever fits on the machine."""
    batch = recipe.batch
    given = batch.ramp.granularity
    if given is None:
        return world_size
    grain = given // batch.sequence_length if batch.unit == "tokens" else given
    if grain % world_size:
        raise UserError(f"--world-size: {world_size} processes cannot share batch.ramp.granularity's {grain} "
                        f"{batch.count_unit} equally; use a world size that divides it")
    return grain


@dataclass(frozen=True)
class _Split:
    """A ramp step's split: micro-batches of the target's size (one smaller when the step's share of a process is
    below it, or the last one smaller when the share is not a multiple of it)."""

    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    lr_factor: float
    exact: None = None


def lengths_to_steps(phases: list[PlanPhase], recipe: Recipe, length: Length, what: str,
                     warnings: list[str]) -> int | None:
    """Optimizer steps covering `length` of the schedule, walking the segments (the data each one reads)."""
    unit, remaining = length.unit, float(length.value)
    for index, phase in enumerate(phases):
        if unit == "epochs":
            if phase.steps_per_epoch is None:
                message = f"{what}: counted in epochs, but the dataset size is unknown (set data.train_size)"
                if message not in warnings:
                    warnings.append(message)
                return None
            per_step = 1 / phase.steps_per_epoch if phase.steps_per_epoch else math.inf
        elif unit == "steps":
            per_step = phase.effective_batch / (phase.paper_effective_batch or phase.effective_batch)
        elif unit == "samples":
            per_step = phase.effective_batch
        else:
            if phase.sequence_length is None:
                raise UserError(f"{what}: counted in tokens, but batch.sequence_length is not set")
            per_step = phase.effective_batch * phase.sequence_length
        if phase.steps is None or index == len(phases) - 1 or remaining <= phase.steps * per_step:
            return phase.start_step + round(remaining / per_step)
        remaining -= phase.steps * per_step
    return None


def phase_index(phases: list[PlanPhase], step: int) -> int:
    """The segment optimizer step `step` (0-based) belongs to."""
    starts = [phase.start_step for phase in phases]
    return max(0, bisect.bisect_right(starts, step) - 1)


# ---- where each step reads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamWindow:
    """Where optimizer step s reads: samples [offset, offset + size) of `epoch`'s order of its length's data."""

    phase: int
    sequence_length: int | None
    epoch: int
    offset: int
    size: int
    dataset_size: int
    effective_batch: int

    @property
    def partial(self) -> bool:
        return self.size < self.effective_batch


def stream_window(phases: list[PlanPhase], step: int, world_size: int, drop_last: bool) -> StreamWindow:
    """Where step `step` reads in its sequence length's stream of data (see the module docstring)."""
    key = tuple((p.start_step, p.steps, p.effective_batch, p.sequence_length, p.dataset_size) for p in phases)
    index = phase_index(phases, step)
    epoch, offset = _segment_starts(key, world_size, drop_last)[index]
    phase = phases[index]
    epoch, offset, size = _window(epoch, offset, step - phase.start_step, phase.effective_batch,
                                  phase.dataset_size, world_size, drop_last)
    return StreamWindow(index, phase.sequence_length, epoch, offset, size, phase.dataset_size,
                        phase.effective_batch)


@functools.lru_cache(maxsize=8)
def _segment_starts(key: tuple, world_size: int, drop_last: bool) -> list[tuple[int, int]]:
    """(epoch, offset) where each segment's stream stands before its first step: computed once per plan.

    The offset is where the last window of that length stopped reading; whether the rest of that epoch holds a
    window depends on the batch of the segment that reads next, so `_window` decides it.
    """
    streams: dict[Any, tuple[int, int]] = {}
    starts = []
    for _, steps, batch, length, size in key:
        epoch, offset = streams.get(length, (0, 0))
        starts.append((epoch, offset))
        if steps:
            epoch, offset, read = _window(epoch, offset, steps - 1, batch, size, world_size, drop_last)
            streams[length] = (epoch, offset + read)
    return starts


def _window(epoch: int, offset: int, steps: int, batch: int, size: int | None, world_size: int,
            drop_last: bool) -> tuple[int, int, int]:
    """From the stream standing at (epoch, offset), window number `steps` (0-based) of `batch`: its (epoch, offset,
    size). A window takes `batch` samples from the epoch's order; the rest of an epoch shorter than that is dropped
    (drop_last) or read as a partial window, and the next window starts the next epoch.
    """
    if size is None:
        raise UserError("plan: the dataset size is unknown; plan the run with its data (reproduce run plans it)")
    per_epoch, _ = epoch_steps(size, batch, world_size, drop_last)
    if not per_epoch:
        raise UserError(f"data: the epoch ({size} samples) is shorter than one optimizer step ({batch}) with "
                        "drop_last: no step would run; lower the batch or set data.drop_last: false")
    first, _ = epoch_steps(size - offset, batch, world_size, drop_last)  # windows left in this epoch
    if steps < first:
        offset += steps * batch
    else:
        later = steps - first
        epoch, offset = epoch + 1 + later // per_epoch, (later % per_epoch) * batch
    return epoch, offset, min(batch, size - offset)


def phase_lines(plan: Plan) -> list[str]:
    """The batch phases in a few lines: each phase's steps and split; a ramp as its first and last batches."""
    lines, ramp = [], [phase for phase in plan.phases if phase.kind == "ramp"]
    if ramp:
        lines.append(f"batch ramp: steps 1-{ramp[-1].end_step}, {len(ramp)} batches from {ramp[0].effective_batch} "
                     f"to {ramp[-1].effective_batch} {plan.unit} (micro {ramp[0].micro_batch} x accumulation "
                     f"{ramp[0].accumulation_steps} to {ramp[-1].accumulation_steps})")
    for phase in plan.phases:
        if phase.kind == "phase":
            end = phase.end_step if phase.end_step is not None else "end"
            length = f" of {phase.sequence_length} tokens" if phase.sequence_length else ""
            lines.append(f"batch phase: steps {phase.start_step + 1}-{end}: micro {phase.micro_batch} x accumulation "
                         f"{phase.accumulation_steps} x world {plan.world_size} = {phase.effective_batch} "
                         f"{'sequences' if length else plan.unit}{length}")
    return lines
