"""The fastest exact split: which micro-batches to time, and which to take. Pure Python, no torch.

Among the exact splits m x N x W = the paper's batch with m <= the largest micro-batch that fits, the policy
`throughput` takes the one with the most samples per second. An optimizer step of split (m, N) costs N micro-steps
of t(m) seconds (the probe's timing: a window's step divided by its micro-batches, the optimizer step shared
among them), so its rate is m / t(m) samples per second, the same for every N.

The search (`next_size`) times few splits, not all of them: it starts from the largest, then tries about half of
the last size tried (the largest exact m at most half of it), and stops as soon as a smaller size is not faster
than the best so far by more than the noise, or after `MAX_TIMED` sizes. Throughput on GPUs rises with m and then
flattens (LitGPT issue 678: micro-batch 1 and 4 at virtually the same speed), so a smaller split only wins when
it is measurably faster; ties within the measurement's noise go to the larger micro-batch (fewer, larger kernels
and optimizer steps amortised over more samples). `choose` makes the choice from the timings, whatever gathered
them; throughput_plan.py gathers them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

MAX_TIMED = 4  # sizes timed in all by the search (the largest included)
NOISE_FLOOR = 0.03  # the smallest relative difference taken as real, whatever the repeats' spread says


def rates(micro_batch: int, step_seconds: float | None, sequence_length: int | None) -> tuple[float | None, ...]:
    """(samples/s, tokens/s) of one micro-step of `micro_batch` samples taking `step_seconds`; None untimed."""
    if not step_seconds:
        return None, None
    samples = micro_batch / step_seconds
    return round(samples, 3), round(samples * sequence_length, 3) if sequence_length else None


def exact_splits(per_rank_batch: int, cap: int) -> list[int]:
    """The micro-batches m <= cap that divide the per-process batch, largest first."""
    return [m for m in range(min(cap, per_rank_batch), 0, -1) if per_rank_batch % m == 0]


def next_size(splits: list[int], timed: dict[int, float], noise: float = NOISE_FLOOR) -> int | None:
    """The next micro-batch to time (None: the search is done), given the micro-step seconds timed so far.

    Sizes the probe's trials timed count as timed (and are not timed again), but only the sizes the search
    itself visits decide when it stops.
    """
    if not splits:
        return None
    largest = splits[0]
    if largest not in timed:
        return largest
    visited = [largest]
    while True:
        last = visited[-1]
        smaller = [m for m in splits if m <= last // 2] or [m for m in splits if m < last][:1]
        if not smaller:
            return None
        candidate = smaller[0]
        if candidate not in timed:
            return candidate if len(visited) < MAX_TIMED else None
        best = max(visited, key=lambda m: m / timed[m])
        if candidate / timed[candidate] <= (best / timed[best]) * (1 + noise):  # not faster: stop here
            return None
        visited.append(candidate)


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    accumulation_steps: int
    micro_step_seconds: float
    step_seconds: float  # one optimizer step: N micro-steps
    samples_per_second: float
    tokens_per_second: float | None
    share_of_best: float  # samples/s over the best candidate's
    source: str  # "probe trial", "timed" or "model"
    chosen: bool = False

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    micro_batch: int
    accumulation_steps: int
    candidates: list[Candidate]
    reason: str
    basis: str  # "measured" or "model"
    noise: float
    splits: int  # exact splits there were to choose from

    def to_json(self) -> dict:
        return {"micro_batch": self.micro_batch, "accumulation_steps": self.accumulation_steps,
                "basis": self.basis, "noise": self.noise, "exact_splits": self.splits, "reason": self.reason,
                "candidates": [c.to_json() for c in self.candidates]}


def choose(
    splits: list[int],
    per_rank_batch: int,
    timed: dict[int, float],
    sources: dict[int, str],
    sequence_length: int | None,
    noise: float = NOISE_FLOOR,
    batchnorm_micro_batch: int | None = None,
    basis: str = "measured",
    micro_batch_max: int | None = None,
) -> Decision:
    """The exact split with the most samples per second among the timed ones (`timed`: micro-step seconds).

    Within `noise` of the best rate, the largest micro-batch wins. `batchnorm_micro_batch`: the paper's per-device
    batch, kept whatever the timings say (BatchNorm statistics over the paper's samples); the candidates are still
    listed so the cost of that choice is seen.
    """
    if not splits:
        raise ValueError("no exact split to choose from")
    noise = max(noise, NOISE_FLOOR)
    shown = sorted((m for m in timed if m in splits), reverse=True)
    nothing = ("only micro-batch 1 fits: nothing to choose" if micro_batch_max == 1 else
               f"one exact split ({splits[0]} x {per_rank_batch // splits[0]}): nothing to choose"
               if len(splits) == 1 else None)
    if not shown:  # nothing timed: the largest, for want of a measurement
        micro = batchnorm_micro_batch or splits[0]
        return Decision(micro, per_rank_batch // micro, [], nothing or "no step was timed: the largest exact "
                        "micro-batch", basis, noise, len(splits))
    rate = {m: m / timed[m] for m in shown}
    best_rate = max(rate.values())
    fastest = max(shown, key=lambda m: rate[m])
    within = [m for m in shown if rate[m] >= best_rate / (1 + noise)]
    micro = max(within)
    if nothing:
        reason = nothing
    elif micro == fastest:
        reason = f"micro-batch {micro}: the most samples per second of the {len(shown)} " + (
            "modelled" if basis == "model" else "timed")
        if len(within) == 1 and len(shown) > 1:
            runner_up = max((m for m in shown if m != micro), key=lambda m: rate[m])
            reason += f" ({rate[micro] / rate[runner_up] - 1:+.0%} over micro-batch {runner_up})"
    else:
        reason = (f"micro-batch {micro}: within the noise ({noise:.0%}) of the fastest, micro-batch {fastest} "
                  f"({rate[micro] / best_rate - 1:+.1%}); ties go to the larger micro-batch")
    if basis == "model":
        reason += " (a model, not a measurement: nothing was timed)"
    if batchnorm_micro_batch is not None and batchnorm_micro_batch in splits and batchnorm_micro_batch != micro:
        kept = batchnorm_micro_batch
        share = f"{rate[kept] / best_rate:.0%} of the best rate" if kept in rate else "not timed"
        reason = (f"micro-batch {kept}: the paper's per-device batch, kept for BatchNorm (its statistics over the "
                  f"paper's samples; {share}); by throughput alone: {micro}")
        micro = kept
    candidates = []
    for m in shown:
        n = per_rank_batch // m
        samples = rate[m]
        candidates.append(Candidate(
            micro_batch=m, accumulation_steps=n, micro_step_seconds=timed[m], step_seconds=n * timed[m],
            samples_per_second=samples, tokens_per_second=samples * sequence_length if sequence_length else None,
            share_of_best=samples / best_rate, source=sources.get(m, "timed"), chosen=m == micro,
        ))
    return Decision(micro, per_rank_batch // micro, candidates, reason, basis, noise, len(splits))


def relative_spread(samples: list[float]) -> float:
    """The noise a difference has to exceed to count: twice the median absolute deviation of repeated timings over
    their median (robust to the one repeat a busy machine slows down; about 1.35 standard deviations)."""
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
