"""The predicted wall time of a plan (`plan`'s `predicted_seconds`), values only: the probe's measured step time x
the steps; with `--gpu`, the FLOPs model at a stated MFU; and the model on the paper's own hardware (`batch.devices`
x `batch.device`) when the catalog has its peak. The FLOPs counter (probe/flops.py) imports torch; its count per
sample is kept in the probe's cache, so planning a recipe again imports none.

The FLOPs model: seconds = steps x FLOPs per step / (devices x peak FLOP/s x MFU): model FLOPs counted once
(forward and backward), the datasheet peak for the precision (hardware/peaks.py), an assumed, sourced MFU
(`DEFAULT_MFU`, or --mfu). A device with no known peak gets no prediction, never a made-up one.
"""

from __future__ import annotations

import contextlib

from ..errors import UserError
from ..hardware.catalog import lookup
from ..hardware.peaks import on_card, peaks_of, precision_key
from ..plan.planner import Plan
from ..probe.runner import ProbeResult
from .cost import plan_costs

DEFAULT_MFU = 0.40
MFU_SOURCE = (
    "assumed MFU 40%: the upper part of the range large training runs report, 21.3% (GPT-3) to 46.2% (PaLM 540B) "
    "(Chowdhery et al. 2022, arXiv 2204.02311, Table 3); set your own with --mfu"
)


def check_mfu(assumed_mfu: float) -> None:
    if not 0 < assumed_mfu <= 1:
        raise UserError(f"expected a fraction in (0, 1], such as 0.4 (got {assumed_mfu:g})", field="assumed_mfu")


def predicted_seconds(optimizer_steps: int | None, flops_per_step: float | None, devices: int,
                      peak_flops: float | None, assumed_mfu: float = DEFAULT_MFU) -> float | None:
    """The run's wall time by the FLOPs model; None when the steps, the FLOPs or the peak are unknown."""
    if optimizer_steps is None or not flops_per_step or not peak_flops or devices < 1 or assumed_mfu <= 0:
        return None
    return optimizer_steps * flops_per_step / (devices * peak_flops * assumed_mfu)


def prediction_json(p: Plan, result: ProbeResult | None, gpu: str | None, assumed_mfu: float = DEFAULT_MFU) -> dict:
    """`predicted_seconds` (this plan), `paper_predicted_seconds` (the paper's hardware) and how they were made."""
    recipe = p.recipe
    notes: list[str] = []
    per_sample, convolution_share = sample_flops(recipe)
    tf32 = convolution_share > 0.5  # cuDNN runs fp32 convolutions on TF32 tensor cores by default
    key = precision_key(recipe.precision, tf32)
    samples = total_samples(p)
    out: dict = {"flops_per_sample": per_sample, "flops_per_step": per_sample * p.effective_batch,
                 "precision": key, "mfu_assumed": assumed_mfu, "mfu_source": MFU_SOURCE}
    this, basis = None, None
    measured = plan_costs(p, result).get(p.policy) if result is not None and result.meter != "estimate" else None
    if measured is not None and measured.total_seconds is not None:
        this, basis = measured.total_seconds, f"measured step time on {result.device}"
    elif gpu is not None or (result is not None and result.gpu):
        entry = lookup(gpu or result.gpu)
        this, basis, on, why = _flops_model(entry, p.world_size, key, samples, per_sample, assumed_mfu)
        if why is not None:
            notes.append(f"{entry.title}: no datasheet peak for {on} in the catalog ({why}): no prediction")
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
            notes.append(f"the paper's hardware: {error.lines[-1].removeprefix('`gpu`: ')}")
        else:
            paper, paper_basis, on, why = _flops_model(entry, devices, key, samples, per_sample, assumed_mfu)
            if why is not None:
                notes.append(f"the paper's {entry.title}: no datasheet peak for {on} ({why}): no prediction")
    else:
        notes.append("the paper's hardware: batch.device and batch.devices are not both stated")
    # what the cluster costs: every process's GPU for the whole run (one node of 8 against four compare here)
    out.update(predicted_seconds=this, predicted_basis=basis, paper_predicted_seconds=paper, paper_basis=paper_basis,
               gpu_hours=gpu_hours(this, p.world_size), paper_gpu_hours=gpu_hours(paper, devices), notes=notes)
    return out


def gpu_hours(seconds: float | None, gpus: int | None) -> float | None:
    return seconds * gpus / 3600 if seconds is not None and gpus else None


def _flops_model(entry, devices: int, key: str, samples: int | None, per_sample: float,
                mfu: float) -> tuple[float | None, str, str, str | None]:
    """The FLOPs model on `devices` x `entry`: (seconds, basis, datasheet column, why it has no peak or None)."""
    on, peaks = on_card(key, entry.capability), peaks_of(entry.name)
    peak = peaks.flops(on) if peaks is not None else None
    shown = f"{peak / 1e12:g} TFLOP/s" if peak else "an unknown peak"
    basis = f"FLOPs model: {devices} x {entry.title} at {shown} {on} x MFU {mfu:.0%}"
    why = None if peak is not None else (peaks.source if peaks else "not in hardware/peaks.py")
    seconds = None if samples is None else predicted_seconds(1, samples * per_sample, devices, peak, mfu)
    return seconds, basis, on, why


def sample_flops(recipe) -> tuple[float, float]:
    """(FLOPs of one sample, the share in convolutions): probe/flops.py's count, kept in the probe's cache, keyed by
    the recipe and the versions of the libraries that build the model, and read back without torch."""
    from ..probe import cache

    key = cache.cache_key({"sample_flops": recipe.model_dump(mode="json"), "versions": cache.library_versions()})
    saved = cache.load(key) or {}
    if all(isinstance(saved.get(k), (int, float)) for k in ("per_sample", "convolution_share")):
        return float(saved["per_sample"]), float(saved["convolution_share"])
    from ..probe.flops import recipe_flops

    flops = recipe_flops(recipe)
    cache.store(key, {"per_sample": flops.per_sample, "convolution_share": flops.convolution_share})
    return flops.per_sample, flops.convolution_share


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


def predict(p: Plan, result: ProbeResult | None, gpu: str | None, assumed_mfu: float = DEFAULT_MFU) -> dict:
    """`prediction_json` when there is hardware to predict for (--gpu, or a probed device); else why not. A model
    the FLOPs counter cannot trace leaves the prediction null, never the plan undone."""
    check_mfu(assumed_mfu)
    batch, paper = p.recipe.batch, None
    if batch.device and batch.devices:  # the paper's hardware, when the catalog has it (not a TPU)
        with contextlib.suppress(UserError):
            paper = lookup(batch.device)
    if gpu is None and result is None and paper is None:  # nothing to predict for: no FLOPs counted
        note = "no predicted time: give --gpu NAME (or let the plan probe a device) to predict one"
    else:
        try:
            return prediction_json(p, result, gpu, assumed_mfu)
        except UserError:
            raise
        except Exception as error:  # the prediction is an addition to the plan, which stands without it
            note = f"FLOPs not counted ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    return {"predicted_seconds": None, "paper_predicted_seconds": None, "notes": [note]}
