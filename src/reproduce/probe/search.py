"""The search for the largest micro-batch that fits: a pure function over `fits(b) -> Measurement`, no torch.

The model: a step's peak is the larger of the optimizer step's (constant in b) and a line a + c*b (a >= 0). So a
size b with peak p bounds every larger one, peak(k) <= p * k / b: `safe = floor(limit * b / p)` fits for certain.
The search grows by that jump or by doubling (x16 while peaks are flat), whichever is more, until two sizes are on
the line; their line predicts the largest b under the limit (equal peaks are optimizer-bound, left out of the fit:
`fit_line`). Each prediction is measured, then the next size up, until b fits and b + 1 does not. A contradicted
prediction, or `MAX_MISSES` out-of-memory ones, switch to bisection (geometric while wide). Sizes are capped at
`cap`, the per-rank batch. The answer is always a size measured to fit, or None. The peak is really a maximum of
several lines (optimizer step, end of backward, end of forward): small models bend most and take more trials.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction

FIRST_SIZE = 2  # 1 is often optimizer-bound, which says nothing about the activations' slope
MAX_MISSES = 3  # line-guided sizes that ran out of memory (no peak) before the search trusts only bisection
MAX_GUIDED = 8  # line-guided trials in all (bounds the creep of a line that is always one short)
FLAT_GROWTH = 16  # growth while the peaks are flat: the activations are small beside the fixed part


@dataclass(frozen=True)
class Measurement:
    """One trial at `micro_batch`: did its training step fit, and at what peak."""

    micro_batch: int
    fits: bool
    peak_bytes: int | None  # the peak that decides (CUDA: reserved); None when the trial ran out of memory
    seconds: float = 0.0  # wall time of the whole trial (build, warm-up, measured steps)
    step_seconds: float | None = None  # one training step at this size, when it was timed
    tensor_bytes: int | None = None  # the tensors' own peak (CUDA: allocated), for the report
    note: str | None = None  # why it did not fit
    parts: dict | None = None  # what the peak is made of, when the meter can tell (the estimate's categories)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Line:
    """peak(b) = intercept + slope * b, through two measured sizes and their peaks."""

    points: tuple[int, int]
    peaks: tuple[int, int]

    @property
    def slope(self) -> float:
        return (self.peaks[1] - self.peaks[0]) / (self.points[1] - self.points[0])

    @property
    def intercept(self) -> float:
        return self.peaks[1] - self.slope * self.points[1]

    def largest_under(self, limit_bytes: float) -> int | None:
        """The largest b with at(b) <= limit (exact arithmetic); None when the line does not grow."""
        (b0, b1), (p0, p1) = self.points, self.peaks
        if p1 <= p0:
            return None
        return b0 + math.floor(Fraction(limit_bytes - p0) * (b1 - b0) / (p1 - p0))


@dataclass(frozen=True)
class SearchResult:
    micro_batch_max: int | None  # the largest size measured to fit (None: not even size 1)
    trials: list[Measurement]  # in the order they ran
    line: Line | None  # the last line the search fitted
    cap: int
    limit_bytes: int

    @property
    def chosen(self) -> Measurement | None:
        return next((t for t in self.trials if t.micro_batch == self.micro_batch_max and t.fits), None)

    @property
    def capped(self) -> bool:
        """The answer is the cap itself: larger sizes were not tried because they are not needed."""
        return self.micro_batch_max == self.cap

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.trials)


def fit_line(trials: list[Measurement], limit_bytes: float) -> Line | None:
    """The line through two sizes in the activation regime (equal peaks left out), to predict where peak = limit:
    the nearest two on both sides of the limit, else the largest and the largest at most half of it (far apart,
    so the allocator's rounding averages out)."""
    known = {t.micro_batch: t.peak_bytes for t in trials if t.peak_bytes is not None}
    peaks = list(known.values())
    points = sorted((b, p) for b, p in known.items() if peaks.count(p) == 1)
    below = [pt for pt in points if pt[1] <= limit_bytes]
    above = [pt for pt in points if pt[1] > limit_bytes]
    if below and above:
        first, second = below[-1], above[0]
    elif len(points) >= 2:
        second = points[-1]
        halves = [pt for pt in points[:-1] if 2 * pt[0] <= second[0]]
        first = halves[-1] if halves else points[-2]
    else:
        return None
    if first[0] >= second[0]:
        return None
    return Line((first[0], second[0]), (first[1], second[1]))


def search(fits: Callable[[int], Measurement], limit_bytes: int, cap: int,
           on_trial: Callable[[Measurement], None] | None = None) -> SearchResult:
    """The largest micro-batch in [1, cap] that `fits`, with every trial (each shown to `on_trial`)."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1 (got {cap})")
    trials: list[Measurement] = []
    lo, hi = 0, cap + 1  # lo: the largest size measured to fit (0: none); hi: the smallest known not to
    failed = False  # hi was measured (not just the cap + 1 that needs no trial)
    line, guided, misses = None, 0, 0
    size, from_line = min(FIRST_SIZE, cap), False
    while True:
        result = fits(size)
        if on_trial is not None:
            on_trial(result)
        if result.micro_batch != size:
            raise ValueError(f"fits({size}) reported micro_batch {result.micro_batch}")
        trials.append(result)
        if result.fits:
            lo = size
        else:
            hi, failed = size, True
        guided += from_line
        misses += from_line and result.peak_bytes is None  # a failure with a peak still places the line
        if hi - lo <= 1:
            break

        size, from_line = None, False
        line = fit_line(trials, limit_bytes) or line
        predicted = line.largest_under(limit_bytes) if line is not None else None
        if predicted is not None and misses < MAX_MISSES and guided < MAX_GUIDED:
            if min(predicted, cap) <= lo:
                size, from_line = lo + 1, True  # the line says lo is the maximum: confirm the next size fails
            elif predicted < hi or not failed:  # (not failed: hi is cap + 1, and past the cap means the cap)
                size, from_line = min(predicted, cap), True
        if size is None and not failed:  # nothing failed yet: jump to the size known to be safe
            best = max((t for t in trials if t.fits), key=lambda t: t.micro_batch)
            flat = sum(t.peak_bytes == best.peak_bytes for t in trials) > 1  # still optimizer-bound: grow fast
            b, p = best.micro_batch, best.peak_bytes
            safe = math.floor(limit_bytes * b / p) if p else 2 * b  # the size known to fit: peak(k) <= p * k / b
            size = max((FLAT_GROWTH if flat else 2) * lo, safe)
        elif size is None:  # the line is spent, or contradicts a measurement: bisect
            size = math.isqrt(max(lo, 1) * hi) if hi > 4 * max(lo, 1) else (lo + hi) // 2
        size = min(max(size, lo + 1), hi - 1)

    return SearchResult(lo or None, trials, line, cap, limit_bytes)
