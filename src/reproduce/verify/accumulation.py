"""Is the plan's accumulation the large batch, for this very model and data? A numerical check.

From the same weights, one effective batch's gradient twice: the reference, of the mean loss in one pass (float64 on
the CPU; in chunks, each summed loss divided by the total count, when one pass would not fit), and the plan's, the
very `optimizer_step` of `reproduce run` with an optimizer that records instead of stepping. Reports
||g_plan - g_ref|| / ||g_ref||, per parameter and overall. Dropout is off (two passes cannot draw the same masks);
BatchNorm trains as it does, per micro-batch, and the check says how much that differs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..data import Datasets, build_data, training_set
from ..data.batches import to_device
from ..data.loader import fetch_seeded
from ..data.packing import Grouped, Grouping, computed_tokens, grouping_of
from ..errors import UserError
from ..models import build_model, count_batchnorm
from ..models.hf import check_packed
from ..models.varlen import runs_varlen
from ..plan.overlay import variant
from ..plan.planner import Plan, finish_plan
from ..plan.segments import length_sizes
from ..train.losses import PixelLoss, build_loss
from ..train.setup import Setup, resolve_device
from ..train.step import optimizer_step
from ..train.windows import epoch_order, split_shares, window
from .reference import copy_gradients, one_pass_reference

DTYPES = ("float64", "float32", "bf16", "fp16")
# Default tolerances on the relative error: float64 rounding of a sum in another order is ~1e-16; float32
# ~1e-7 (a margin of 100x); under bf16/fp16 autocast each micro-batch's gradient is rounded to 8/11 bits.
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
# A parameter whose one-pass gradient norm is below this many units of rounding (of the whole gradient's norm)
# is rounding noise, such as a convolution bias just before a BatchNorm: it is shown but not judged alone.
NEGLIGIBLE_ULPS = 10
EPSILON = {"float64": torch.finfo(torch.float64).eps, "float32": torch.finfo(torch.float32).eps,
           "bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps}


@dataclass
class ParameterError:
    name: str
    shape: list[int]
    reference_norm: float
    difference_norm: float
    relative_error: float
    negligible: bool = False  # its one-pass gradient is at the rounding level of the whole: not judged alone


@dataclass
class VerifyResult:
    recipe: str
    arithmetic: str
    samples: int
    micro_batch: int
    micro_batches: int
    reference_chunks: int
    reference_chunk: int
    dtype: str
    device: str
    seed: int
    tolerance: float
    global_relative_error: float
    worst_parameter: str
    worst_relative_error: float
    within_tolerance: bool
    batchnorm: bool
    verdict: str
    explanation: str
    dropout_disabled: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    parameters: list[ParameterError] = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return self.within_tolerance

    def to_json(self) -> dict:
        data = asdict(self)
        data["equivalent"] = self.equivalent
        for key in ("global_relative_error", "worst_relative_error"):
            data[key] = _json_number(data[key])
        for row in data["parameters"]:
            row["relative_error"] = _json_number(row["relative_error"])
        return data


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class GradientRecorder:
    """Takes the optimizer's place in `trainer.optimizer_step`: `step()` copies the gradients, changes nothing."""

    def __init__(self, parameters: list[nn.Parameter]):
        self.param_groups = [{"params": parameters, "lr": 0.0}]
        self.gradients: list[torch.Tensor] | None = None

    def step(self, closure: Any = None) -> None:
        self.gradients = copy_gradients(self.param_groups[0]["params"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


class _NoSchedule:
    def step(self) -> None: ...


def dropouts(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """Every dropout probability above 0 in `model` (dropout modules' `p`, float `dropout` / `dropout_p` /
    `attn_dropout` attributes): its name as shown, its module and the attribute that holds it."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                yield name or type(module).__name__, module, "p"
            continue
        for attr in ("dropout", "dropout_p", "attn_dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                yield f"{name}.{attr}", module, attr


def recomputation_error(plan: Plan, data: Datasets, micro_batches: list, device: torch.device, dtype: torch.dtype,
                        seed: int) -> tuple[float, bool]:
    """With activation checkpointing, does the recomputation give the gradient the run would have had? A recomputed
    block must draw the dropout masks its forward drew, so the plan's step runs twice more from the same weights and
    RNG state, dropout on, with and without checkpointing; the two gradients must agree within tolerance.

    (relative difference of the accumulated gradients with and without checkpointing, dropout on; whether the
    model has dropout to check). `micro_batches` are on the device; both steps start from the same seed."""
    gradients, dropout = [], False
    for checkpointing in (True, False):
        recipe = variant(plan.recipe, {"model.activation_checkpointing": checkpointing})
        torch.manual_seed(seed)
        model = build_model(recipe, data.info).to(device=device, dtype=dtype)
        model.train()
        dropout = dropout or any(dropouts(model))
        recorder = GradientRecorder([p for p in model.parameters() if p.requires_grad])
        setup = Setup(finish_plan(plan, recipe=recipe), model, recorder, _NoSchedule(), None,
                      build_loss(recipe, model), data, device, dtype)
        torch.manual_seed(seed + 1)  # the dropout masks: the same stream in both steps
        optimizer_step(setup, micro_batches)
        gradients.append(recorder.gradients)
    difference = math.sqrt(sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(*gradients, strict=True)))
    norm = math.sqrt(sum(float(b.double().norm()) ** 2 for b in gradients[1]))
    return (difference / norm if norm else (0.0 if difference == 0 else math.inf)), dropout


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability to 0; what was changed."""
    changed = []
    for shown, module, attr in list(dropouts(model)):
        changed.append(f"{shown} (p={getattr(module, attr):g})")
        setattr(module, attr, 0.0)
    return changed


def verify(
    plan: Plan,
    *,
    samples: int | None = None,
    tolerance: float | None = None,
    dtype: str = "float64",
    device: str = "cpu",
    seed: int | None = None,
    data: Datasets | None = None,
    chunk: int | None = None,
) -> VerifyResult:
    """The plan's accumulated gradient against the one-pass gradient of the same samples, from the same weights."""
    tolerance = _checked_options(dtype, tolerance, samples)
    torch_device = resolve_device(device)
    if dtype == "fp16" and torch_device.type == "cpu" and not hasattr(torch.amp, "GradScaler"):
        raise UserError("fp16 needs torch.amp.GradScaler, which this torch lacks", field="dtype")
    recipe = plan.recipe
    seed = recipe.seed if seed is None else seed
    data = data if data is not None else build_data(recipe)
    # as the run indexes it: batch phases of other sequence lengths read the same data cut at their length
    train_set = training_set(recipe, data.train, list(length_sizes(plan.segments)))
    size = len(data.train)

    # The plan as it trains, in the dtype of the check: autocast only for bf16/fp16, parameters in float64
    # or float32. Clipping stays: it acts on the accumulated gradient, and the reference clips the same way.
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(dtype, "fp32")
    param_dtype = torch.float64 if dtype == "float64" else torch.float32
    checked = finish_plan(plan, recipe=variant(recipe, {"precision": precision}))

    torch.manual_seed(seed)
    model = build_model(recipe, data.info).to(device=torch_device, dtype=param_dtype).train()
    dropped = disable_dropout(model)
    grouping = grouping_of(recipe, train_set, plan.micro_batch, varlen=runs_varlen(model))  # (packed: the model's)
    checked, indices = _sample_indices(checked, size, samples, seed, grouping)
    total_samples = sum(len(i) for i in indices)
    notes = []
    if recipe.model.quantize is not None:
        notes.append(quantized_note(model, recipe.model.quantize, dtype, param_dtype, torch_device))
    parameters = [p for p in model.parameters() if p.requires_grad]
    recorder = GradientRecorder(parameters)
    scaler = torch.amp.GradScaler(torch_device.type) if precision == "fp16" else None
    setup = Setup(checked, model, recorder, _NoSchedule(), scaler, build_loss(recipe, model), data, torch_device,
                  param_dtype)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}

    accumulated, recomputed = _plan_gradient(setup, recorder, train_set, grouping, indices, seed, notes)
    if scaler is not None and scaler.get_scale() < 65536.0:
        notes.append("fp16: the loss scaler found an overflow and skipped the step; the gradients are not comparable")
    model.load_state_dict(initial)

    reference, chunk, pieces = one_pass_reference(setup, train_set, indices, seed, chunk, parameters, notes)
    model.load_state_dict(initial)

    rows, global_error, worst, within = _compare(model, parameters, reference, accumulated, dtype, tolerance)
    if recomputed is not None:
        error, dropout = recomputed
        within = within and error <= tolerance
        masks = "dropout on, as the recipe sets it" if dropout else "the model has no dropout"
        notes.append(f"activation checkpointing: the plan's gradient with checkpointing against without ({masks}): "
                     f"relative error {error:.3g} ({'within' if error <= tolerance else 'OVER'} the tolerance)")
    batchnorm = count_batchnorm(model) > 0
    verdict, explanation = _verdict(within, batchnorm, plan, len(indices), pieces, total_samples, tolerance)
    if not within and scaler is not None and scaler.get_scale() < 65536.0:
        explanation += "; fp16 overflow"
    if batchnorm and plan.micro_batch == recipe.batch.per_device:
        notes.append(
            f"the paper also normalised BatchNorm over per-device batches of {recipe.batch.per_device}: the plan "
            "keeps the paper's BN batches; the difference shown is to one pass over all the samples"
        )
    if len(indices) == 1:
        notes.append("the samples fit one micro-batch: nothing is accumulated, so the check is trivial")
    return VerifyResult(
        recipe=plan.recipe_path or "recipe", arithmetic=plan.arithmetic, samples=total_samples,
        micro_batch=plan.micro_batch, micro_batches=len(indices), reference_chunks=pieces, reference_chunk=chunk,
        dtype=dtype, device=str(torch_device), seed=seed, tolerance=tolerance, global_relative_error=global_error,
        worst_parameter=worst.name, worst_relative_error=worst.relative_error, within_tolerance=within,
        batchnorm=batchnorm, verdict=verdict, explanation=explanation, dropout_disabled=dropped, notes=notes,
        parameters=rows,
    )


def _plan_gradient(setup: Setup, recorder: GradientRecorder, train_set: Any, grouping: Grouping | None,
                   indices: list[torch.Tensor], seed: int,
                   notes: list[str]) -> tuple[list[torch.Tensor] | None, tuple[float, bool] | None]:
    """The plan's gradient: the trainer's own optimizer step over the micro-batches, fetched as the run's loader
    fetches them (augmentation seeded); with activation checkpointing, also its error against no checkpointing."""
    model, device, dtype = setup.model, setup.device, setup.dtype
    grouped = train_set
    if grouping is not None:  # sorted / packed micro-batches against the same samples unpacked in the reference
        if grouping.way == "packed":
            with setup.autocast():  # (as the steps run it)
                check_packed(model, device)
        grouped = Grouped(train_set, grouping)
        notes.append(packing_note(grouping, indices))
    micro_batches = [to_device(fetch_seeded(grouped, i, seed), device, dtype) for i in indices]
    if isinstance(setup.loss, PixelLoss):  # what the window's count normalises: each micro-batch's valid pixels
        counts = [setup.loss.count(target) for _, target in micro_batches]
        what = ("pixels (every one: data.loss_pixels all)" if setup.loss.all_pixels
                else "valid pixels (not ignore_index)")
        notes.append(f"{what} per micro-batch: {', '.join(map(str, counts))}; every one is divided by the window's "
                     f"{sum(counts)}")
    recomputed = None
    if setup.plan.recipe.model.activation_checkpointing:  # the same masks in the recomputation (dropout on)
        recomputed = recomputation_error(setup.plan, setup.data, micro_batches, device, dtype, seed)
    optimizer_step(setup, micro_batches)
    return recorder.gradients, recomputed


def _checked_options(dtype: str, tolerance: float | None, samples: int | None) -> float:
    """The check's own options, each refused with its name; the tolerance, the dtype's default when not given."""
    if dtype not in DTYPES:
        raise UserError(f"expected one of {', '.join(DTYPES)} (got {dtype!r})", field="dtype")
    if tolerance is not None and not tolerance > 0:
        raise UserError(f"must be > 0 (got {tolerance})", field="tolerance")
    if samples is not None and samples < 1:
        raise UserError(f"must be >= 1 (got {samples})", field="samples")
    return TOLERANCE[dtype] if tolerance is None else tolerance


def _sample_indices(checked: Plan, size: int, samples: int | None, seed: int,
                    grouping: Grouping | None) -> tuple[Plan, list[torch.Tensor]]:
    """The samples: one effective batch (every rank's micro-batches of optimizer step 0), or the first `samples` of
    epoch 0's order, in micro-batches of the plan's size, or grouped by length (data.packing)."""
    if samples is None:
        if not checked.steps_per_epoch or checked.dataset_size != size:
            per_epoch = max(1, size // checked.effective_batch)
            epoch = {"dataset_size": size, "steps_per_epoch": per_epoch}
            segments = [segment.model_copy(update=epoch) if segment.kind == "whole" else segment
                        for segment in checked.segments]  # the whole run's segment counts the same epoch
            checked = finish_plan(checked, **epoch, segments=segments)
        return checked, [i for rank in range(checked.world_size)
                         for i in window(checked, size, 0, seed, rank, grouping=grouping)[0]]
    if samples > size:
        raise UserError(f"{samples} exceeds the {size} samples of the training set", field="samples")
    order = epoch_order(checked, size, 0, seed)[:samples]
    return checked, split_shares([order], grouping, checked.micro_batch)[0]


def _compare(model: nn.Module, parameters: list[nn.Parameter], reference: list[torch.Tensor],
             accumulated: list[torch.Tensor], dtype: str,
             tolerance: float) -> tuple[list[ParameterError], float, ParameterError, bool]:
    """Each parameter's relative error and the whole gradient's, the worst judged one, and whether all are within
    `tolerance` (a parameter at the rounding level of the whole is shown, not judged alone)."""
    names = {id(p): n for n, p in model.named_parameters()}
    rows = []
    for param, ref, acc in zip(parameters, reference, accumulated, strict=True):
        ref64, acc64 = ref.double(), acc.double()
        ref_norm = float(ref64.norm())
        diff_norm = float((acc64 - ref64).norm())
        error = _relative(diff_norm, ref_norm)
        rows.append(ParameterError(names[id(param)], list(param.shape), ref_norm, diff_norm, error))
    global_norm = math.sqrt(sum(row.reference_norm**2 for row in rows))  # the whole gradient's, from its parts'
    global_error = _relative(math.sqrt(sum(row.difference_norm**2 for row in rows)), global_norm)
    floor = NEGLIGIBLE_ULPS * EPSILON[dtype] * global_norm
    for row in rows:
        row.negligible = row.reference_norm <= floor and row.difference_norm <= floor
    judged = [row for row in rows if not row.negligible] or rows
    worst = max(judged, key=lambda row: row.relative_error if not math.isnan(row.relative_error) else math.inf)
    return rows, global_error, worst, global_error <= tolerance and all(row.relative_error <= tolerance
                                                                         for row in judged)


def packing_note(grouping: Grouping, indices: list[torch.Tensor]) -> str:
    """What the grouped micro-batches hold: samples and tokens computed of each."""
    computed = [computed_tokens(i, grouping.lengths, grouping.way, grouping.row, grouping.varlen) for i in indices]
    sizes = ", ".join(f"{len(i)}/{tokens}" for i, tokens in zip(indices, computed, strict=True))
    return (f"data.packing {grouping.way}, token budget {grouping.budget}: micro-batches of samples/tokens computed "
            f"{sizes}; the reference takes the same samples unpacked, padded to the longest")


def quantized_note(model: nn.Module, quantize: str, dtype: str, param_dtype: torch.dtype, device: torch.device) -> str:
    """A quantised base is checked in the check's dtype: its frozen int8 / nf4 weights are exact once dequantised
    into float64 (or float32); under bf16/fp16 they keep the recipe's compute dtype."""
    if dtype in ("float64", "float32"):
        from ..models.quantize import compute_in

        compute_in(model, param_dtype)
    text = (f"quantised base ({quantize}): the frozen weights are the same numbers for every micro-batch, dequantised "
            f"into {dtype if dtype in ('float64', 'float32') else 'the compute dtype'} for the check")
    if quantize == "int8" and device.type == "cuda":
        text += ("; on CUDA, LLM.int8() picks its fp16 outlier columns from each micro-batch's activations, so the "
                 "frozen forward of a sample depends a little on the others in its micro-batch")
    return text


def _relative(difference: float, reference: float) -> float:
    if reference > 0:
        return difference / reference
    return 0.0 if difference == 0 else math.inf


def _verdict(
    within: bool, batchnorm: bool, plan: Plan, micro_batches: int, chunks: int, samples: int, tolerance: float
) -> tuple[str, str]:
    if within:
        return "equivalent", (
            f"the plan's {micro_batches} micro-batch(es) give the one-pass gradient within {tolerance:g}"
        )
    if batchnorm:
        return "NOT equivalent", (
            f"BatchNorm: each micro-batch of {plan.micro_batch} is normalised with its own mean and variance, "
            f"the reference with those of {samples // chunks if chunks else samples} samples at once"
        )
    return "NOT equivalent", f"the accumulated gradient differs from the one-pass gradient by more than {tolerance:g}"
