"""Which samples go into each optimizer step's window, and how it splits into micro-batches and ranks.

`step_batch(plan, step)` is each step's batch (micro-batch, N, effective batch, sequence length): the plan's
throughout, or the batch phase's the step falls in (`batch.phases`, `batch.ramp`); `window` gives its samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..phases import phase_index, stream_window
from ..planner import Plan


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's batch; `phase` is its index in `plan.phases` (None for a plan without phases)."""

    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    sequence_length: int | None
    phase: int | None = None


def step_batch(plan: Plan, step: int) -> StepBatch:
    """The batch of optimizer step `step` (0-based): where `reproduce run` switches N and the sequence length."""
    if not plan.phases:
        return StepBatch(plan.micro_batch, plan.accumulation_steps, plan.effective_batch,
                         plan.recipe.batch.sequence_length)
    index = phase_index(plan.phases, step)
    phase = plan.phases[index]
    return StepBatch(phase.micro_batch, phase.accumulation_steps, phase.effective_batch, phase.sequence_length, index)


def micro_batch_at(plan: Plan, step: int, lowered: dict) -> int:
    """The micro-batch step `step` runs with: its phase's, or lower where an out-of-memory error lowered it
    (`lowered`: sequence length -> micro-batch). What the loop and a loader prefetching its windows both use."""
    batch = step_batch(plan, step)
    return min(batch.micro_batch, lowered.get(batch.sequence_length, batch.micro_batch))


def length_sizes(plan: Plan) -> dict[int | None, int | None]:
    """The training samples at each sequence length the plan's phases read, shortest length first."""
    sizes = {phase.sequence_length: phase.dataset_size for phase in plan.phases}
    return {length: sizes[length] for length in sorted(sizes, key=lambda length: length or 0)}


def length_offsets(sizes: dict) -> dict:
    """Where each length's samples start in one index space (`data.lengths.ByLength`): shortest length first."""
    offsets, start = {}, 0
    for length in sorted(sizes, key=lambda length: length or 0):
        offsets[length] = start
        start += sizes[length] or 0
    return offsets


def step_epoch(plan: Plan, step: int) -> float:
    """The epochs of data read once optimizer step `step` (0-based) is done (of its length's data, with phases)."""
    if not plan.phases:
        return (step + 1) / plan.steps_per_epoch
    where = stream_window(plan.phases, step, plan.world_size, plan.recipe.data.drop_last)
    return where.epoch + (where.offset + where.size) / where.dataset_size


def epoch_order(plan: Plan, size: int, epoch: int, seed: int) -> torch.Tensor:
    """The sample order of `epoch`: a permutation drawn from (seed, epoch) alone, so resume sees the same."""
    return _order(size, epoch, seed, plan.recipe.data.shuffle)


@functools.lru_cache(maxsize=2)  # drawn once per epoch, not once per optimizer step
def _order(size: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def window(plan: Plan, size: int, step: int, seed: int, rank: int = 0,
           micro_batch: int | None = None) -> tuple[list[torch.Tensor], bool]:
    """This rank's micro-batches (index tensors) for optimizer step `step`, and whether the window is partial.

    The window is the same slice of the epoch's order whatever the micro-batch or world size, so a run that
    changes either (out of memory, resume elsewhere) still takes the same samples into each optimizer step.
    With batch phases the indices are into `data.lengths.ByLength` (`size` is then not used).
    """
    if plan.phases:
        return _phase_window(plan, step, seed, rank, micro_batch)
    batch = plan.effective_batch
    per_epoch = plan.steps_per_epoch
    epoch, position = divmod(step, per_epoch)
    indices = epoch_order(plan, size, epoch, seed)[position * batch : (position + 1) * batch]
    partial = len(indices) < batch
    mine = torch.tensor_split(indices, plan.world_size)[rank] if partial else (
        indices[rank * plan.per_rank_batch : (rank + 1) * plan.per_rank_batch]
    )
    return list(torch.split(mine, micro_batch or plan.micro_batch)), partial


def _phase_window(plan: Plan, step: int, seed: int, rank: int, micro_batch: int | None
                  ) -> tuple[list[torch.Tensor], bool]:
    """`window` for a plan with batch phases: the step's slice of its sequence length's stream (phases.py)."""
    where = stream_window(plan.phases, step, plan.world_size, plan.recipe.data.drop_last)
    base = length_offsets(length_sizes(plan))[where.sequence_length]
    order = epoch_order(plan, where.dataset_size, where.epoch, seed)
    indices = order[where.offset : where.offset + where.size] + base
    per_rank = where.effective_batch // plan.world_size
    mine = torch.tensor_split(indices, plan.world_size)[rank] if where.partial else (
        indices[rank * per_rank : (rank + 1) * per_rank]
    )
    return list(torch.split(mine, micro_batch or plan.phases[where.phase].micro_batch)), where.partial


def smaller_micro_batch(per_rank_batch: int, micro_batch: int) -> int | None:
    """After an out-of-memory error: the largest micro-batch <= half the current one that still divides this
    rank's share of the effective batch (so the effective batch stays exact); None below 1."""
    for candidate in range(micro_batch // 2, 0, -1):
        if per_rank_batch % candidate == 0:
            return candidate
    return None
