"""Which samples go into each optimizer step's window, and how it splits into micro-batches and ranks."""

from __future__ import annotations

import functools

import torch

from ..planner import Plan


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
    """
    batch = plan.effective_batch
    per_epoch = plan.steps_per_epoch
    epoch, position = divmod(step, per_epoch)
    indices = epoch_order(plan, size, epoch, seed)[position * batch : (position + 1) * batch]
    partial = len(indices) < batch
    mine = torch.tensor_split(indices, plan.world_size)[rank] if partial else (
        indices[rank * plan.per_rank_batch : (rank + 1) * plan.per_rank_batch]
    )
    return list(torch.split(mine, micro_batch or plan.micro_batch)), partial


def smaller_micro_batch(per_rank_batch: int, micro_batch: int) -> int | None:
    """After an out-of-memory error: the largest micro-batch <= half the current one that still divides this
    rank's share of the effective batch (so the effective batch stays exact); None below 1."""
    for candidate in range(micro_batch // 2, 0, -1):
        if per_rank_batch % candidate == 0:
            return candidate
    return None
