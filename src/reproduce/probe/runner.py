"""The probe: options in, the largest micro-batch that fits (with every trial) out. No torch at import.

`run_probe` resolves the budget (`--memory`, `--gpu` or the GPU's free memory), picks the meter, looks in the cache,
else runs `search.search` over the meter's trials under the budget less the headroom, capped at ceil(batch / W).
FSDP over W > 1 is counted by the estimate meter (one process is probed whole). When not even micro-batch 1 fits,
`result.does_not_fit` says what it needs and what would fit (advice.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from .. import __version__
from ..errors import DoesNotFit, UserError
from ..hardware.catalog import Gpu, lookup
from ..plan.recipe import Recipe, default_packing
from ..plan.units import format_size, parse_size
from . import cache
from .search import Measurement, SearchResult, search

if TYPE_CHECKING:
    from ..data import Datasets

METERS = ("auto", "cuda", "cpu", "estimate")


class BudgetRequired(UserError):
    """No budget was given and there is no GPU to take one from."""


@dataclass(frozen=True)
class ProbeOptions:
    memory: str | None = None  # --memory SIZE
    gpu: str | None = None  # --gpu NAME
    meter: str = "auto"  # auto: cuda when a GPU is here (and the budget fits it), else estimate
    headroom: float = 0.1
    use_cache: bool = True
    time_steps: bool = True  # time one step per fitting trial (the cost of the plan)


class ProbeTrial(BaseModel):
    model_config = ConfigDict(extra="forbid")

    micro_batch: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    step_seconds: float | None = None  # one micro-step (a window's step over its micro-batches), when timed
    samples_per_second: float | None = None  # micro_batch / step_seconds
    tokens_per_second: float | None = None  # for token batches: samples/s x the sequence length
    tensor_bytes: int | None = None
    note: str | None = None
    parts: dict | None = None


class ProbeLine(BaseModel):
    intercept_bytes: float
    bytes_per_sample: float
    points: tuple[int, int]


class ProbeResult(BaseModel):
    """What `reproduce probe --json` prints and the cache keeps."""

    model_config = ConfigDict(extra="forbid")

    recipe_path: str | None
    meter: Literal["cuda", "cpu", "estimate"]
    device: str
    gpu: str | None
    data: str
    budget_bytes: int
    headroom: float
    limit_bytes: int
    cap: int
    world_size: int
    micro_batch_max: int | None
    peak_bytes: int | None  # of micro_batch_max, as measured
    tensor_bytes: int | None
    step_seconds: float | None
    trials: list[ProbeTrial]
    line: ProbeLine | None
    seconds: float
    torch_version: str
    notes: list[str] = []
    cached: bool = False
    sharding: Literal["none", "fsdp"] = "none"
    does_not_fit: dict | None = None  # what micro-batch 1 needs and what would fit
    # data.packing sorted: the largest token budget T per micro-batch measured to fit, found in steps of token_step
    # tokens above micro_batch_max rows of the longest example (probe/tokens.py); token_trials' micro_batch is T
    token_budget: int | None = None
    token_step: int | None = None
    longest: int | None = None
    token_trials: list[ProbeTrial] = []
    # the ways to group the data timed after the probe (throughput/ways.py `WayTimings.to_json`): the plan's cost
    # is the chosen way's whole optimizer steps (throughput/cost.py); not cached (the plan's, not the probe's)
    ways: dict | None = None

    @property
    def capped(self) -> bool:
        return self.micro_batch_max == self.cap

    def timings(self) -> list[tuple[int, float]]:
        return [(t.micro_batch, t.step_seconds) for t in self.trials if t.fits and t.step_seconds]


def timed_trial(measurement: Measurement, sequence_length: int | None) -> ProbeTrial:
    """A trial as reported, with its samples (and tokens) per second where its step was timed."""
    samples = tokens = None
    if measurement.step_seconds:  # one micro-step of `micro_batch` samples
        per_second = measurement.micro_batch / measurement.step_seconds
        samples, tokens = round(per_second, 3), round(per_second * sequence_length, 3) if sequence_length else None
    return ProbeTrial(**measurement.to_json(), samples_per_second=samples, tokens_per_second=tokens)


def probe_result(found: SearchResult, meter: Any, headroom: float, sequence_length: int | None,
                 **fields: Any) -> ProbeResult:
    """A search's result as `probe --json` prints it and the cache keeps it (`fields`: the rest, by name)."""
    import torch

    chosen = found.chosen
    return ProbeResult(
        meter=meter.name, device=meter.device, budget_bytes=meter.budget_bytes, headroom=headroom,
        limit_bytes=meter.limit_bytes, cap=found.cap, micro_batch_max=found.micro_batch_max,
        peak_bytes=chosen.peak_bytes if chosen else None, tensor_bytes=chosen.tensor_bytes if chosen else None,
        step_seconds=chosen.step_seconds if chosen else None,
        trials=[timed_trial(t, sequence_length) for t in found.trials],
        line=ProbeLine(intercept_bytes=found.line.intercept, bytes_per_sample=found.line.slope,
                       points=found.line.points) if found.line else None,
        seconds=round(found.seconds, 3), torch_version=torch.__version__, notes=meter.notes, **fields)


def resolve_budget(options: ProbeOptions) -> tuple[int | None, Gpu | None]:
    """The requested budget in bytes (None: take it from the GPU here) and the catalog entry, if any."""
    if not 0 <= options.headroom < 1:
        raise UserError(f"expected a fraction in [0, 1), such as 0.1 (got {options.headroom:g})", field="headroom")
    if options.meter not in METERS:
        raise UserError(f"expected one of {', '.join(METERS)} (got {options.meter!r})", field="meter")
    if options.memory is not None and options.gpu is not None:
        raise UserError("`memory`, `gpu`: give one of them, not both")
    if options.gpu is not None:
        gpu = lookup(options.gpu)
        return gpu.budget_bytes, gpu
    if options.memory is not None:
        return parse_size(options.memory), None
    return None, None


def measures_whole_model(meter: str) -> bool:
    """Whether `meter` measures the whole model here (cuda, cpu, auto with a GPU), not one FSDP rank's share."""
    import torch  # only to look for a GPU

    return meter in ("cuda", "cpu") or (meter == "auto" and torch.cuda.is_available())


def choose_meter(options: ProbeOptions, budget: int | None, sharding: str = "none") -> str:
    import torch

    if sharding == "fsdp" and options.meter in ("cuda", "cpu"):
        raise UserError(
            f"`meter` {options.meter}: measures one whole process and cannot shard; with `sharding` fsdp (or "
            "batch.sharding: fsdp) over several processes use `meter` estimate (or auto)"
        )
    if sharding == "fsdp":
        if budget is None:  # (a GPU here would measure one whole process, not one rank's share)
            raise UserError(
                "`memory` or `gpu`: required with fsdp sharding: the estimate meter computes one rank's share for "
                "the GPU named, such as `gpu` a100-80gb"
            )
        return "estimate"
    if options.meter != "auto":
        if options.meter in ("cpu", "estimate") and budget is None:
            raise BudgetRequired(f"`meter` {options.meter}: needs a budget: give `memory` SIZE or `gpu` NAME")
        return options.meter
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if budget is None or budget <= free + torch.cuda.memory_reserved():
            return "cuda"
    if budget is None:
        raise BudgetRequired(
            "`memory` or `gpu`: required: there is no CUDA device here to measure; give the memory to plan for, "
            "such as `gpu` a100-80gb or `memory` 24GiB"
        )
    return "estimate"


def run_probe(
    recipe: Recipe,
    recipe_path: str | None = None,
    options: ProbeOptions = ProbeOptions(),
    world_size: int = 1,
    data: Datasets | None = None,
    on_trial: Callable[[Measurement], None] | None = None,
) -> ProbeResult:
    """The largest micro-batch of `recipe` that fits the budget, measured; from the cache when it is there."""
    import torch

    from .meters import make_meter
    from .tokens import token_search
    from .workload import Workload

    requested, gpu = resolve_budget(options)
    sharding = recipe.batch.sharding if world_size > 1 else "none"  # (one process has nothing to shard over)
    kind = choose_meter(options, requested, sharding)
    cap = math.ceil(recipe.batch.sequences / world_size)
    workload = Workload(recipe, data)
    way = recipe.data.packing or default_packing(recipe) or "none"  # sorted: T searched in tokens

    def meter_of(workload: Workload, cap: int | None = cap):
        sharded = {"sharding": sharding, "world_size": world_size} if kind == "estimate" else {}
        return make_meter(kind, workload, requested, options.headroom, gpu, cap, options.time_steps, **sharded)

    meter = meter_of(workload)
    if recipe.batch.sharding == "fsdp" and sharding == "none":
        meter.notes.append("batch.sharding fsdp with one process: nothing to shard over, so the whole step is probed")
    try:
        key = cache.cache_key({
            "recipe": recipe.model_dump(mode="json"), "meter": kind, "device": meter.device,
            "budget": meter.budget_bytes, "headroom": options.headroom, "cap": cap, "timed": options.time_steps,
            "sharding": sharding, "world_size": world_size, "torch": torch.__version__, "reproduce": __version__,
            **({"packing": way} if way != "none" else {}),  # (packed rows, sorted's tokens: other trials)
        })
        saved = cache.load(key) if options.use_cache else None
        if saved is not None:
            saved.pop("format", None)
            with contextlib.suppress(ValueError):  # (another version wrote it: probe again)
                return ProbeResult.model_validate({**saved, "recipe_path": recipe_path, "cached": True})
        found = search(meter.measure, meter.limit_bytes, cap, on_trial)
        does_not_fit = None
        if found.micro_batch_max is None:
            from .advice import explain

            does_not_fit = explain(meter, found.trials, world_size, gpu)
    finally:
        meter.close()
    fields: dict = {}  # sorted text (1-D tokens) without a data.token_budget of its own: T searched in tokens
    if way == "sorted" and recipe.data.token_budget is None and workload.longest()[0].ndim == 1:
        fields = token_search(found, workload, lambda budgeted: meter_of(budgeted, cap=None))
    result = probe_result(found, meter, options.headroom, recipe.batch.sequence_length, recipe_path=recipe_path,
                          gpu=gpu.name if gpu else None, data=workload.description, world_size=world_size,
                          sharding=sharding, does_not_fit=does_not_fit, **fields)
    cache.store(key, result.model_dump(mode="json", exclude={"recipe_path", "cached"}))
    return result


def probe_line(result: ProbeResult) -> str:
    """One line saying where the micro-batch maximum came from."""
    where = "cached" if result.cached else f"{len(result.trials)} trials, {result.seconds:.1f} s"
    return (
        f"probe: largest micro-batch {result.micro_batch_max} (peak {format_size(result.peak_bytes)} of "
        f"{format_size(result.budget_bytes)}, {result.headroom:.0%} headroom; {result.meter} meter; {where})"
    )


def does_not_fit(result: ProbeResult) -> DoesNotFit:
    """The error for a probe that found no micro-batch: the step's needs by category and what would fit."""
    from .advice import render

    if result.does_not_fit is None:  # a result that carries no breakdown: one line
        smallest = min(result.trials, key=lambda t: t.micro_batch)
        return DoesNotFit(
            f"`memory`/`gpu`: not even micro-batch {smallest.micro_batch} fits in {format_size(result.budget_bytes)} "
            f"less {result.headroom:.0%} headroom ({result.meter} meter): {smallest.note or 'over the limit'}"
        )
    budget = f"`gpu` {result.gpu}" if result.gpu else "the `memory` budget"
    return DoesNotFit(*render(result.does_not_fit, budget))
