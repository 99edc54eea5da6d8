"""Which samples go into each optimizer step's window, and how it splits into micro-batches and ranks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..data.packing import WAYS, Grouping, balance, computed_tokens, group, sample_lengths
from ..errors import UserError
from ..plan.planner import Plan
from ..plan.segments import epochs_done, length_sizes, phase_index, stream_window

if TYPE_CHECKING:
    from ..data import Datasets
    from ..plan.recipe import Recipe


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's batch; `phase` is its batch phase's index in `plan.segments` (None without phases)."""

    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    sequence_length: int | None
    phase: int | None = None


def step_batch(plan: Plan, step: int) -> StepBatch:
    """The batch of optimizer step `step` (0-based): where `reproduce run` switches N and the sequence length."""
    index = phase_index(plan.segments, step)
    segment = plan.segments[index]
    return StepBatch(segment.micro_batch, segment.accumulation_steps, segment.effective_batch,
                     segment.sequence_length, None if segment.kind == "whole" else index)


def micro_batch_at(plan: Plan, step: int, lowered: dict) -> int:
    """Step `step`'s micro-batch: its phase's, or as an out-of-memory error lowered it (`lowered`:
    sequence length -> micro-batch)."""
    batch = step_batch(plan, step)
    return min(batch.micro_batch, lowered.get(batch.sequence_length, batch.micro_batch))


def step_epoch(plan: Plan, step: int) -> float:
    """The epochs of data read once optimizer step `step` (0-based) is done (of its length's data, with phases)."""
    return epochs_done(plan.segments, step, plan.world_size, plan.recipe.data.drop_last)


def epoch_order(plan: Plan, size: int, epoch: int, seed: int) -> torch.Tensor:
    """The sample order of `epoch`: a permutation drawn from (seed, epoch) alone, so resume sees the same."""
    return _order(size, epoch, seed, plan.recipe.data.shuffle)


@functools.lru_cache(maxsize=2)  # drawn once per epoch, not once per optimizer step
def _order(size: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(size)
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def window(plan: Plan, size: int, step: int, seed: int, rank: int = 0, micro_batch: int | None = None,
           grouping: Grouping | None = None) -> tuple[list[torch.Tensor], bool]:
    """This rank's micro-batches (index tensors) for step `step`, and whether the window is partial.

    The step's slice of its sequence length's stream (plan/segments.py), the same whatever the micro-batch or world
    size, so a run that changes either takes the same samples into each step; into `data.ByLength` with phases of
    several lengths. With `grouping` (data.packing sorted or packed) the share is grouped by length instead."""
    shares, partial, planned = rank_shares(plan, step, seed)
    micro_batch = micro_batch or planned
    return split_shares(shares, grouping, micro_batch)[rank], partial


def split_shares(shares: list[torch.Tensor], grouping: Grouping | None, micro_batch: int) -> list[list[torch.Tensor]]:
    """Every rank's micro-batches of its share: in order, or with `grouping` grouped by length, as many on each rank
    (data/packing.py)."""
    if grouping is None:
        return [list(torch.split(share, micro_batch)) for share in shares]
    budget = grouping.budget_at(micro_batch)
    return balance([group(share, grouping, budget) for share in shares])


def rank_shares(plan: Plan, step: int, seed: int) -> tuple[list[torch.Tensor], bool, int]:
    """Every rank's sample indices of step `step`'s window, whether it is partial, and its planned
    micro-batch."""
    segments = plan.segments
    where = stream_window(segments, step, plan.world_size, plan.recipe.data.drop_last)
    # each length's samples in one index space (`data.lengths.ByLength`), shortest first: this one's start after
    # the shorter ones'
    base = sum(size or 0 for length, size in length_sizes(segments).items()
               if (length or 0) < (where.sequence_length or 0))
    order = _order(where.dataset_size, where.epoch, seed, plan.recipe.data.shuffle)
    indices = order[where.offset : where.offset + where.size] + base
    # a whole window is m x N x W samples, W equal shares; a partial one's shares differ by one at most
    shares = list(torch.tensor_split(indices, plan.world_size))
    return shares, where.partial, segments[where.phase].micro_batch


def padding_over(plan: Plan, steps: range, seed: int, lengths: torch.Tensor, grouping: Grouping | None,
                 micro_batch: int | None = None) -> tuple[int, int, int]:
    """Over the windows of `steps` (every rank's): one rank's micro-batches, the input tokens and the
    tokens computed with padding; at `micro_batch`, else each step's planned one."""
    micro_batches = useful = computed = 0
    way, row, varlen = (grouping.way, grouping.row, grouping.varlen) if grouping else ("none", 0, False)
    for step in steps:
        shares, _, planned = rank_shares(plan, step, seed)
        micro = micro_batch or planned
        groups = split_shares(shares, grouping, micro)
        micro_batches += len(groups[0])
        useful += sum(int(lengths[share].sum()) for share in shares)
        computed += sum(computed_tokens(g, lengths, way, row, varlen) for rank in groups for g in rank)
    return micro_batches, useful, computed


def grouping_table(plan: Plan, lengths: torch.Tensor, budget: int | None, seed: int, steps: int = 32) -> dict:
    """Each way's micro-batches per rank and window (mean) and padding fraction over the first
    `steps` windows; `budget`: data.token_budget, else the micro-batch x the longest example."""
    longest = int(lengths.max())
    budget = budget or plan.micro_batch * longest  # the probe's micro-batch is m copies of the longest: T's shape
    table = {"token_budget": budget, "longest": longest, "given": budget != plan.micro_batch * longest,
             "windows": min(steps, plan.optimizer_steps)}
    for way in WAYS:
        # packed: one row per micro-batch, as a transformers model runs it through the varlen attention that
        # build_model selects for it (models/varlen.py; another model refuses packed before its first step)
        grouping = None if way == "none" else Grouping(way, budget, longest, lengths, plan.micro_batch,
                                                       varlen=way == "packed")
        micro_batches, useful, computed = padding_over(plan, range(table["windows"]), seed, lengths, grouping)
        table[way] = {"micro_batches": round(micro_batches / max(table["windows"], 1), 2),
                      "padding_fraction": round(1 - useful / computed, 4) if computed else None}
    return table


def grouping_line(plan: Plan, grouping: Grouping, seed: int, first_step: int = 0, steps: int = 32) -> str:
    """The run's start line on its grouping: the way, T, the attention, micro-batches per window and
    rank, and the padding share."""
    windows = range(first_step, min(first_step + steps, plan.optimizer_steps or first_step + steps))
    micro_batches, useful, computed = padding_over(plan, windows, seed, grouping.lengths, grouping)
    attention = ("one row per micro-batch, varlen attention (no padding, no dense mask)" if grouping.varlen else
                 "rows of the longest example, transformers' block mask" if grouping.way == "packed" else
                 "rows padded to the longest in each micro-batch")
    line = f"packing: {grouping.way}, token budget {grouping.budget:,} tokens per micro-batch, {attention}"
    if not len(windows) or not computed:
        return line
    return (f"{line}; over the first {len(windows)} windows: {micro_batches / len(windows):.3g} micro-batches per "
            f"window and rank, {1 - useful / computed:.0%} padding")


def packing_table(recipe: Recipe, plan: Plan, data: Datasets | None) -> dict | None:
    """`plan --data` on text: each way's micro-batches and padding (grouping_table), and the
    recipe's way; None without lengths."""
    if data is None or recipe.task != "language-modeling" or recipe.batch.unit != "samples" or (
            recipe.batch.phases or recipe.batch.ramp):
        return None
    try:
        lengths = sample_lengths(data.train)
    except UserError:
        return None
    table = grouping_table(plan, lengths, recipe.data.token_budget, recipe.seed)
    table["way"] = recipe.data.packing or "none"
    return table
