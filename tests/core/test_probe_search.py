"""The pure micro-batch search, against closed-form memory functions: exact sequences and property tests."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reproduce.probe.search import MAX_GUIDED, Measurement, fit_line, search
from reproduce.throughput.cost import cost, format_duration, micro_step_seconds

GRANULE = 512


def memory(fixed: int, per_sample: list[int], optimizer_peak: int = 0):
    """peak(b) = max(optimizer_peak, fixed + sum over tensors of ceil(bytes * b / 512) * 512)."""

    def peak(b: int) -> int:
        activations = sum(math.ceil(n * b / GRANULE) * GRANULE for n in per_sample)
        return max(optimizer_peak, fixed + activations)

    return peak


def meter(peak, limit: int, budget: int, calls: list[int] | None = None):
    """fits(b): fits under `limit`; beyond `budget` the trial runs out of memory (no peak)."""

    def fits(b: int) -> Measurement:
        if calls is not None:
            calls.append(b)
        value = peak(b)
        if value > budget:
            return Measurement(b, False, None, note="out of memory")
        return Measurement(b, value <= limit, value)

    return fits


def truth(peak, limit: int, cap: int) -> int:
    """The largest b <= cap with peak(b) <= limit, for a non-decreasing peak (0: none)."""
    lo, hi = 0, cap + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
    return lo


def bound(cap: int) -> int:
    return 2 * math.ceil(math.log2(cap + 1)) + MAX_GUIDED + 3


@pytest.mark.subprocess
def test_search_imports_no_torch():
    code = (
        "import sys, reproduce.probe.search, reproduce.hardware.catalog, reproduce.probe.cache, "
        "reproduce.throughput.cost, reproduce.probe.runner; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_exact_line_needs_four_trials():
    # fixed 500 KiB, 10 granules per sample: linear, no rounding; the limit sits inside size 100's step
    peak = memory(1000 * GRANULE, [10 * GRANULE])
    limit = peak(100) + 5 * GRANULE
    calls: list[int] = []
    result = search(meter(peak, limit, limit * 10 // 9, calls), limit, cap=10_000)
    assert calls == [2, 4, 100, 101]
    assert result.micro_batch_max == 100 and result.chosen.peak_bytes == peak(100)
    assert result.line.slope == 10 * GRANULE


def test_safe_jump_when_the_fixed_part_is_small():
    # nothing fixed: peak(b) = b x 8 KiB, so peak(k) <= peak(2) * k / 2 is exact and 2 -> the limit's size
    peak = memory(0, [8192])
    limit = peak(300)
    result = search(meter(peak, limit, 2 * limit), limit, cap=100_000)
    assert [t.micro_batch for t in result.trials] == [2, 300, 301]  # the safe jump lands on the answer
    assert result.micro_batch_max == 300


def test_cap_stops_the_search():
    peak = memory(GRANULE, [GRANULE])
    limit = 10**9
    result = search(meter(peak, limit, limit), limit, cap=48)
    assert result.micro_batch_max == 48 and result.capped
    assert max(t.micro_batch for t in result.trials) == 48
    assert len(result.trials) <= 3


def test_nothing_fits():
    peak = memory(10**6, [GRANULE])
    calls: list[int] = []
    result = search(meter(peak, 1000, 2000, calls), 1000, cap=64)
    assert result.micro_batch_max is None and result.chosen is None
    assert calls == [2, 1]


def test_only_one_fits():
    peak = memory(0, [1000 * GRANULE])
    limit = peak(1)
    result = search(meter(peak, limit, limit), limit, cap=64)
    assert result.micro_batch_max == 1
    assert [t.micro_batch for t in result.trials] == [2, 1]


def test_cap_of_one():
    peak = memory(0, [GRANULE])
    result = search(meter(peak, 10**6, 10**6), 10**6, cap=1)
    assert result.micro_batch_max == 1 and [t.micro_batch for t in result.trials] == [1]


def test_flat_optimizer_peak_then_activations():
    # the optimizer step dominates up to b = 200: sizes there say nothing about the activations' slope
    per_sample = [4096, 4096, 2048]
    fixed = 10 * 2**20
    optimizer_peak = memory(fixed, per_sample)(200)
    peak = memory(fixed, per_sample, optimizer_peak)
    limit = peak(1500) + 100
    result = search(meter(peak, limit, limit * 10 // 9), limit, cap=100_000)
    assert result.micro_batch_max == truth(peak, limit, 100_000) == 1500
    assert [t.micro_batch for t in result.trials][:4] == [2, 4, 64, 1024]  # equal peaks: grow x16
    assert len(result.trials) <= 8


def test_other_errors_are_not_caught():
    def fits(b: int) -> Measurement:
        raise RuntimeError("a bug in the model")

    with pytest.raises(RuntimeError, match="a bug"):
        search(fits, 10**6, cap=64)


def test_fit_line_leaves_out_flat_sizes_and_interpolates():
    trials = [
        Measurement(2, True, 1000), Measurement(16, True, 1000),  # flat: equal peaks
        Measurement(64, True, 5000), Measurement(200, False, 12000), Measurement(128, True, 9000),
    ]
    line = fit_line(trials, limit_bytes=10_000)
    assert line.points == (128, 200)  # the nearest sizes on either side of the limit
    assert line.largest_under(10_000) == 152  # exactly on the limit at 152: exact arithmetic, no float slip
    assert fit_line(trials[:2], 10_000) is None


@st.composite
def memory_functions(draw):
    tensors = draw(st.lists(st.integers(1, 2**20), min_size=1, max_size=6))
    fixed = draw(st.integers(0, 2**30))
    kink = draw(st.integers(0, 600))  # sizes up to here are bound by the optimizer step
    peak = memory(fixed, tensors)
    optimizer_peak = peak(kink) if draw(st.booleans()) else 0
    peak = memory(fixed, tensors, optimizer_peak)
    target = draw(st.integers(0, 5000))
    limit = peak(target) + draw(st.integers(0, sum(tensors) + GRANULE * len(tensors)))
    headroom = draw(st.floats(0.0, 0.5))
    budget = int(limit / (1 - headroom))
    cap = draw(st.integers(1, 100_000))
    return peak, limit, budget, cap


@settings(max_examples=400, deadline=None)
@given(memory_functions())
def test_search_finds_the_largest_size_that_fits(case):
    peak, limit, budget, cap = case
    calls: list[int] = []
    result = search(meter(peak, limit, budget, calls), limit, cap)
    expected = truth(peak, limit, cap)
    assert (result.micro_batch_max or 0) == expected
    assert len(calls) == len(set(calls)) and all(1 <= b <= cap for b in calls)  # nothing measured twice
    assert len(calls) <= bound(cap)
    by_size = {t.micro_batch: t for t in result.trials}
    if expected:
        assert by_size[expected].fits  # never a size that was not measured to fit
        assert expected == cap or not by_size[expected + 1].fits  # the bracket was confirmed
    else:
        assert not by_size[1].fits


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=300), st.integers(0, 10**6), st.integers(1, 400))
def test_any_non_decreasing_peak(steps, limit, cap):
    """Not a line at all: a staircase. The answer and its bracket still hold; only the count may grow."""
    levels = sorted(steps)

    def peak(b: int) -> int:
        return levels[min(b, len(levels)) - 1]

    result = search(meter(peak, limit, limit), limit, cap)
    assert (result.micro_batch_max or 0) == truth(peak, limit, cap)
    assert len(result.trials) <= bound(cap)


def test_median_case_takes_at_most_five_trials():
    """Realistic shapes: activations of 4-30 tensors, a fixed part, sometimes an optimizer-bound start."""
    rng = random.Random(4)
    counts = []
    for _ in range(1500):
        tensors = [rng.randrange(2048, 2**20) for _ in range(rng.randrange(4, 30))]
        fixed = rng.randrange(2**20, 2**32)
        peak = memory(fixed, tensors)
        kink = rng.choice([0, 0, 1, 2, 4, 8])
        peak = memory(fixed, tensors, peak(kink) if kink else 0)
        limit = peak(rng.randrange(8, 4096)) + rng.randrange(0, sum(tensors))
        result = search(meter(peak, limit, int(limit / 0.9)), limit, cap=65_536)
        assert (result.micro_batch_max or 0) == truth(peak, limit, 65_536)
        counts.append(len(result.trials))
    assert statistics.median(counts) <= 5, statistics.median(counts)
    assert max(counts) <= bound(65_536)


# ---- the cost of a plan (pure) --------------------------------------------------------------------------


def test_micro_step_time_interpolates_and_scales():
    timings = [(2, 0.1), (10, 0.5)]
    assert micro_step_seconds(timings, 6) == pytest.approx(0.3)
    assert micro_step_seconds(timings, 10) == 0.5
    assert micro_step_seconds(timings, 20) == pytest.approx(1.0)  # beyond: in proportion to the nearest
    assert micro_step_seconds([], 4) is None


def test_cost_of_a_plan():
    c = cost([(8, 0.2), (16, 0.4)], micro_batch=16, accumulation_steps=4, effective_batch=64,
             sequence_length=128, optimizer_steps=1000)
    assert c.step_seconds == pytest.approx(1.6)
    assert c.samples_per_second == pytest.approx(40)
    assert c.tokens_per_second == pytest.approx(40 * 128)
    assert c.total_seconds == pytest.approx(1600)
    assert format_duration(c.total_seconds) == "26 min 40 s"
    assert format_duration(3.21) == "3.21 s" and format_duration(200_000) == "2 d 7 h"
