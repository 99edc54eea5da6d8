"""What `--policy throughput` chose and why (`Plan.throughput`): every exact split it timed and the reason for the
one chosen; pure Python (reproduce.throughput.policy times them)."""

from __future__ import annotations

from typing import Any, Literal

from .split import Frozen


class TimedSplit(Frozen):
    """One exact split the policy weighed: micro-batch x accumulation, and how fast its optimizer step was."""

    micro_batch: int
    accumulation_steps: int
    micro_step_seconds: float  # the optimizer step over its N micro-steps
    step_seconds: float  # one whole optimizer step: the median of the repeats (or the model's)
    samples_per_second: float
    tokens_per_second: float | None
    share_of_best: float  # samples/s over the best split's
    source: Literal["timed", "model"]
    chosen: bool = False
    spread: float | None = None  # the repeats' relative spread (twice their MAD over their median); None: a model
    repeats: list[float] | None = None  # seconds of one optimizer step, each repeat (re-timing included)
    timing_seconds: float | None = None  # every step this split ran while choosing, its warm-up included


class ThroughputChoice(Frozen):
    """The split `--policy throughput` chose among the exact ones, on what basis, and what choosing cost."""

    micro_batch: int
    accumulation_steps: int
    basis: Literal["measured", "model"]
    noise: float  # the relative difference the two fastest were compared within
    exact_splits: int  # the exact splits there were to choose from
    reason: str
    indistinguishable: list[int] | None = None  # the two fastest, when their difference is within the noise
    cost: dict[str, Any] | None = None  # what choosing cost in timed steps (a measured basis)
    candidates: list[TimedSplit]
    device: str | None = None  # where the splits were timed (None: a model, nothing timed)
    micro_batch_max: int

    def cost_line(self) -> str | None:
        """The cost of choosing: seconds of timed steps, in all and per split, against the bound."""
        cost = self.cost
        if not cost or not cost.get("per_split_seconds"):
            return None
        low, high = cost["per_split_seconds"]
        timed = len(self.candidates)
        line = (f"cost of choosing: {cost['seconds']:.3g} s of timed steps for {timed} splits ({low:.2g} to {high:.2g} "
                f"s each: a warm-up step, {cost['rounds']} interleaved rounds"
                + (f", {' and '.join(map(str, cost['retimed']))} re-timed" if cost["retimed"] else "")
                + f"), bound {cost['bound_seconds']:g} s"
                + (" (over it: the least it takes)" if cost["over_bound"] else ""))
        if cost.get("setup_seconds") is not None:
            line += f"; building the model {cost['setup_seconds']:.2g} s"
        if cost["left_out"]:
            line += f"; {len(cost['left_out'])} left out"
        return str(line)
