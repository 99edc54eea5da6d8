"""`--policy throughput` and the predicted time of `reproduce plan`: the measurements gathered, then shown.

The choice itself is pure (reproduce/throughput.py); here the timings are gathered. With the cuda or cpu meter
the probe's trials already timed some sizes; `throughput.next_size` says which exact splits to time besides
(probe/timing.py, on the probed device). With the estimate meter nothing runs for real: the FLOPs model
(`throughput.model_micro_step`, the GPU's datasheet peak and bandwidth) gives each split a time, and the plan
says it is a model. Without a probe (`--micro-batch-max`) the splits are timed on the device `run` would use.

The predicted wall time (`prediction_json`): on a device the probe measured, the measured step time x the
steps; with `--gpu`, the FLOPs model (reproduce/prediction.py) with its assumed MFU stated; and the same model on
the paper's own hardware (`batch.devices` x `batch.device`) when it is a GPU of the catalog.
"""

from __future__ import annotations

import math
import os

from rich.table import Table

from ..errors import UserError
from ..planner import Plan, plan
from ..prediction import DEFAULT_MFU, MFU_SOURCE, predicted_seconds
from ..probe.cost import format_duration
from ..probe.runner import ProbeResult
from ..recipe import Recipe
from ..throughput import choose, exact_splits, model_micro_step, next_size, relative_spread
from .common import stderr, stdout

FREE_BATCHNORM_HELP = (
    "With --policy throughput and a BatchNorm model: let the timings choose its micro-batch too (its statistics are "
    "then over another batch than the paper's per-device one)."
)
MFU_HELP = "The MFU assumed by the predicted time (default 0.40; see docs/throughput.md for its source)."


def check_mfu(assumed_mfu: float) -> None:
    if not 0 < assumed_mfu <= 1:
        raise UserError(f"--mfu: expected a fraction in (0, 1], such as 0.4 (got {assumed_mfu:g})")


def throughput_plan(recipe: Recipe, recipe_path: str, micro_batch_max: int, world_size: int,
                    dataset_size: int | dict | None, result: ProbeResult | None, data: dict | None = None,
                    quiet: bool = False, keep_batchnorm: bool = True, assumed_mfu: float = DEFAULT_MFU,
                    gpu: str | None = None) -> Plan:
    """The exact plan whose split has the most samples per second (the decision under `plan.throughput`).

    `gpu`: the --gpu named; without a probe (--micro-batch-max) the FLOPs model decides for that card.
    """
    if recipe.batch.phases or recipe.batch.ramp or isinstance(micro_batch_max, dict):
        raise UserError("--policy throughput: not available with batch phases or a ramp (each phase has its own "
                        "split); use --policy exact")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--policy throughput: each process would time its own device and might choose another split; "
                        "plan first (reproduce plan --policy throughput --out plan.yaml) and run that plan")
    base = plan(recipe, micro_batch_max, world_size, "throughput", dataset_size=dataset_size, recipe_path=recipe_path)
    if not base.exact:  # no exact split (the batch does not divide over the processes): as the exact policy does
        return base
    per_rank = base.per_rank_batch
    cap = min(micro_batch_max, math.ceil(recipe.batch.sequences / world_size))
    splits = exact_splits(per_rank, cap)
    per_device = recipe.batch.per_device
    batchnorm = per_device if keep_batchnorm and recipe.model.has_batchnorm and per_device in splits else None
    seq = recipe.batch.sequence_length
    timed: dict[int, float] = {}
    sources: dict[int, str] = {}
    spreads: list[float] = []
    basis, where = "measured", None
    if micro_batch_max == 1 or len(splits) == 1:
        pass  # nothing to choose: nothing timed
    elif (result is not None and result.meter == "estimate") or (result is None and gpu is not None):
        basis, where = "model", "the FLOPs model"
        timed, sources = _model_times(recipe, result.gpu if result is not None else gpu, splits, data, assumed_mfu)
    else:
        import torch

        from ..probe.timing import time_micro_step
        from ..probe.workload import Workload

        if result is not None:
            cuda = result.meter == "cuda"
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            for size, seconds in result.timings():
                if size in splits:
                    timed[size], sources[size] = seconds, "probe trial"
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        where = str(device)
        workload = Workload(recipe, data)
        while (size := next_size(splits, timed, max(spreads, default=0.0))) is not None:
            seconds, repeats = time_micro_step(workload, device, size, cap)
            timed[size], sources[size] = seconds, "timed"
            spreads.append(relative_spread(repeats))
            if not quiet:
                stderr.print(f"  timed micro-batch {size}: {seconds:.3g} s per micro-step (repeats "
                             f"{', '.join(f'{s:.3g}' for s in repeats)})", markup=False)
    decision = choose(splits, per_rank, timed, sources, seq, max(spreads, default=0.0), batchnorm, basis,
                      micro_batch_max=micro_batch_max)
    chosen = plan(recipe, micro_batch_max, world_size, "throughput", dataset_size=dataset_size,
                  recipe_path=recipe_path, micro_batch=decision.micro_batch)
    record = {**decision.to_json(), "device": where, "micro_batch_max": micro_batch_max}
    if batchnorm is None and recipe.model.has_batchnorm and per_device:
        record["reason"] += f" (BatchNorm statistics over {decision.micro_batch}, not the paper's {per_device})"
    return chosen.model_copy(update={"throughput": record})


def _model_times(recipe: Recipe, gpu: str | None, splits: list[int], data: dict | None, assumed_mfu: float
                 ) -> tuple[dict[int, float], dict[int, str]]:
    """Micro-step seconds by the FLOPs model on the GPU named: nothing is timed under the estimate meter."""
    from ..probe.catalog import lookup
    from ..probe.flops import recipe_flops
    from ..probe.peaks import peaks_of, precision_key

    peaks = peaks_of(lookup(gpu).name) if gpu else None
    flops = recipe_flops(recipe, data)
    key = precision_key(recipe.precision, flops.convolution_share > 0.5)
    peak = peaks.flops(key) if peaks else None
    weights = flops.weight_bytes
    if peak is None:  # no peak: every split costs the same FLOPs per sample, so none is faster (the largest wins)
        return {m: m * flops.per_sample for m in splits}, dict.fromkeys(splits, "model (FLOPs only)")
    times = {m: model_micro_step(m, flops.per_sample, peak, assumed_mfu, weights, peaks.bandwidth) for m in splits}
    return times, dict.fromkeys(splits, "model")


def render_throughput(p: Plan) -> None:
    decision = p.throughput
    if not decision:
        return
    unit = p.unit
    where = decision.get("device") or "-"
    candidates = decision["candidates"]
    how = "a model: nothing timed" if decision["basis"] == "model" else f"measured on {where}"
    title = f"--policy throughput ({how}): {len(candidates)} of {decision['exact_splits']} exact splits"
    if candidates:
        table = Table(title=title, title_justify="left")
        tokens = any(c["tokens_per_second"] for c in candidates)
        columns = ["micro x accum", "s / optimizer step", f"{unit}/s", *(["tokens/s"] if tokens else []), "% of best",
                   "from", ""]
        for column in columns:
            table.add_column(column, justify="left" if column in ("micro x accum", "from", "") else "right")
        for c in candidates:
            table.add_row(
                f"{c['micro_batch']} x {c['accumulation_steps']}", f"{c['step_seconds']:.3g}",
                f"{c['samples_per_second']:,.1f}",
                *([f"{c['tokens_per_second']:,.0f}" if c["tokens_per_second"] else "-"] if tokens else []),
                f"{c['share_of_best']:.0%}", c["source"], "chosen" if c["chosen"] else "",
            )
        stdout.print(table)
    else:
        stdout.print(title)
    stdout.print(f"throughput: {decision['reason']}", markup=False, soft_wrap=True)


def prediction_json(p: Plan, result: ProbeResult | None, gpu: str | None, assumed_mfu: float = DEFAULT_MFU,
                    data: dict | None = None) -> dict:
    """`predicted_seconds` (this plan), `paper_predicted_seconds` (the paper's hardware) and how they were made."""
    from ..probe.catalog import lookup
    from ..probe.flops import recipe_flops
    from ..probe.peaks import peaks_of, precision_key
    from .probe import plan_costs

    recipe = p.recipe
    notes: list[str] = []
    flops = recipe_flops(recipe, data)
    tf32 = flops.convolution_share > 0.5  # cuDNN runs fp32 convolutions on TF32 tensor cores by default
    key = precision_key(recipe.precision, tf32)
    samples = total_samples(p)
    out: dict = {"flops_per_sample": flops.per_sample, "flops_per_step": flops.per_sample * p.effective_batch,
                 "precision": key, "mfu_assumed": assumed_mfu, "mfu_source": MFU_SOURCE}
    this, basis = None, None
    measured = plan_costs(p, result).get(p.policy) if result is not None and result.meter != "estimate" else None
    if measured is not None and measured.total_seconds is not None:
        this, basis = measured.total_seconds, f"measured step time on {result.device}"
    elif gpu is not None or (result is not None and result.gpu):
        entry = lookup(gpu or result.gpu)
        peak = _peak(peaks_of(entry.name), key)
        this = _predict(samples, flops.per_sample, p.world_size, peak, assumed_mfu)
        basis = f"FLOPs model: {p.world_size} x {entry.title} at {_tflops(peak)} {key} x MFU {assumed_mfu:.0%}"
        if peak is None:
            why = peaks_of(entry.name).source if peaks_of(entry.name) else "not in probe/peaks.py"
            notes.append(f"{entry.title}: no datasheet peak for {key} in the catalog ({why}): no prediction")
    else:
        notes.append("no prediction for this plan: give --gpu NAME, or probe a local device (--meter cuda or cpu)")
    if samples is None:
        notes.append("the number of optimizer steps is unknown (the dataset size is needed): no prediction")
    paper, paper_basis = None, None
    device, devices = recipe.batch.device, recipe.batch.devices
    if device and devices:
        try:
            entry = lookup(device)
        except UserError as error:
            notes.append(f"the paper's hardware: {error.lines[-1].removeprefix('--gpu: ')}")
        else:
            peak = _peak(peaks_of(entry.name), key)
            paper = _predict(samples, flops.per_sample, devices, peak, assumed_mfu)
            paper_basis = f"FLOPs model: {devices} x {entry.title} at {_tflops(peak)} {key} x MFU {assumed_mfu:.0%}"
    else:
        notes.append("the paper's hardware: batch.device and batch.devices are not both stated")
    out.update(predicted_seconds=this, predicted_basis=basis, paper_predicted_seconds=paper, paper_basis=paper_basis,
               notes=notes)
    return out


def total_samples(p: Plan) -> float | None:
    """The samples of the whole schedule, in samples of the main sequence length (batch phases of another length
    count in proportion to their tokens: FLOPs per token taken as constant)."""
    if p.optimizer_steps is None:
        return None
    main, total = p.recipe.batch.sequence_length, 0.0
    for phase in p.segments:
        end = min(phase.end_step if phase.end_step is not None else p.optimizer_steps, p.optimizer_steps)
        steps = max(0, end - phase.start_step)
        total += steps * phase.effective_batch * ((phase.sequence_length or main) / main if main else 1)
    return total


def _predict(samples: float | None, per_sample: float, devices: int, peak: float | None, assumed_mfu: float
             ) -> float | None:
    if samples is None:
        return None
    return predicted_seconds(1, samples * per_sample, devices, peak, assumed_mfu)


def _peak(peaks, key: str) -> float | None:
    return peaks.flops(key) if peaks is not None else None


def _tflops(peak: float | None) -> str:
    return f"{peak / 1e12:g} TFLOP/s" if peak else "an unknown peak"


def predict(p: Plan, result: ProbeResult | None, gpu: str | None, assumed_mfu: float = DEFAULT_MFU) -> dict:
    """`prediction_json` when there is hardware to predict for (--gpu, or a probed device); else why not. A model
    the FLOPs counter cannot trace leaves the prediction null, never the plan undone."""
    check_mfu(assumed_mfu)
    if gpu is None and result is None:
        return {"predicted_seconds": None, "paper_predicted_seconds": None,
                "notes": ["no predicted time: give --gpu NAME (or let the plan probe a device) to predict one"]}
    try:
        return prediction_json(p, result, gpu, assumed_mfu)
    except UserError:
        raise
    except Exception as error:  # the prediction is an addition to the plan, which stands without it
        return {"predicted_seconds": None, "paper_predicted_seconds": None,
                "notes": [f"FLOPs not counted ({type(error).__name__}: {str(error).splitlines()[0][:120]})"]}


def render_prediction(prediction: dict) -> None:
    if "flops_per_step" not in prediction:
        for note in prediction["notes"]:
            stdout.print(f"note: {note}", markup=False, soft_wrap=True)
        return
    def text(seconds: float | None) -> str:
        return format_duration(seconds) if seconds is not None else "unknown"

    per_step = prediction["flops_per_step"]
    stdout.print(f"FLOPs: {prediction['flops_per_sample']:.4g} per sample, {per_step:.4g} per optimizer step "
                 "(model FLOPs, forward and backward)", markup=False, soft_wrap=True)
    if prediction["predicted_basis"]:
        stdout.print(f"predicted time: {text(prediction['predicted_seconds'])} ({prediction['predicted_basis']})",
                     markup=False, soft_wrap=True)
    if prediction["paper_basis"]:
        stdout.print(f"predicted time on the paper's hardware: {text(prediction['paper_predicted_seconds'])} "
                     f"({prediction['paper_basis']})", markup=False, soft_wrap=True)
    if "FLOPs model" in (prediction["predicted_basis"] or "") + (prediction["paper_basis"] or ""):
        stdout.print(f"MFU: {prediction['mfu_source']}", markup=False, soft_wrap=True)
    for note in prediction["notes"]:
        stdout.print(f"note: {note}", markup=False, soft_wrap=True)
