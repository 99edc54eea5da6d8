"""`sorted`'s cut of a window (data/packing.py `split`): the fewest micro-batches the token budget allows, and among
those the fewest padded tokens, checked against every partition of small windows (brute force)."""

from __future__ import annotations

import random

import pytest

from reproduce.data.packing import split


def partitions(items: list[int]):
    """Every partition of `items` into non-empty groups (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        for k in range(len(smaller)):
            yield smaller[:k] + [[first, *smaller[k]]] + smaller[k + 1:]
        yield [[first], *smaller]


def cost(groups: list[list[int]]) -> tuple[int, int]:
    """(micro-batches, padded tokens) of groups of lengths, each padded to its longest."""
    return len(groups), sum(len(g) * max(g) - sum(g) for g in groups)


def fits(groups: list[list[int]], budget: int) -> bool:
    return all(len(g) == 1 or len(g) * max(g) <= budget for g in groups)


def greedy(lengths: list[int], budget: int) -> list[int]:
    """The cut `sorted` made before: as many rows as the longest allows, from the longest."""
    sizes, start = [], 0
    while start < len(lengths):
        sizes.append(max(1, budget // lengths[start]))
        start += sizes[-1]
    sizes[-1] -= start - len(lengths)
    return sizes


def groups_of(lengths: list[int], sizes: list[int]) -> list[list[int]]:
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [lengths[s:s + n] for s, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_optimal_against_every_partition(seed):
    generator = random.Random(seed)
    n = generator.randint(1, 8)
    lengths = sorted((generator.choice([1, 2, 3, 5, 8, 13, 20, 21, 30]) for _ in range(n)), reverse=True)
    budget = generator.randint(lengths[0], 4 * lengths[0])
    sizes = split(lengths, budget)
    assert sum(sizes) == n and all(size >= 1 for size in sizes)
    ours = groups_of(lengths, sizes)
    assert fits(ours, budget)
    best = min(cost(p) for p in partitions(lengths) if fits(p, budget))
    assert cost(ours) == best


@pytest.mark.parametrize("seed", range(20))
def test_the_split_is_never_worse_than_the_greedy_cut(seed):
    """On log-normal windows of 16 (the long-tailed set's shape): never more micro-batches nor, at as many, more
    padding than the cut `sorted` made before; strictly less padding on some."""
    generator = random.Random(seed)
    lengths = sorted((min(512, max(16, round(generator.lognormvariate(5.18, 0.66)))) for _ in range(16)),
                     reverse=True)
    budget = 4 * 512
    ours, before = cost(groups_of(lengths, split(lengths, budget))), cost(groups_of(lengths, greedy(lengths, budget)))
    assert ours <= before


def test_the_split_pads_less_than_the_greedy_cut_on_a_known_window():
    lengths = [100, 60, 60, 60, 50, 10]  # budget 200: greedy 100+60 | 60+60+50 | 10, padding 40 + 10 + 0
    assert greedy(lengths, 200) == [2, 3, 1] and cost(groups_of(lengths, [2, 3, 1])) == (3, 50)
    assert split(lengths, 200) == [1, 3, 2] and cost(groups_of(lengths, [1, 3, 2])) == (3, 40)  # 100 | 3 x 60 | 50+10
