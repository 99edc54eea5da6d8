"""How a window's samples are grouped into micro-batches (`data.packing`): none, sorted, packed.

A step takes exactly the samples the unpacked plan draws (train/windows.py) and the loss stays normalised by the
window's target tokens (train/step.py): only the grouping changes, so the gradient is the large batch's.

- none: the plan's micro-batch of m samples, padded to its longest;
- sorted: the share ordered longest first, cut (`split`) into the fewest micro-batches of at most T tokens (rows x
  longest row), then the fewest padded tokens; any attention;
- packed: first-fit decreasing into micro-batches of at most T tokens. With a varlen attention (models/varlen.py),
  each is ONE row, samples back to back, position ids restarting at each sample; otherwise rows as long as the
  longest example, T // that rows each, and transformers confines attention to each sample by its block mask
  (masking_utils.find_packed_sequence_indices: no 2D mask, no cache).

T is `data.token_budget`, by default the plan's micro-batch x the longest example, so each way fits where `none`
did. A window's micro-batches number alike on every rank (DDP and FSDP reduce on the last): a rank with fewer splits
its largest, or runs empty ones (one padding token, no target: no loss, the same collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UserError
from .batches import IGNORE_INDEX, collate

WAYS = ("none", "sorted", "packed")


@dataclass(frozen=True)
class Grouping:
    """A way, its token budget T at the plan's micro-batch, `packed`'s row length, each sample's input tokens."""

    way: str
    budget: int
    row: int
    lengths: torch.Tensor
    micro_batch: int  # the plan's: a micro-batch lowered after an out-of-memory error lowers T in proportion
    varlen: bool = False  # packed: one row per micro-batch, for a varlen attention (models/varlen.py)

    def budget_at(self, micro_batch: int) -> int:
        return max(1, self.budget * micro_batch // self.micro_batch)


def sample_lengths(dataset: Any) -> torch.Tensor:
    """Each sample's input tokens (tokenised text's own lengths, else its items')."""
    input_lengths = getattr(dataset, "input_lengths", None)
    if input_lengths is not None:
        return input_lengths()
    lengths = []
    for index in range(len(dataset)):
        inputs = dataset[index][0]
        if not isinstance(inputs, torch.Tensor) or inputs.ndim != 1:
            raise UserError(f"data.packing: the training data ({type(dataset).__name__}) has no lengths to group by "
                            "(its samples are not token sequences); packing is for text: use data.packing: none")
        lengths.append(len(inputs))
    return torch.tensor(lengths, dtype=torch.long)


def grouping_of(recipe: Any, dataset: Any, micro_batch: int, varlen: bool = False,
                way: str | None = None) -> Grouping | None:
    """The recipe's grouping (None with `none`). `varlen`: the model runs a varlen attention (one packed row a
    micro-batch); `way`: in place of data.packing (a plan's default)."""
    way = way or recipe.data.packing or "none"
    if way == "none":
        return None
    lengths = sample_lengths(dataset)
    longest = int(lengths.max())
    budget = recipe.data.token_budget or micro_batch * longest
    if budget < longest:
        index = int(torch.argmax(lengths))
        raise UserError(f"data.token_budget: {budget} tokens is smaller than example {index}'s {longest} input tokens "
                        "(after truncation to data.max_length); give at least that")
    return Grouping(way, budget, longest, lengths, micro_batch, varlen=varlen and way == "packed")


_GROUPED: list[tuple[Grouping, int, bytes, list[torch.Tensor]]] = []  # the last few `group` results
_KEPT = 8


def group(indices: torch.Tensor, grouping: Grouping, budget: int) -> list[torch.Tensor]:
    """One rank's share grouped into micro-batches of at most `budget` tokens. A run groups each window several
    times (train/windows.py): the last few results are kept (a new list of the same tensors, never changed)."""
    if len(indices) == 0:
        return []
    key = indices.numpy().tobytes() if indices.device.type == "cpu" and indices.dtype == torch.long else None
    if key is not None:
        for kept, kept_budget, kept_key, groups in _GROUPED:
            if kept is grouping and kept_budget == budget and kept_key == key:
                return list(groups)
    groups = _group(indices, grouping, budget)
    if key is not None:
        _GROUPED.insert(0, (grouping, budget, key, groups))
        del _GROUPED[_KEPT:]
    return list(groups)


def _group(indices: torch.Tensor, grouping: Grouping, budget: int) -> list[torch.Tensor]:
    own = grouping.lengths[indices]
    order = torch.argsort(own, descending=True, stable=True)
    if grouping.way == "sorted":
        sizes = split(own[order].tolist(), budget)
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [indices[order[start : start + size]] for start, size in zip(starts, sizes, strict=True)]
    row = budget if grouping.varlen else grouping.row
    rows: list[list[int]] = []  # first-fit decreasing: positions in `indices`
    used: list[int] = []
    for position in order.tolist():
        length = int(own[position])
        for row_index, filled in enumerate(used):
            if filled + length <= row:
                rows[row_index].append(position)
                used[row_index] += length
                break
        else:
            rows.append([position])
            used.append(length)
    per = 1 if grouping.varlen else max(1, budget // grouping.row)
    return [indices[[p for row in rows[start : start + per] for p in row]] for start in range(0, len(rows), per)]


def split(lengths: list[int], budget: int) -> list[int]:
    """Sizes of the consecutive micro-batches cutting `lengths` (longest first) under `budget` tokens each (rows x
    first row; a sample alone always fits): fewest micro-batches, then fewest padded tokens. A dynamic programme
    over prefixes, O(n^2); a non-contiguous partition is never better (a shorter sample among longer ones lowers no
    group's longest row)."""
    n = len(lengths)
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n  # (micro-batches, padded tokens) of each prefix
    cut = [0] * (n + 1)
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            rows = end - start
            if rows > 1 and rows * lengths[start] > budget:
                break  # (a longer group from an earlier, longer start fits even less)
            padded = rows * lengths[start] - (prefix[end] - prefix[start])
            candidate = (best[start][0] + 1, best[start][1] + padded)
            if candidate < best[end]:
                best[end], cut[end] = candidate, start
    sizes, end = [], n
    while end > 0:
        sizes.append(end - cut[end])
        end = cut[end]
    return sizes[::-1]


def balance(shares: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Every rank's micro-batches made as many as the most any rank has: split the largest, else add empty ones."""
    target = max(len(groups) for groups in shares)
    balanced = []
    for groups in shares:
        groups = list(groups)
        while len(groups) < target:
            largest = max(range(len(groups)), key=lambda i: len(groups[i]), default=None)
            if largest is None or len(groups[largest]) < 2:
                groups.append(torch.empty(0, dtype=torch.long))
                continue
            piece = groups.pop(largest)
            half = (len(piece) + 1) // 2
            groups[largest:largest] = [piece[:half], piece[half:]]
        balanced.append(groups)
    return balanced


def computed_tokens(indices: torch.Tensor, lengths: torch.Tensor, way: str, row: int, varlen: bool = False) -> int:
    """Tokens a micro-batch computes, padding included (varlen packed: its samples' tokens)."""
    if len(indices) == 0:
        return 1
    own = lengths[indices].tolist()
    if way != "packed":
        return len(own) * max(own)
    if varlen:
        return sum(own)
    rows = next_fit(own, row)
    return len(rows) * max(sum(own[i] for i in r) for r in rows)


def next_fit(lengths: list[int], row: int) -> list[list[int]]:
    """Positions in `lengths` cut into rows in order, a new row when the next does not fit: `group`'s first-fit
    rows, flattened row by row (a row's first sample did not fit the row before)."""
    rows: list[list[int]] = []
    filled = row + 1
    for position, length in enumerate(lengths):
        if filled + length > row:
            rows.append([])
            filled = 0
        rows[-1].append(position)
        filled += length
    return rows


class Grouped(torch.utils.data.Dataset):
    """The training set as `sorted` (padded to the longest) or `packed` ({input_ids, position_ids} rows)
    micro-batches collate it; empty indices give one padding token without a target."""

    def __init__(self, dataset: Any, grouping: Grouping):
        self.dataset, self.grouping = dataset, grouping
        self.in_memory = getattr(dataset, "in_memory", isinstance(dataset, (list, tuple)))
        if hasattr(dataset, "target_counts"):
            self.target_counts = dataset.target_counts

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def batch(self, indices: torch.Tensor) -> tuple[Any, torch.Tensor]:
        packed = self.grouping.way == "packed"
        if len(indices) == 0:
            tokens = torch.zeros((1, 1), dtype=torch.long)
            inputs = {"input_ids": tokens, "position_ids": torch.zeros_like(tokens)} if packed else tokens
            return inputs, torch.full((1, 1), IGNORE_INDEX, dtype=torch.long)
        items = [self.dataset[int(i)] for i in indices]
        if not packed:
            return collate(items)
        sizes = [len(inputs) for inputs, _ in items]
        if self.grouping.varlen:  # one row, the samples back to back: concatenated at once
            input_ids = torch.cat([torch.as_tensor(inputs).long() for inputs, _ in items])[None]
            targets = torch.cat([torch.as_tensor(target).long() for _, target in items])[None]
            positions = torch.cat([torch.arange(size) for size in sizes])[None]
            # the samples' bounds handed to the attention; `logits_to_keep`: the lm_head and the loss at the target
            # tokens only (the summed loss has the same terms); a row without targets keeps its first
            keep = (targets[0] != IGNORE_INDEX).nonzero().flatten()
            if len(keep) == 0:
                keep = torch.zeros(1, dtype=torch.long)
            inputs = {"input_ids": input_ids, "position_ids": positions, **varlen_bounds(sizes), "logits_to_keep": keep,
                      "rows_kept_from": kept_from(keep, sizes)}
            return inputs, targets[:, keep]
        rows = next_fit(sizes, self.grouping.row)
        width = max(sum(len(items[i][0]) for i in row) for row in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                inputs, target = items[i]
                end = start + len(inputs)
                input_ids[r, start:end], targets[r, start:end] = torch.as_tensor(inputs), torch.as_tensor(target)
                positions[r, start:end] = torch.arange(len(inputs))
                start = end
            positions[r, start:] = torch.arange(width - start)  # the padding: a segment of its own, no target
        return {"input_ids": input_ids, "position_ids": positions}, targets


def kept_from(keep: torch.Tensor, sizes: list[int]) -> tuple[int, ...]:
    """Each sample's first position whose logit is kept (`keep`, sorted; the sample's size when none is): the last
    layer's outputs before it feed nothing, so its attention computes the rows from there only (models/varlen.py)."""
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    first = keep[torch.searchsorted(keep, bounds[:-1]).clamp(max=len(keep) - 1)]
    inside = (first >= bounds[:-1]) & (first < bounds[1:])
    return tuple(torch.where(inside, first - bounds[:-1], torch.tensor(sizes)).tolist())


def varlen_bounds(sizes: list[int]) -> dict:
    """A packed row's sample bounds as forward kwargs (transformers hands them to each attention call):
    `sample_sizes` for models/varlen.py, and the `cu_seq_lens_*` / `max_length_*` its flash-attention path reads."""
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(sizes).cumsum(0)
    longest = max(sizes)
    return {"sample_sizes": tuple(sizes), "cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets,
            "max_length_q": longest, "max_length_k": longest}

