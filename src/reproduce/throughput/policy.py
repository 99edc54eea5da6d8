"""`--policy throughput`: the exact split with the most samples per second. The choice is pure (splits.py); here
the steps run: with the cuda or cpu meter, or without a probe, every exact split is timed as `run` executes it on
that device (split_steps.py); with the estimate meter the FLOPs model (`splits.model_micro_step`) times them, and
the plan says so. Torch is imported only to time; each timing's line goes to `on_note`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import UserError
from ..plan.planner import Plan, make_plan
from ..plan.recipe import Recipe
from ..plan.segments import MicroBatchMax
from ..plan.weightfiles import WeightsRecord
from ..probe.runner import ProbeResult
from .predicted_time import DEFAULT_MFU
from .splits import BUDGET_SECONDS, Timings, choose, exact_splits, model_micro_step, time_splits

if TYPE_CHECKING:
    from ..data import Datasets

PHASES = ("`policy` throughput: not available with batch phases or a ramp (each phase has its own split); use `policy` "
          "exact")


def check_phases(recipe: Recipe) -> None:
    """Refuse a recipe the policy cannot plan, before any probe: one split is timed for the whole run."""
    if recipe.batch.phases or recipe.batch.ramp:
        raise UserError(PHASES)


def throughput_plan(recipe: Recipe, recipe_path: str, micro_batch_max: MicroBatchMax, world_size: int,
                    dataset_size: int | dict | None, result: ProbeResult | None, data: Datasets | None = None,
                    keep_batchnorm: bool = True, assumed_mfu: float = DEFAULT_MFU, gpu: str | None = None,
                    on_note: Callable[[str], None] | None = None, budget_seconds: float = BUDGET_SECONDS,
                    weights: WeightsRecord | None = None, data_fingerprint: str | None = None) -> Plan:
    """The exact plan whose split has the most samples per second (its decision in `plan.throughput`). `gpu`: without
    a probe, the FLOPs model decides for that card; `on_note` gets each timing's line."""
    check_phases(recipe)
    if not isinstance(micro_batch_max, int):  # (one maximum per sequence length: batch phases)
        raise UserError(PHASES)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("`policy` throughput: each process would time its own device and might choose another split; "
                        "plan first (reproduce plan `policy` throughput `out` plan.yaml) and run that plan")
    base = make_plan(recipe, micro_batch_max, world_size, "throughput", dataset_size=dataset_size,
                     recipe_path=recipe_path, weights=weights, data_fingerprint=data_fingerprint)
    if not base.exact:  # no exact split (the batch does not divide over the processes): as the exact policy does
        return base
    per_rank = base.per_rank_batch  # exact: the paper's batch / W, which caps the micro-batch too (exact_splits)
    splits = exact_splits(per_rank, micro_batch_max)
    per_device = recipe.batch.per_device
    batchnorm = per_device if keep_batchnorm and recipe.model.has_batchnorm and per_device in splits else None
    seq = recipe.batch.sequence_length
    timed: dict[int, float] = {}
    sources: dict[int, str] = {}
    timings, basis, where = None, "measured", None
    if micro_batch_max == 1 or len(splits) == 1:
        pass  # nothing to choose: nothing timed
    elif (result is not None and result.meter == "estimate") or (result is None and gpu is not None):
        basis, where = "model", "the FLOPs model"
        timed, sources = _model_times(recipe, result.gpu if result is not None else gpu, splits, data, assumed_mfu)
        timed = {m: per_rank // m * seconds for m, seconds in timed.items()}  # one optimizer step: N micro-steps
    else:
        timings, where = _measure(recipe, data, result, per_rank, splits, budget_seconds, on_note)
    unkept = per_device if batchnorm is None and recipe.model.has_batchnorm else None
    choice = choose(splits, per_rank, timed, sources, seq, batchnorm_micro_batch=batchnorm, basis=basis,
                    micro_batch_max=micro_batch_max, timings=timings, device=where, unkept_batchnorm=unkept)
    return make_plan(recipe, micro_batch_max, world_size, "throughput", dataset_size=dataset_size,
                     recipe_path=recipe_path, micro_batch=choice.micro_batch, weights=weights,
                     data_fingerprint=data_fingerprint, throughput=choice)

def _measure(recipe: Recipe, data: Datasets | None, result: ProbeResult | None, per_rank: int, splits: list[int],
             budget_seconds: float, on_note: Callable[[str], None] | None) -> tuple[Timings, str]:
    """Every exact split timed on the probed device (or, without a probe, the one `run` would use)."""
    import time

    import torch

    from ..probe.workload import Workload
    from .split_steps import SplitSteps

    if result is not None:
        device = torch.device("cuda", torch.cuda.current_device()) if result.meter == "cuda" else torch.device("cpu")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    steps = SplitSteps(Workload(recipe, data), device, per_rank)
    built = time.perf_counter() - started
    try:
        timings = time_splits(splits, steps, budget_seconds)
    finally:
        steps.close()
    timings.setup_seconds = built
    if on_note is not None:
        for m, t in timings.timed.items():
            on_note(f"  timed {m} x {per_rank // m}: {t.median:.3g} s per optimizer step, spread {t.spread:.1%} "
                    f"({len(t.repeats)} repeats of {t.steps_per_repeat} step{'s' * (t.steps_per_repeat > 1)}; "
                    f"{t.seconds:.2g} s)")
        for m, why in timings.left_out.items():
            on_note(f"  {m} x {per_rank // m}: {why}")
        on_note(f"  choosing took {timings.seconds:.3g} s of timed steps (bound {timings.budget:g} s) and "
                f"{built:.2g} s to build the model")
    return timings, str(device)


def _model_times(recipe: Recipe, gpu: str | None, splits: list[int], data: Datasets | None, assumed_mfu: float
                 ) -> tuple[dict[int, float], dict[int, str]]:
    """Micro-step seconds by the FLOPs model on the GPU named: nothing is timed under the estimate meter."""
    from ..hardware.catalog import lookup
    from ..hardware.peaks import on_card, peaks_of, precision_key
    from ..probe.flops import recipe_flops

    entry = lookup(gpu) if gpu else None
    peaks = peaks_of(entry.name) if entry else None
    flops = recipe_flops(recipe, data)
    key = precision_key(recipe.precision, flops.convolution_share > 0.5)
    key = on_card(key, entry.capability) if entry else key
    peak = peaks.flops(key) if peaks else None
    weights = flops.weight_bytes
    if peak is None:  # no peak, no seconds: FLOPs alone cannot rank the splits
        raise UserError("`policy` throughput: the estimate meter times nothing, and the FLOPs model needs a GPU's "
                        f"peak ({'none is known for ' + entry.name if entry else 'no GPU is named'}): give `gpu` "
                        "NAME, or probe with `meter` cuda | cpu to time the splits")
    times = {m: model_micro_step(m, flops.per_sample, peak, assumed_mfu, weights, peaks.bandwidth) for m in splits}
    return times, dict.fromkeys(splits, "model")
