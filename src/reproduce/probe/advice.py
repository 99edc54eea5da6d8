"""When not even micro-batch 1 fits: what that step needs, and what would make it fit, computed.

`explain` starts from the failed trial of micro-batch 1 (the estimate meter's, counted by category; the cpu and
cuda meters stop at the budget, so the step is counted again on fake tensors, `meters.fake_parts`). Each way out is
computed for micro-batch 1 on the same budget and meter (a recipe change is a new trial of the changed recipe): FSDP
over the fewest processes that fit (`smallest_world_size`); LoRA (Hu et al. 2021, peft's defaults) for a recipe
that fine-tunes (`model.pretrained` or `model.hf`); bf16 weights when they are fp32, and both; a quantised frozen
base under LoRA (int8, then nf4, bitsandbytes' layers as Alpaca-LoRA and QLoRA train); the memory knobs
(memory_ways.py).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..models import build_on_meta
from ..plan.recipe import QUANTIZED_BASES
from ..plan.units import format_size
from .memory_ways import WayOut, describe, memory_ways_out, merged, tried
from .sharded_memory import Blocks, StepMemory, sharded_peak, smallest_world_size, unsharded_floor

LORA = {"r": 8, "alpha": 16, "dropout": 0.05}  # a common starting point (peft's examples)


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The modules LoRA adapts by default: peft's own table for a Hugging Face architecture (LLaMA: q_proj,
    v_proj; GPT-2: c_attn), otherwise the linear layers inside the model's blocks (the units FSDP wraps)."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table
    except ImportError:  # peft missing: LoRA itself will say so when the recipe is built
        table = {}
    for module in model.modules():
        kind = getattr(getattr(module, "config", None), "model_type", None)
        if kind in table:
            return list(table[kind])
    from ..train.distributed.fsdp import shard_units

    return sorted({name for block in shard_units(model) for name, layer in block.named_modules()  # names as peft
                   if isinstance(layer, torch.nn.Linear)})  # matches them: a module's name ends with one


def explain(meter: Any, trials: list, world_size: int, gpu: Any) -> dict:
    """What micro-batch 1 needs on `meter`'s budget, by category, and the ways out (see the module's notes), as
    `probe --json` keeps it (`does_not_fit`)."""
    from .meters import EstimateMeter, fake_parts, sharding_meter  # (meters imports nothing from here; the import
    # is local to keep it so)

    first = min(trials, key=lambda t: t.micro_batch)
    estimate = isinstance(meter, EstimateMeter)
    parts = first.parts
    counted_on = "the failed trial itself, run to its end on fake tensors"
    if parts is None:  # the cpu and cuda meters stopped at the budget: count the same step on fake tensors
        parts = fake_parts(meter, first.micro_batch)
        counted_on = "the same step on fake tensors (the trial itself stopped at the budget)"
    step, blocks = StepMemory(**parts["step"]), Blocks.of(parts)
    window = parts.get("window", True)
    compute = parts["compute_bytes"]
    decide = meter.decided if estimate else (lambda tracked: tracked)
    tensor_limit = meter.tensor_limit() if estimate else meter.limit_bytes
    at_peak = dict(parts["at_peak"])
    tensors = sum(at_peak.values())
    if "sharded" in parts:  # the trial was already sharded: show this rank's parts
        sharded = parts["sharded"]
        at_peak = {"weights and optimizer state (this rank's shard)": sharded["model_states"],
                   "gradients": sharded["gradients"], "gathered blocks": sharded["gathered"],
                   "activations": sharded["activations"]}
        tensors = sharded["peak"]
        if sharded["peak"] != sum(at_peak.values()):  # the optimizer step is the peak
            at_peak = {"weights and optimizer state (this rank's shard)": sharded["model_states"],
                       "gradients": sharded["sharded_gradients"], "step temporaries": sharded["step_temporaries"]}
    explanation: dict = {
        "micro_batch": first.micro_batch, "meter": meter.name, "budget_bytes": meter.budget_bytes,
        "limit_bytes": meter.limit_bytes, "peak_bytes": decide(tensors),  # as the meter decides (margin included)
        "tensor_bytes": tensors, "at_peak": at_peak, "step": step.to_json(),  # the unsharded step's StepMemory
        "counted_on": counted_on, "parameters": blocks.parameters, "ways_out": [], "notes": [],
        "quantize": meter.workload.recipe.model.quantize,  # a quantised base: its weights are not per-parameter bytes
        "unseen": parts.get("unseen_bytes", 0),  # of step["activations"]: the allowance for kernels' workspaces
    }
    batch = meter.workload.recipe.batch
    if batch.sharding == "fsdp" and world_size == 1:
        paper = f" (the paper used {batch.devices})" if batch.devices else ""
        explanation["notes"].append(f"the recipe shards with fsdp, but one process has nothing to shard over: the "
                                    f"whole step was probed; give --world-size{paper}")
    if not (estimate and (meter.sharding == "fsdp" or meter.workload.recipe.precision == "fp32")):
        # measure the step as FSDP runs it (mixed precision: forward and backward on compute-dtype parameters)
        sharder = sharding_meter(meter, gpu)
        if sharder is not None:
            shard_parts = sharder.measure(first.micro_batch).parts
            step = StepMemory(**shard_parts["step"])
            compute, decide, tensor_limit = shard_parts["compute_bytes"], sharder.decided, sharder.tensor_limit()
    ways = [_fsdp_way_out(step, blocks, compute, tensor_limit, decide, world_size, window)]
    knobs = memory_ways_out(meter, gpu, first, step, blocks, compute, decide, tensor_limit,
                            activations=parts["step"]["activations"])
    fits = any(way.fits for way in knobs)  # when no memory knob alone fits, the most of them join the recipe's ways
    changes = [way.changes for way in knobs if way.changes and not fits]
    extra = max(changes, key=lambda change: sum(len(value) for value in change.values())) if changes else None
    explanation["ways_out"] = [asdict(way) for way in ways + knobs + _recipe_ways_out(meter, gpu, extra=extra)]
    return explanation


def _fsdp_way_out(step: StepMemory, blocks: Blocks, compute: int, tensor_limit: int, decide: Any,
                  world_size: int, window: bool) -> WayOut:
    ranks = smallest_world_size(step, blocks, tensor_limit, compute, unsharded_window=window)
    if ranks is None:
        floor = unsharded_floor(step, blocks, compute, unsharded_window=window)
        left = "the activations of one sample, the buffers, the gathered blocks" + (
            " and, within an accumulation window, the whole model's gradients" if window else "")
        detail = f"no number of processes is enough: what sharding leaves whole on each one ({left}) needs " + (
            format_size(decide(floor)))
        synced = smallest_world_size(step, blocks, tensor_limit, compute) if window else None
        if synced is not None:  # what reducing after every micro-batch would allow
            detail += (f"; with --sharded-gradients (a reduce-scatter after every micro-batch instead of one per "
                       f"optimizer step) they stay sharded, and {synced} would do")
        return WayOut("--sharding fsdp", False, None, detail)
    peak = sharded_peak(step, blocks, ranks, compute, unsharded_window=window)
    return WayOut(
        f"--sharding fsdp --world-size {ranks}", True, decide(peak.peak),
        f"{ranks} processes (GPUs) sharing parameters and optimizer state ({format_size(peak.model_states)} each), "
        f"{format_size(peak.gradients)} of gradients" + (" (unsharded within the accumulation window)" if window
                                                         else "")
        + f" and {format_size(peak.gathered)} of gathered blocks per device"
        + (f" (now {world_size})" if world_size > 1 else ""),
    )


def _recipe_ways_out(meter: Any, gpu: Any, extra: dict | None = None) -> list[WayOut]:
    """LoRA and bf16 weights, each alone, together, and (`extra`: the memory knobs tried, when none fits alone)
    combined with those knobs, on the user's own configuration (sharding, world size, precision)."""
    recipe = meter.workload.recipe
    changes: list[tuple[str, dict]] = []
    # LoRA is a way to fine-tune: offered only for recipes that start from pretrained weights
    can_lora = bool(recipe.model.hf or recipe.model.pretrained) and recipe.model.lora is None
    can_bf16 = recipe.model.dtype == "fp32"
    lora: dict = {}
    if can_lora:
        lora = {**LORA, "target_modules": lora_targets(build_on_meta(recipe, meter.workload.data.info))}
        changes.append((f"model.lora: {_flow(lora)}", {"model": {"lora": lora}}))
    bf16 = {"model": {"dtype": "bf16"}}
    shown = "model.dtype: bf16 (weights, and so gradients and optimizer state, stored in bf16)"
    if can_bf16 and recipe.precision != "bf16":  # bf16 weights compute in bf16 (model.dtype needs the precision)
        bf16, shown = {**bf16, "precision": "bf16"}, shown + f" with precision: bf16 (not {recipe.precision})"
    if can_bf16:
        changes.append((shown, bf16))
    ways = [tried(meter, gpu, what, change)[0] for what, change in changes]
    if can_lora and can_bf16 and not any(way.fits for way in ways):
        ways.append(tried(meter, gpu, f"model.lora: {_flow(lora)} and model.dtype: bf16",
                          {**bf16, "model": {"lora": lora, "dtype": "bf16"}})[0])
    if extra and changes and not any(way.fits for way in ways):  # one alone is not enough: all of them together
        what, change = changes[-1]
        combined = merged(extra, change)
        ways.append(tried(meter, gpu, f"{describe(extra)} and {what.split(' (')[0]}", combined)[0])
    ways.extend(_quantized_ways_out(meter, gpu, lora))
    if not can_lora and recipe.model.lora is None:
        ways.append(WayOut("model.lora", False, None, "not offered: the recipe trains from scratch (LoRA "
                           "fine-tunes pretrained weights; set model.pretrained to say the recipe fine-tunes)"))
    return ways


QUANTIZED = {"int8": "1 byte a frozen weight and an fp32 scale a row: LLM.int8(), as Alpaca-LoRA trains",
             "nf4": "about half a byte a frozen weight with double-quantised block scales: QLoRA"}


def _quantized_ways_out(meter: Any, gpu: Any, lora: dict) -> list[WayOut]:
    """`model.quantize: int8`, then nf4 (nf4 alone for an int8 recipe), with the recipe's LoRA or `lora`."""
    recipe = meter.workload.recipe
    kinds = list(QUANTIZED_BASES)
    smaller = kinds[kinds.index(recipe.model.quantize) + 1:] if recipe.model.quantize else kinds
    if recipe.model.lora is None and not lora:
        return []
    extra = {} if recipe.model.lora is not None else {"lora": lora}
    ways = []
    for kind in smaller:
        what = QUANTIZED[kind]
        shown = f"model.quantize: {kind}" + (f" with model.lora: {_flow(lora)}" if extra else "") + f" ({what})"
        ways.append(tried(meter, gpu, shown, {"model": {**extra, "quantize": kind}})[0])
        if ways[-1].fits:
            break
    return ways


def _flow(mapping: dict) -> str:
    """A mapping as YAML flow style, the way a recipe would write it: {r: 8, alpha: 16, target_modules: [q_proj]}."""
    def shown(value: Any) -> str:
        return f"[{', '.join(map(str, value))}]" if isinstance(value, list) else str(value)

    return "{" + ", ".join(f"{key}: {shown(value)}" for key, value in mapping.items()) + "}"


def render(explanation: dict, budget_name: str) -> list[str]:
    """The lines the CLI prints (no traceback): the step's needs by category, its peak, then the ways out."""
    size = format_size
    step, micro = explanation["step"], explanation["micro_batch"]
    lines = [
        f"does not fit: not even micro-batch {micro} fits {budget_name} (limit {size(explanation['limit_bytes'])} of "
        f"{size(explanation['budget_bytes'])}); one training step at micro-batch {micro} needs "
        f"{size(explanation['peak_bytes'])} ({explanation['meter']} meter"
        + (", its margin included)" if explanation["meter"] == "estimate" else ")"),
        f"what the step holds (the most of each; counted on {explanation['counted_on']}):",
    ]
    parameters = explanation.get("parameters")
    stored = ""
    if parameters:
        per = round((step["weights"] - step["buffers"]) / parameters)
        stored = f"  {parameters / 1e9:.2f}B parameters" if parameters >= 1e8 else f"  {parameters:,} parameters"
        stored += {4: " in fp32", 2: " in bf16/fp16"}.get(per, "")
    if explanation.get("quantize"):  # packed: nf4 stores two weights a byte, so the count is not the model's
        stored = f"  the frozen linear layers in {explanation['quantize']} ({QUANTIZED[explanation['quantize']]})"
    rows = [
        ("weights", step["weights"], stored),
        ("weight copies for compute", step["weight_copies"], "  the bf16/fp16 copies autocast makes"),
        ("gradients", step["gradients"], ""),
        ("optimizer state", step["optimizer_state"], ""),
        (f"activations of {micro} sample{'s' if micro > 1 else ''}", step["activations"],
         "  forward and backward, with inputs and temporaries" + (
             ", and the estimate's allowance for kernels' workspaces" if explanation.get("unseen") else "")),
        ("optimizer step temporaries", step["step_temporaries"], "  clipping and the optimizer's own"),
    ]
    for name, value, note in rows:
        if value:
            lines.append(f"  {name:<28} {size(value):>11}{note}")
    at_peak = explanation["at_peak"]
    where = "the optimizer step" if at_peak.get("optimizer step") else "forward/backward"
    lines.append(f"  peak {size(explanation['tensor_bytes'])} of tensors, in {where}: {peak_line(explanation)}")
    lines.extend(f"note: {note}" for note in explanation.get("notes", []))
    fitting = [way for way in explanation["ways_out"] if way["fits"]]
    lines.append("what would fit (each computed for micro-batch 1 on the same budget):" if fitting
                 else "nothing tried fits (each computed for micro-batch 1 on the same budget):")
    for way in explanation["ways_out"]:
        lines.append(f"  [{'fits' if way['fits'] else 'no'}] {way['change']}: {way['detail']}")
    return lines


def peak_line(answer: dict) -> str:
    """The peak's composition, largest part first: "gradients 1.2 GiB + activations 800 MiB"."""
    names = {"optimizer": "optimizer state", "optimizer step": "step temporaries"}
    parts = sorted(answer["at_peak"].items(), key=lambda item: -item[1])
    return " + ".join(f"{names.get(name, name)} {format_size(size)}" for name, size in parts if size)

