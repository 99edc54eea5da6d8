"""What a plan costs on the probed device, from the step times its trials measured. No torch.

A micro-step of size m takes t(m) seconds: interpolated between the two measured sizes around m (or
scaled in proportion from the nearest one). An optimizer step is N micro-steps on each of the W
processes at once: N x t(m) seconds, ignoring the gradient all-reduce between processes. From it:
samples (and tokens) per second, and the wall time of the whole schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Cost:
    micro_batch: int
    accumulation_steps: int
    micro_step_seconds: float
    step_seconds: float  # one optimizer step: N micro-steps
    samples_per_second: float
    tokens_per_second: float | None
    optimizer_steps: int | None
    total_seconds: float | None  # the whole schedule, on this device

    def to_json(self) -> dict:
        return asdict(self)


def micro_step_seconds(timings: Iterable[tuple[int, float]], micro_batch: int) -> float | None:
    """t(micro_batch) from measured (size, seconds) pairs; None when nothing was timed."""
    points = sorted({size: seconds for size, seconds in timings if seconds}.items())
    if not points:
        return None
    below = [p for p in points if p[0] <= micro_batch]
    above = [p for p in points if p[0] >= micro_batch]
    if below and above:
        (b0, t0), (b1, t1) = below[-1], above[0]
        if b0 == b1:
            return t0
        return t0 + (t1 - t0) * (micro_batch - b0) / (b1 - b0)
    size, seconds = (below or above)[-1 if below else 0]
    return seconds * micro_batch / size


def cost(
    timings: Iterable[tuple[int, float]],
    micro_batch: int,
    accumulation_steps: int,
    effective_batch: int,
    sequence_length: int | None,
    optimizer_steps: int | None,
) -> Cost | None:
    micro = micro_step_seconds(timings, micro_batch)
    if micro is None:
        return None
    step = accumulation_steps * micro
    samples = effective_batch / step
    return Cost(
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        micro_step_seconds=micro,
        step_seconds=step,
        samples_per_second=samples,
        tokens_per_second=samples * sequence_length if sequence_length else None,
        optimizer_steps=optimizer_steps,
        total_seconds=step * optimizer_steps if optimizer_steps is not None else None,
    )


def format_duration(seconds: float) -> str:
    """3.2 s, 4 min 10 s, 2 h 05 min, 3 d 4 h."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"
