"""The default grouping chosen by measurement: when the probe ran, each exact way a recipe may take (`data.packing`
none, sorted, and packed where the model confines packed samples) runs whole optimizer steps on this device and
data, as `reproduce run` executes them (split_steps.SplitSteps: the model, optimizer and grouping the run builds,
through the attention the run uses), and the plan takes the fastest per target token (issue 51 item 3).

Every way's k-th step takes the same samples (SplitSteps' fixed order), so the ways are timed on the same windows;
the first step of each is left out (its caches, the model's first call). Every way is exact: the choice changes the
speed only, never the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..plan.overlay import Change, overlay
from ..plan.recipe import Recipe
from .splits import NotTimed

if TYPE_CHECKING:  # (torch is imported where the ways are timed: the session layer imports none at import)
    import torch

    from ..data import Datasets

STEPS = 2  # optimizer steps timed a way (after one left out), in each of REPEATS passes
REPEATS = 3


@dataclass(frozen=True)
class WayTimings:
    """Seconds of each way's timed steps, and the target tokens they trained (the same windows for every way)."""

    seconds: dict[str, float]
    tokens: int
    chosen: str

    def line(self) -> str:
        timed = ", ".join(f"{way} {self.tokens / seconds:,.0f}" for way, seconds in self.seconds.items())
        return (f"packing: {self.chosen}, the fastest exact way measured here: target tokens per second over the "
                f"same {STEPS} steps, the least of {REPEATS} passes: {timed}")


def time_ways(recipe: Recipe, ways: list[str], micro_batch: int, per_rank: int, data: Datasets,
              device: torch.device, steps: int = STEPS) -> WayTimings:
    """Each of `ways` (data.packing values) timed over `steps` whole optimizer steps of `per_rank` samples at the
    plan's micro-batch `micro_batch` (its T = micro_batch x the longest example), REPEATS times over the same windows,
    the least taken (the run's wall clock, CUDA synchronised: on a machine shared with other jobs one pass of a way
    varied 5x here, its least far less); a way out of memory is left out."""
    from ..probe.workload import Workload
    from .split_steps import SplitSteps

    seconds: dict[str, float] = {}
    tokens = 0
    for way in ways:
        timer = SplitSteps(Workload(overlay(recipe, [Change("data.packing", way)], "the ways' timing"), data), device,
                           per_rank, noise_scale=False)
        try:
            timer(micro_batch, 1)  # left out: its caches, the model's first call
            tokens = sum(_targets(data, timer.samples(k)) for k in range(1, steps + 1))  # the steps timed next
            timed = []
            for _ in range(REPEATS):  # the same windows each time: the least of them, as other jobs only add time
                timer.taken[micro_batch] = 1
                timed.append(timer(micro_batch, steps))
            seconds[way] = min(timed)
        except NotTimed:
            pass
        finally:
            timer.close()
    if not seconds:
        raise NotTimed(f"out of memory on {device} while timing the ways to group the data")
    return WayTimings(seconds, tokens, min(seconds, key=lambda way: seconds[way]))


def _targets(data: Datasets, indices: torch.Tensor) -> int:
    """The target tokens of a window's samples: what the run's loss divides by."""
    from ..data.batches import IGNORE_INDEX

    counts = getattr(data.train, "target_counts", None)
    if counts is not None:
        return int(counts(indices).sum())
    return sum(int((data.train[int(i)][1] != IGNORE_INDEX).sum()) for i in indices)
