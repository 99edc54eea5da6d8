"""Every plan as segments of optimizer steps, and the one conversion of recipe lengths into optimizer steps. No torch.

A `Segment` is consecutive optimizer steps with one micro-batch m, accumulation N, effective batch E = m x N x W and
sequence length L: one `whole` segment without batch phases, several with `batch.phases` or `batch.ramp`. Lengths
become steps by walking the segments (`lengths_to_steps`: n steps cover n x E samples, n x E x L tokens, n / steps
per epoch epochs, n x E / B paper steps), so a schedule in tokens stays exact while the batch grows. Each sequence
length reads its own stream of data, epoch after epoch, a segment going on where the last one left it
(`stream_window`): a ramp reads the data once, in order."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

from ..errors import UserError
from .recipe import Length, Recipe
from .schedules import StepSchedule
from .split import Frozen, split_text

# one number, or one per sequence length of the batch phases: the micro-batch that fits one process, training samples
PerLength = int | Mapping[int | None, int]
MicroBatchMax = PerLength


class Segment(Frozen):
    """Consecutive optimizer steps with one batch, from `start_step`: `whole` (a plan without batch phases),
    `phase` (a stretch of `batch.phases`, or the target after a ramp) or `ramp` (one batch of the ramp)."""

    kind: Literal["phase", "ramp", "whole"]
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
        return split_text(micro, count, world_size, self.effective_batch)


def micro_batch_cap(micro_batch_max: int, batch: int, world_size: int) -> int:
    """The largest micro-batch worth taking: what fits, at most what `batch` needs per process of `world_size`."""
    return min(micro_batch_max, math.ceil(batch / world_size))


@overload
def epoch_steps(dataset_size: int, batch: int, world_size: int, drop_last: bool) -> tuple[int, int]: ...
@overload
def epoch_steps(dataset_size: int | None, batch: int, world_size: int, drop_last: bool) -> tuple[int | None, int]: ...
def epoch_steps(dataset_size: int | None, batch: int, world_size: int, drop_last: bool) -> tuple[int | None, int]:
    """Optimizer steps per epoch of `dataset_size` samples at `batch`, and the samples of its last window."""
    if dataset_size is None:
        return None, 0
    full, partial = divmod(dataset_size, batch)
    keep_partial = not drop_last and partial >= world_size  # every process needs an item
    return (full + 1 if keep_partial and partial else full), partial


def size_at(length: int | None, recipe: Recipe, size: int | None, sizes: Mapping[int | None, int] | None) -> int | None:
    """Training samples at sequence length `length`: as given, else the main length's data cut at `length`."""
    if sizes is not None and length in sizes:
        return sizes[length]
    main = recipe.batch.sequence_length
    if size is None or length == main or not length or not main:
        return size
    return size * main // length


# ---- lengths in optimizer steps ------------------------------------------------------------------------------


def _per_step(segment: Segment, unit: str) -> float:
    """How much of a length in `unit` one optimizer step of the segment covers."""
    if unit == "epochs":
        return 1 / segment.steps_per_epoch if segment.steps_per_epoch else math.inf
    if unit == "steps":  # the paper's steps of its own batch (a ramp step counts as one)
        return segment.effective_batch / (segment.paper_effective_batch or segment.effective_batch)
    if unit == "samples":
        return segment.effective_batch
    assert segment.sequence_length is not None, "a length in tokens needs batch.sequence_length (the recipe's rule)"
    return segment.effective_batch * segment.sequence_length


def _count(segment: Segment, unit: str, amount: float, what: str) -> int | None:
    """The optimizer steps of the segment that cover `amount` of a length in `unit` (None: epochs of data whose
    size is unknown): the paper's steps, samples and tokens kept as the data they cover."""
    if unit == "epochs":
        if segment.steps_per_epoch is None:
            return None
        return max(0, round(amount * segment.steps_per_epoch)) if amount else 0
    if unit == "steps":
        return round(amount * (segment.paper_effective_batch or segment.effective_batch) / segment.effective_batch)
    if unit == "samples":
        return round(amount / segment.effective_batch)
    if segment.sequence_length is None:
        raise UserError(f"{what}: counted in tokens, but batch.sequence_length is not set")
    return round(amount / segment.sequence_length / segment.effective_batch)


def lengths_to_steps(segments: list[Segment], length: Length, what: str, warnings: list[str]) -> int | None:
    """Optimizer steps covering `length` of the schedule (from step 0), walking the segments: the data each one
    reads. None (with a warning) for epochs of data whose size is unknown."""
    unit, remaining = length.unit, float(length.value)
    for index, segment in enumerate(segments):
        if unit == "epochs" and segment.steps_per_epoch is None:
            message = f"{what}: counted in epochs, but the dataset size is unknown (set data.train_size)"
            if message not in warnings:
                warnings.append(message)
            return None
        if segment.steps is None or index == len(segments) - 1 or remaining <= segment.steps * _per_step(segment, unit):
            counted = _count(segment, unit, remaining, what)  # (not None: epochs with a known size, checked above)
            return None if counted is None else segment.start_step + counted
        remaining -= segment.steps * _per_step(segment, unit)
    return None


def own_steps(length: Length, segment: Segment, what: str) -> int:
    """A length in a phase's own units (its batch's steps, epochs of its data, samples, tokens) in optimizer steps of
    its batch: the phase's length, and the lengths of its own schedule."""
    steps = _count(segment, length.unit, length.value, what)
    if steps is None:
        raise UserError(f"{what}: counted in epochs, but the dataset size is unknown (set data.train_size)")
    return steps


# ---- where a step falls -------------------------------------------------------------------------------------


def phase_index(phases: list[Segment], step: int) -> int:
    """The segment optimizer step `step` (0-based) belongs to."""
    return max(0, bisect.bisect_right([phase.start_step for phase in phases], step) - 1)

def batch_phases(segments: list[Segment]) -> list[Segment]:
    """The segments that are batch phases or ramp steps (`batch.phases`, `batch.ramp`): none for a plan without."""
    return [segment for segment in segments if segment.kind != "whole"]


def epochs_done(segments: list[Segment], step: int, world_size: int, drop_last: bool) -> float:
    """The epochs of data read once optimizer step `step` (0-based) is done: of the whole data for a plan without
    batch phases (its windows over the epoch's), of the step's sequence length's data with them (samples read)."""
    if segments[0].kind == "whole":  # (a plan without batch phases: its one segment)
        per_epoch = segments[0].steps_per_epoch
        assert per_epoch is not None, "a run reads data of a known size"
        return (step + 1) / per_epoch
    where = stream_window(segments, step, world_size, drop_last)
    return where.epoch + (where.offset + where.size) / where.dataset_size


def length_sizes(segments: list[Segment]) -> dict[int | None, int | None]:
    """The training samples at each sequence length the segments read, shortest length first."""
    sizes = {segment.sequence_length: segment.dataset_size for segment in segments}
    return {length: sizes[length] for length in sorted(sizes, key=lambda length: length or 0)}


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
    partial: bool  # size < effective_batch


def stream_window(phases: list[Segment], step: int, world_size: int, drop_last: bool) -> StreamWindow:
    """Where step `step` reads in its sequence length's stream of data (see the module docstring)."""
    key = tuple((p.start_step, p.steps, p.effective_batch, p.sequence_length, p.dataset_size) for p in phases)
    index = phase_index(phases, step)
    epoch, offset = _segment_starts(key, world_size, drop_last)[index]
    phase = phases[index]
    epoch, offset, size = _window(epoch, offset, step - phase.start_step, phase.effective_batch,
                                  phase.dataset_size, world_size, drop_last)
    assert phase.dataset_size is not None  # (_window refuses an unknown size)
    return StreamWindow(index, phase.sequence_length, epoch, offset, size, phase.dataset_size,
                        phase.effective_batch, size < phase.effective_batch)


@functools.lru_cache(maxsize=8)
def _segment_starts(key: tuple[tuple[int, int | None, int, int | None, int | None], ...], world_size: int,
                    drop_last: bool) -> list[tuple[int, int]]:
    """(epoch, offset) of each segment's stream before its first step, once per plan: where the last window of
    its length stopped (whether the rest of that epoch holds a window is `_window`'s to decide)."""
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
    """Window number `steps` (0-based) of `batch` from the stream at (epoch, offset): its (epoch, offset, size).
    An epoch's rest shorter than a window is dropped (drop_last) or read as a partial window."""
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
