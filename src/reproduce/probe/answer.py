"""How much memory one training step needs at micro-batch N: what `reproduce memory` answers.

The step is the probe's trial, counted on fake tensors by category with the target GPU's kernels (estimate), or run
for real on the CPU or this GPU (cpu, cuda: their count is the answer, which the fake step only splits). The three
figures people compare:
- allocated (`max_memory_allocated`): the live tensors at the peak, each rounded to 512 bytes;
- reserved (`max_memory_reserved`): what the caching allocator holds; the estimate adds its 5% margin and the
  cuBLAS/cuBLASLt workspaces (`EstimateMeter.decided`);
- driver (`nvidia-smi`, `mem_get_info`): reserved + the CUDA context (`catalog.CONTEXT_BYTES`, 512 MiB, or measured
  here) + what lives outside PyTorch's allocator (bitsandbytes' paged optimizer state, in unified memory).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..hardware.catalog import CONTEXT_BYTES
from ..models import build_on_meta
from ..plan.recipe import Recipe
from ..plan.units import available_host_memory, format_count
from .meters import fake_parts, make_meter
from .runner import ProbeOptions, resolve_budget
from .tracker import ALLOWANCE
from .workload import Workload, declared_inputs, synthetic_data

UNBOUNDED = 2**50  # the estimate's budget when none is given: the answer then says nothing about fitting


def with_sequence_length(recipe: Recipe, length: int | None) -> Recipe:
    """The recipe with its token sequences of `length` (--sequence-length): one line for samples that are not tokens."""
    if length is None:
        return recipe
    if length < 1:
        raise UserError(f"expected a positive number of tokens (got {length})", field="sequence_length")
    data = recipe.model_dump(mode="json", exclude_unset=True)
    data["batch"] = {**data.get("batch", {}), "sequence_length": length}
    changed = type(recipe).model_validate(data)
    if declared_inputs(changed)["inputs"] != "tokens":
        raise UserError("the recipe's samples are not token sequences (it sets the tokens of a "
                        "language model's sequence)", field="sequence_length")
    return changed


def memory_at(recipe: Recipe, micro_batch: int, options: ProbeOptions, recipe_path: str | None = None,
              sequence_length: int | None = None) -> dict:
    """The step's memory at `micro_batch` on one process (see the module's notes), as `memory --json` prints it:
    accumulates (the step holds one micro-batch's gradients through the next's forward), optimizer (its class and
    kernels), weights_form (the parameters and how they are stored), held (the most each part held during the step),
    at_peak (what each part held at the peak: sums to tensor_bytes, bitsandbytes' paged state included),
    allocated_bytes (max_memory_allocated: tensors in PyTorch's allocator), reserved_bytes (max_memory_reserved, or
    the estimate's; None on the cpu meter), driver_bytes (reserved + the CUDA context + memory outside PyTorch's
    allocator), allowances (what reserved and driver add, by name), measured (what was measured, not estimated)."""
    if micro_batch < 1:
        raise UserError(f"expected 1 or more (got {micro_batch})", field="micro_batch")
    recipe = with_sequence_length(recipe, sequence_length)
    budget, gpu = resolve_budget(options)
    meter_name = options.meter if options.meter != "auto" else ("cuda" if torch.cuda.is_available() and (
        budget is None) else "estimate")
    if recipe.batch.sharding == "fsdp":
        raise UserError("fsdp: `reproduce memory` answers for one whole process; use reproduce probe `sharding` fsdp "
                        "`world_size` W for one rank's share", field="batch.sharding")
    workload = Workload(recipe, synthetic_data(recipe) if sequence_length else None).prepare()
    limit = budget  # without a budget: the estimate unbounded, half the free memory on the cpu meter
    if meter_name != "cuda":
        limit = budget or (UNBOUNDED if meter_name == "estimate" else int(0.5 * (available_host_memory() or 2**34)))
    meter = make_meter(meter_name, workload, limit, options.headroom, gpu, recipe.batch.sequences, time_steps=False)
    try:
        measured = meter.measure(micro_batch)
    finally:
        meter.close()
    # cpu and cuda: what the real step held is split by counting the same step on fake tensors
    parts = measured.parts if meter_name == "estimate" else fake_parts(meter, micro_batch)
    step, paged, unseen = parts["step"], parts["paged_bytes"], parts.get("unseen_bytes", 0)
    held = {
        "weights": step["weights"], "weight copies": step["weight_copies"], "gradients": step["gradients"],
        "optimizer state": step["optimizer_state"] - paged, "optimizer state outside PyTorch's allocator": paged,
        "activations": step["activations"] - unseen, "logits and loss": parts["loss_bytes"],
        ALLOWANCE: unseen, "optimizer step temporaries": step["step_temporaries"],
    }
    tensors = sum(parts["at_peak"].values())
    allowances: dict[str, int] = {}
    if meter_name == "estimate":
        allocated = tensors - paged
        reserved = meter.decided(allocated)
        allowances = {"allocator segments and fragmentation (5%)": reserved - meter.fixed - allocated,
                      "cuBLAS and cuBLASLt workspaces": meter.fixed}
        what = "nothing: fake tensors counted with the GPU's kernels (estimate)"
        decided = measured.peak_bytes
    elif meter_name == "cpu":
        allocated, reserved, tensors = measured.tensor_bytes, None, measured.tensor_bytes
        what = "the tensors of a real step on this CPU (exact for tensors; no allocator, no CUDA)"
        decided = allocated
    else:
        allocated, reserved = measured.tensor_bytes, measured.peak_bytes
        what = "max_memory_allocated and max_memory_reserved of a real step on this GPU"
        decided = reserved
    driver = None
    if reserved is not None:
        context = getattr(meter, "context_bytes", None)
        allowances["CUDA context and kernels" + (" (measured here)" if context is not None else " (allowance)")] = (
            context if context is not None else CONTEXT_BYTES)
        if paged:
            allowances["bitsandbytes' paged optimizer state (CUDA unified memory)"] = paged
        driver = reserved + allowances[next(k for k in allowances if k.startswith("CUDA context"))] + paged
    if decided is None:  # the cuda meter ran out of memory
        raise UserError(f"`micro_batch` {micro_batch}: the step ran out of memory on this GPU ({measured.note}); use "
                        "`meter` estimate to see what it needs")
    budget_bytes = meter.budget_bytes if budget or meter_name == "cuda" else None
    return {
        "recipe_path": recipe_path, "micro_batch": micro_batch, "sequence_length": recipe.batch.sequence_length,
        "meter": meter_name, "device": meter.device, "data": workload.description, "accumulates": parts["accumulates"],
        "optimizer": parts["optimizer"], "weights_form": weights_form(recipe, workload), "held": held,
        "at_peak": dict(parts["at_peak"]), "peak_stage": parts["peak_stage"], "tensor_bytes": tensors,
        "allocated_bytes": allocated, "reserved_bytes": reserved, "driver_bytes": driver, "allowances": allowances,
        "measured": what, "budget_bytes": budget_bytes, "limit_bytes": meter.limit_bytes if budget_bytes else None,
        "fits": decided <= meter.limit_bytes if budget_bytes else None, "notes": list(meter.notes),
    }


def weights_form(recipe: Recipe, workload: Workload) -> str:
    """The parameters and how they are stored: "124.4M parameters in fp32; 1.2M train (LoRA adapters in bf16)"."""
    parameters = list(build_on_meta(recipe, workload.data.info).parameters())
    total, trained = sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)
    spec = recipe.model
    shown = f"{format_count(total)} parameters in {spec.dtype}"
    if spec.quantize:
        double = "" if spec.quantize != "nf4" else (" double-quantised" if spec.double_quant is not False
                                                     else " single-quantised")
        shown = (f"the frozen linear layers in {spec.quantize}{double} (packed), the rest in {spec.dtype}"
                 + (", embeddings and head upcast to fp32" if spec.upcast_embeddings and spec.dtype != "fp32" else ""))
    if trained != total:
        shown += f"; {format_count(trained)} train" + (f" (LoRA adapters in {spec.lora.dtype})" if spec.lora else "")
    return shown
