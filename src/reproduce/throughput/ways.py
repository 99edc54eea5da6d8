"""The default grouping chosen by measurement: when the probe ran, each exact way a recipe may take (`data.packing`
none, sorted, and packed where the model confines packed samples) runs whole optimizer steps on this device and
data, as `reproduce run` executes them (split_steps.SplitSteps: the model, optimizer and grouping the run builds,
through the attention the run uses), and the plan takes the fastest per target token (issue 51 item 3).

One model serves every way (one build, one model's memory, not one per way): it is built as the last way of the
list builds it (packed: the varlen attention, models/varlen.py), and each way's passes regroup the same windows
and switch the attention to the one that way's run builds (sdpa for none and sorted). Every way's k-th step takes
the same samples (SplitSteps' fixed order), so the ways are timed on the same windows; the first step of each is
left out (its caches, the model's first call). On a CPU the ways are ranked by the process's CPU time over their
steps (`clock`: what bench/packing.py ranks by): on a machine shared with other jobs the wall clock also counts the
time the process waited for a core, which two timings of one plan under load found to change the choice (sorted,
then none); on CUDA by the wall clock of synchronised steps (the host's load does not slow the kernels). The ways'
passes are interleaved (each pass times every way once, the order rotated), so a busy spell slows every way alike,
and each way's least pass is taken (other jobs only add time). The plan's cost is the chosen way's wall clock (what
a run's steps take). Every way is exact: the choice changes the speed only, never the update.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..plan.overlay import Change, overlay
from ..plan.recipe import Recipe
from .splits import NotTimed

if TYPE_CHECKING:  # (torch is imported where the ways are timed: the session layer imports none at import)
    import torch

    from ..data import Datasets

STEPS = 2  # optimizer steps timed a way (after one left out), in each of PASSES passes
PASSES = 3


@dataclass(frozen=True)
class WayTimings:
    """What `time_ways` measured: each way's least pass over `steps` steps by `clock` ("cpu" or "wall"), the way
    chosen, and `wall`, the wall clock of that pass (the plan's cost); `tokens` target tokens, `per_rank` samples."""

    seconds: dict[str, float]
    tokens: int
    chosen: str
    steps: int = STEPS
    passes: int = PASSES
    per_rank: int = 0
    micro_batch: int = 0  # the plan's, whose T the packed and sorted ways grouped by
    clock: str = "wall"
    wall: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        timed = ", ".join(f"{way} {self.tokens / seconds:,.0f}" for way, seconds in self.seconds.items())
        return (f"packing: {self.chosen}, the fastest exact way measured here: target tokens per {UNITS[self.clock]} "
                f"over the same {self.steps} steps, the least of {self.passes} interleaved passes: {timed}")

    def to_json(self) -> dict:
        """What was measured, for the plan (`plan --json`'s `packing.timed`): each way's wall-clock step (the plan's
        cost) and its rate by the clock it was ranked by."""
        return {"chosen": self.chosen, "steps": self.steps, "passes": self.passes, "samples_per_step": self.per_rank,
                "micro_batch": self.micro_batch,
                "target_tokens": self.tokens,
                "ranked_by": self.clock,
                "measured": f"{MEASURED[self.clock]} of whole optimizer steps of the same windows per way, on one "
                            "model, the ways' passes interleaved, each way's least pass",
                "ways": {way: {"step_seconds": round(self.wall.get(way, seconds) / self.steps, 6),
                               f"target_tokens_per_{'cpu_' if self.clock == 'cpu' else ''}second":
                                   round(self.tokens / seconds, 3)}
                         for way, seconds in self.seconds.items()}}


UNITS = {"cpu": "CPU second (the process's CPU time)", "wall": "second (wall clock, CUDA synchronised)"}
MEASURED = {"cpu": "the process's CPU seconds", "wall": "wall-clock seconds (CUDA synchronised)"}


def clock(device: torch.device) -> tuple[str, Callable[[], float]]:
    """What the ways are ranked by on `device` (the module's notes say why)."""
    return ("cpu", time.process_time) if device.type == "cpu" else ("wall", time.perf_counter)


def time_ways(recipe: Recipe, ways: list[str], micro_batch: int, per_rank: int, data: Datasets,
              device: torch.device, steps: int = STEPS, passes: int = PASSES) -> WayTimings:
    """Each of `ways` (data.packing values) timed over `steps` whole optimizer steps of `per_rank` samples at the
    plan's micro-batch `micro_batch` (its T = micro_batch x the longest example, or the recipe's data.token_budget),
    in `passes` interleaved passes (the module's notes); a way out of memory is left out."""
    from ..models.varlen import set_attention
    from ..probe.workload import Workload
    from .split_steps import SplitSteps

    built_as = "packed" if "packed" in ways else ways[-1]
    timer = SplitSteps(Workload(overlay(recipe, [Change("data.packing", built_as)], "the ways' timing"), data),
                       device, per_rank, noise_scale=False)
    kind, tick = clock(device)

    def timed(way: str, window: int, count: int) -> tuple[float, float]:
        """(seconds by the clock, wall-clock seconds) of `count` steps of `way` from window `window`."""
        timer.grouping, timer.dataset, attention = groupings[way]  # that way's windows and attention, one model
        if attention is not None:
            set_attention(timer.setup.model, attention)
        timer.taken[micro_batch] = window  # the same windows for every way
        start = tick()
        wall = timer(micro_batch, count)
        return (tick() - start if kind == "cpu" else wall), wall

    try:
        groupings = {way: _grouping(timer, recipe, way, micro_batch) for way in ways}
        times: dict[str, list[tuple[float, float]]] = {}
        for way in ways:  # left out: its caches, the model's first call (the same first window for every way)
            with contextlib.suppress(NotTimed):
                timed(way, 0, 1)
                times[way] = []
        order = list(times)
        for p in range(passes):  # the same windows each pass, the ways interleaved, the order rotated
            shift = p % len(order) if order else 0
            for way in order[shift:] + order[:shift]:
                if way not in times:
                    continue
                try:
                    times[way].append(timed(way, 1, steps))
                except NotTimed:
                    del times[way]
        tokens = sum(_targets(data, timer.samples(k)) for k in range(1, steps + 1))  # the steps timed
    finally:
        timer.close()
    least = {way: min(runs) for way, runs in times.items() if runs}
    if not least:
        raise NotTimed(f"out of memory on {device} while timing the ways to group the data")
    seconds = {way: ranked for way, (ranked, _) in least.items()}
    return WayTimings(seconds, tokens, min(seconds, key=lambda way: seconds[way]), steps, passes, per_rank,
                      micro_batch, kind, {way: wall for way, (_, wall) in least.items()})


def _grouping(timer: Any, recipe: Recipe, way: str, micro_batch: int) -> tuple[Any, Any, str | None]:
    """(grouping, dataset, attention) of `way` on the timer's model: the windows grouped and the attention run as
    that way's run builds them (build_model selects the varlen attention for packed only)."""
    from ..data.packing import Grouped, grouping_of
    from ..models.varlen import VARLEN, attention_of, runs_varlen

    plain = timer.dataset.dataset if isinstance(timer.dataset, Grouped) else timer.dataset
    attention = attention_of(timer.setup.model)
    if way != "packed" and attention == VARLEN:
        attention = "sdpa"  # (what use_varlen switched from: none and sorted run transformers' sdpa)
    if way == "none":
        return None, plain, attention
    grouping = grouping_of(recipe, plain, micro_batch, way == "packed" and runs_varlen(timer.setup.model), way=way)
    return grouping, Grouped(plain, grouping), attention


def _targets(data: Datasets, indices: torch.Tensor) -> int:
    """The target tokens of a window's samples: what the run's loss divides by."""
    from ..data.batches import IGNORE_INDEX

    counts = getattr(data.train, "target_counts", None)
    if counts is not None:
        return int(counts(indices).sum())
    return sum(int((data.train[int(i)][1] != IGNORE_INDEX).sum()) for i in indices)
