"""The fastest exact split: how the splits are timed, and which to take. Pure Python, no torch.

Of the exact splits m x N x W (m <= the largest that fits), `throughput` takes the one whose optimizer step is
shortest (each runs the same per-process batch). `time_splits` times them by a function running whole steps
(split_steps.py): (1) a warm-up step of each, largest first, never counted; (2) `REPEATS` rounds (at least
`MIN_REPEATS`), each split once a round in a rotated order, so a busy spell slows all alike; a repeat is one step,
or the mean of several when a step is under `MIN_REPEAT_SECONDS`; (3) each split's median and `relative_spread`;
(4) the two fastest compared round by round (`paired`: the median of the rounds' ratios, cancelling the load both
share, against twice its standard error, at least `NOISE_FLOOR`): within that noise they are re-timed side by side
for `RETIME_ROUNDS` rounds, and still within it the larger micro-batch is taken (fewer, larger kernels; the
optimizer step amortised over more samples). Choosing is bounded by `BUDGET_SECONDS` of timed steps: warm-ups stop
at `WARM_UP_SHARE` of it, then the slowest splits are left out (never the largest) and the rounds cut to
`MIN_REPEATS`; a smaller bound is exceeded, and the plan's `throughput.cost` says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..plan.throughput_choice import ThroughputChoice, TimedSplit

REPEATS = 5  # timed rounds when the budget allows
MIN_REPEATS = 3  # timed rounds whatever the budget
RETIME_ROUNDS = 3  # more rounds of the two fastest when they are within their spread
NOISE_FLOOR = 0.03  # the smallest relative difference taken as real, whatever the repeats' spread says
MEDIAN_SE = 1.858  # a median's standard error per MAD / sqrt(n), for normal noise (1.4826 x 1.2533)
BUDGET_SECONDS = 60.0  # timed steps allowed for choosing (warm-ups, rounds and re-timing)
WARM_UP_SHARE = 0.5  # of the budget, for the warm-up steps
MIN_REPEAT_SECONDS = 0.2  # a repeat shorter than this is several steps back to back (a preempted slice of a
# few ms is then a few % of it: the digits MLP's 1 ms steps, 25 to a repeat, spread by 20-30% on the shared machine)
MAX_STEPS_PER_REPEAT = 200

RunSteps = Callable[[int, int], float]  # (micro-batch, steps) -> seconds those whole optimizer steps took


class NotTimed(Exception):
    """A split that could not be timed (out of memory on the device): left out, with this reason."""


@dataclass
class SplitTiming:
    """One split's timing: its warm-up step, its repeats (seconds per optimizer step) and what it all cost."""

    micro_batch: int
    warm_up: float
    steps_per_repeat: int
    repeats: list[float] = field(default_factory=list)
    seconds: float = 0.0  # every step this split ran while choosing, the warm-up included

    @property
    def median(self) -> float:
        return statistics.median(self.repeats)

    @property
    def spread(self) -> float:
        return relative_spread(self.repeats)

    @property
    def repeat_seconds(self) -> float:
        """What one repeat costs, by the warm-up step (an overestimate: first calls are slower)."""
        return self.steps_per_repeat * self.warm_up


@dataclass
class Timings:
    """What `time_splits` measured: the splits timed (>= MIN_REPEATS repeats each), those left out and why."""

    timed: dict[int, SplitTiming]
    left_out: dict[int, str]
    rounds: int
    retimed: tuple[int, int] | None
    budget: float
    left_out_seconds: float = 0.0  # steps of splits dropped after their warm-up (counted in the cost)
    setup_seconds: float | None = None  # building the model, optimizer and data once (outside the bound)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.timed.values()) + self.left_out_seconds

    def cost(self) -> dict:
        """The cost of choosing, for the plan: seconds of timed steps, in all and per split, against the bound."""
        per = [t.seconds for t in self.timed.values()]
        return {"seconds": round(self.seconds, 3), "bound_seconds": self.budget,
                "setup_seconds": round(self.setup_seconds, 3) if self.setup_seconds is not None else None,
                "over_bound": self.seconds > self.budget, "rounds": self.rounds,
                "retimed": list(self.retimed) if self.retimed else None,
                "per_split_seconds": [round(min(per), 3), round(max(per), 3)] if per else None,
                "left_out": {str(m): why for m, why in self.left_out.items()}}


def steps_per_repeat(warm_up_seconds: float) -> int:
    """Optimizer steps in one repeat: enough to last `MIN_REPEAT_SECONDS` by the warm-up step, 1 to the maximum."""
    if warm_up_seconds <= 0:
        return MAX_STEPS_PER_REPEAT
    return max(1, min(MAX_STEPS_PER_REPEAT, math.ceil(MIN_REPEAT_SECONDS / warm_up_seconds)))


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """(gap, noise) of two splits' repeats taken in the same rounds: gap, the median of the rounds' ratios b / a less
    1 (negative: b is faster); noise, twice that median's standard error, at least `NOISE_FLOOR`. Pairing by round
    cancels the machine's load common to both, which the repeats' own spread keeps."""
    ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
    if not ratios:
        return 0.0, NOISE_FLOOR
    middle = statistics.median(ratios)
    deviation = statistics.median(abs(r - middle) for r in ratios)
    return middle - 1, max(NOISE_FLOOR, 2 * MEDIAN_SE * deviation / math.sqrt(len(ratios)) / middle)


def time_splits(splits: list[int], run_steps: RunSteps, budget: float = BUDGET_SECONDS) -> Timings:
    """Time every exact split (`splits`, largest first) by `run_steps`, within `budget` seconds of timed steps."""
    timed: dict[int, SplitTiming] = {}
    left_out: dict[int, str] = {}
    spent = dropped_seconds = 0.0
    for m in splits:  # 1. warm-up, largest first
        if len(timed) >= 2 and spent > WARM_UP_SHARE * budget:
            left_out[m] = f"not timed: the warm-up steps had taken {spent:.3g} s of the {budget:g} s bound"
            continue
        try:
            seconds = run_steps(m, 1)
        except NotTimed as error:
            left_out[m] = str(error)
            continue
        spent += seconds
        timed[m] = SplitTiming(m, seconds, steps_per_repeat(seconds), seconds=seconds)

    def needed(rounds: int) -> float:
        one_round = sum(t.repeat_seconds for t in timed.values())
        retime = RETIME_ROUNDS * 2 * max((t.repeat_seconds for t in timed.values()), default=0.0)
        return rounds * one_round + retime

    while len(timed) > 2 and needed(MIN_REPEATS) > budget - spent:  # 2. the slowest left out, never the largest
        slowest = max((m for m in timed if m != splits[0]), key=lambda m: timed[m].warm_up)
        dropped_seconds += timed.pop(slowest).seconds
        left_out[slowest] = "not timed: its warm-up step was the slowest, and the rounds would exceed the bound"
    rounds = REPEATS
    while rounds > MIN_REPEATS and needed(rounds) > budget - spent:
        rounds -= 1

    def time_round(order: list[int]) -> None:
        for m in order:
            if m not in timed:
                continue
            t = timed[m]
            try:
                seconds = run_steps(m, t.steps_per_repeat)
            except NotTimed as error:
                nonlocal dropped_seconds
                dropped_seconds += timed.pop(m).seconds
                left_out[m] = str(error)
                continue
            t.seconds += seconds
            t.repeats.append(seconds / t.steps_per_repeat)

    order = list(timed)
    for r in range(rounds):  # 3. interleaved rounds, the order rotated
        shift = r % len(order) if order else 0
        time_round(order[shift:] + order[:shift])
    retimed = None
    ranked = sorted(timed, key=lambda m: (timed[m].median, -m))  # fastest first; equal: the larger micro-batch
    gap, noise = paired(timed[ranked[0]].repeats, timed[ranked[1]].repeats) if len(ranked) >= 2 else (1.0, 0.0)
    if abs(gap) <= noise:  # 4. the top two again
        pair = ranked[:2]
        retimed = (max(pair), min(pair))
        for r in range(RETIME_ROUNDS):
            time_round(pair if r % 2 else pair[::-1])
    return Timings(timed, left_out, rounds, retimed, budget, dropped_seconds)


def exact_splits(per_rank_batch: int, cap: int) -> list[int]:
    return [m for m in range(min(cap, per_rank_batch), 0, -1) if per_rank_batch % m == 0]


def choose(
    splits: list[int], per_rank_batch: int, step_seconds: dict[int, float], sources: dict[int, str],
    sequence_length: int | None, batchnorm_micro_batch: int | None = None, basis: str = "measured",
    micro_batch_max: int = 0, timings: Timings | None = None, device: str | None = None,
    unkept_batchnorm: int | None = None,
) -> ThroughputChoice:
    """The exact split with the shortest optimizer step. The two fastest are compared round by round with
    `timings` (which replace `step_seconds`), else within `NOISE_FLOOR` (a model's times): within the noise the
    larger wins. `batchnorm_micro_batch`, the paper's per-device batch, is kept whatever the timings say (else, as
    `unkept_batchnorm`, it is named after the reason); `device`: where the splits were timed (None: a model)."""

    def chosen(micro: int, candidates: list[TimedSplit], reason: str, noise: float = NOISE_FLOOR,
               pair: list[int] | None = None) -> ThroughputChoice:
        if unkept_batchnorm:
            reason += f" (BatchNorm statistics over {micro}, not the paper's {unkept_batchnorm})"
        return ThroughputChoice(
            micro_batch=micro, accumulation_steps=per_rank_batch // micro, basis=basis, noise=noise, reason=reason,
            exact_splits=len(splits), indistinguishable=pair, cost=cost, candidates=candidates, device=device,
            micro_batch_max=micro_batch_max)

    if not splits:
        raise ValueError("no exact split to choose from")
    if timings is not None:
        step_seconds = {m: t.median for m, t in timings.timed.items()}
    shown = sorted((m for m in step_seconds if m in splits), reverse=True)
    nothing = ("only micro-batch 1 fits: nothing to choose" if micro_batch_max == 1 else
               f"one exact split ({splits[0]} x {per_rank_batch // splits[0]}): nothing to choose"
               if len(splits) == 1 else None)
    cost = timings.cost() if timings is not None else None
    if not shown:  # nothing timed: the largest, for want of a measurement
        micro = batchnorm_micro_batch or splits[0]
        return chosen(micro, [], nothing or "no step was timed: the largest exact micro-batch")
    ranked = sorted(shown, key=lambda m: (step_seconds[m], -m))
    best, pair, noise = ranked[0], None, NOISE_FLOOR
    what = "modelled" if basis == "model" else "timed"
    retimed = ""
    micro = best
    if len(ranked) > 1:
        runner_up = ranked[1]
        rounds = ""
        if timings is not None:  # the two fastest compared round by round (their re-timing included)
            gap, noise = paired(timings.timed[best].repeats, timings.timed[runner_up].repeats)
            if gap < 0:  # paired, the runner-up is the faster
                best, runner_up, gap = runner_up, best, 1 / (1 + gap) - 1
            # the rounds both were timed in; the re-timing's, when it was these two
            both = min(len(timings.timed[best].repeats), len(timings.timed[runner_up].repeats))
            rounds = f", paired over {both} rounds"
            if timings.retimed and set(timings.retimed) == {best, runner_up}:
                retimed = " after re-timing both"
            elif timings.retimed:
                retimed = f"; {timings.retimed[0]} and {timings.retimed[1]} re-timed"
        else:
            gap = step_seconds[runner_up] / step_seconds[best] - 1
        micro = best
        if gap <= noise:
            pair, micro = sorted((best, runner_up), reverse=True), max(best, runner_up)
            reason = (f"micro-batch {pair[0]} and {pair[1]} are indistinguishable ({best} faster by {gap:.1%}{rounds}, "
                      f"within the noise of {noise:.1%}{retimed}): the larger micro-batch, {micro}")
        else:
            reason = (f"micro-batch {micro}: the most samples per second of the {len(shown)} {what} ({gap:+.1%} "
                      f"over micro-batch {runner_up}{rounds}, beyond the noise of {noise:.1%}{retimed})")
    else:
        reason = f"micro-batch {micro}: the only split {what}"
    if nothing:
        reason = nothing
    if basis == "model":
        reason += " (a model, not a measurement: nothing was timed)"
    best_rate = per_rank_batch / min(step_seconds[m] for m in shown)
    if batchnorm_micro_batch is not None and batchnorm_micro_batch in splits and batchnorm_micro_batch != micro:
        kept = batchnorm_micro_batch
        share = (f"{per_rank_batch / step_seconds[kept] / best_rate:.0%} of the best rate" if kept in shown
                 else "not timed")
        reason = (f"micro-batch {kept}: the paper's per-device batch, kept for BatchNorm (its statistics over the "
                  f"paper's samples; {share}); by throughput alone: {micro}")
        micro = kept
    candidates = [_timed_split(m, micro, per_rank_batch, step_seconds[m], best_rate, sequence_length, sources,
                               timings.timed[m] if timings is not None else None) for m in shown]
    return chosen(micro, candidates, reason, noise, pair)


def _timed_split(m: int, chosen: int, per_rank_batch: int, seconds: float, best_rate: float,
                 sequence_length: int | None, sources: dict[int, str], timing: SplitTiming | None) -> TimedSplit:
    """Micro-batch `m`'s row among the candidates: its step's rates, its share of the best one, its timing."""
    n = per_rank_batch // m
    samples = per_rank_batch / seconds
    return TimedSplit(
        micro_batch=m, accumulation_steps=n, micro_step_seconds=seconds / n, step_seconds=seconds,
        samples_per_second=samples, tokens_per_second=samples * sequence_length if sequence_length else None,
        share_of_best=samples / best_rate, source=sources.get(m, "timed"), chosen=m == chosen,
        spread=timing.spread if timing else None,
        repeats=[round(r, 6) for r in timing.repeats] if timing else None,
        timing_seconds=round(timing.seconds, 4) if timing else None,
    )


def relative_spread(samples: list[float]) -> float:
    """Twice the median absolute deviation of repeated timings over their median (robust to the one repeat a busy
    machine slows; about 1.35 standard deviations): the noise a difference has to exceed to count."""
    if len(samples) < 2:
        return 0.0
    middle = statistics.median(samples)
    if middle <= 0:
        return 0.0
    return 2 * statistics.median(abs(s - middle) for s in samples) / middle


def model_micro_step(micro_batch: int, flops_per_sample: float, peak_flops: float, mfu: float,
                     weight_bytes: float | None = None, bandwidth: float | None = None) -> float:
    """A micro-step's seconds by the FLOPs model (the estimate meter times nothing): the larger of its compute time
    at the assumed MFU and the time to read the weights three times (forward, backward of the activations and of the
    weights) at the memory bandwidth, when both are known. Never a measurement."""
    compute = micro_batch * flops_per_sample / (peak_flops * mfu)
    memory = 3 * weight_bytes / bandwidth if weight_bytes and bandwidth else 0.0
    return max(compute, memory)
