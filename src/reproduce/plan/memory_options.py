"""The memory knobs of a run, as recipe fields, and the options that set them (pure Python, no torch).

- `model.activation_checkpointing` (`--activation-checkpointing`): each block's activations recomputed in backward
  (models/checkpointing.py);
- `batch.sharded_gradients` (`--sharded-gradients`): under FSDP2, the gradients reduce-scattered after every
  micro-batch, so no rank ever holds the whole model's gradients (train/fsdp.py);
- `batch.offload` (`--offload cpu`): under FSDP2, parameters, gradients and optimizer state kept in CPU memory
  (CPUOffloadPolicy).

The last two need `batch.sharding: fsdp`. Each is exact: the run's weights are those of the plain large-batch loop.

- `model.quantize` (`--quantize int8 | nf4`): the frozen base's linear layers stored in 8 or 4 bits under LoRA
  (models/quantize.py); exact too (the frozen weights are the same numbers for every micro-batch), though the base
  then computes with its quantised weights, not the recipe's.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from .recipe import QUANTIZED_BASES, Recipe

OFFLOADS = ("none", "cpu")


def with_memory_options(recipe: Recipe, activation_checkpointing: bool = False, sharded_gradients: bool = False,
                        offload: str | None = None) -> Recipe:
    """`recipe` with the options given on the command line switched on (a flag never switches one off)."""
    if offload is not None and offload not in OFFLOADS:
        raise UserError(f"--offload: expected one of {', '.join(OFFLOADS)} (got {offload!r})")
    model: dict[str, Any] = {}
    batch: dict[str, Any] = {}
    if activation_checkpointing and not recipe.model.activation_checkpointing:
        model["activation_checkpointing"] = True
    if sharded_gradients and not recipe.batch.sharded_gradients:
        batch["sharded_gradients"] = True
    if offload is not None and offload != recipe.batch.offload:
        batch["offload"] = offload
    update: dict[str, Any] = {}
    if model:
        update["model"] = recipe.model.model_copy(update=model)
    if batch:
        update["batch"] = recipe.batch.model_copy(update=batch)
    changed = recipe.model_copy(update=update) if update else recipe
    check_memory_options(changed)
    return changed


QUANTIZED_SUMMARY = {
    "int8": "int8 base (LLM.int8(): 1 byte a frozen weight and an fp32 scale a row; bitsandbytes)",
    "nf4": "nf4 base (QLoRA's 4-bit NormalFloat with double quantisation: about half a byte a frozen weight; "
           "bitsandbytes)",
}


def with_quantized_base(recipe: Recipe, quantize: str | None, where: str = "the recipe") -> Recipe:
    """`recipe` with `--quantize` as `model.quantize` (the option overrides the field), checked as the field is
    (with sharding: by `check_memory_options`, once --sharding too is in place)."""
    if quantize is None or quantize == recipe.model.quantize:
        return recipe
    if quantize not in QUANTIZED_BASES:
        raise UserError(f"--quantize: expected one of {', '.join(QUANTIZED_BASES)} (got {quantize!r})")
    if recipe.model.lora is None:
        raise UserError(f"--quantize {quantize}: {where} trains every weight (no model.lora), and a quantised base "
                        "cannot train (its weights are frozen integers); add lora: {r: ..., target_modules: [...]} to "
                        "its model")
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"quantize": quantize})})


def check_memory_options(recipe: Recipe) -> None:
    """One line for a knob that needs FSDP on a recipe that does not shard, or a quantised base on one that does
    (the options are applied with model_copy, which skips the recipe's own validators: the plan would refuse it
    later, with a traceback)."""
    batch = recipe.batch
    if batch.sharding == "fsdp":
        if recipe.model.quantize is not None:
            raise UserError(f"--quantize / --sharding: an {recipe.model.quantize} base is not sharded with fsdp here "
                            "(FSDP2 cannot shard bitsandbytes' packed weights); use --sharding none, or leave "
                            "--quantize out")
        return
    if batch.offload != "none":
        raise UserError(
            f"--offload {batch.offload}: offloads FSDP2's sharded parameters, gradients and optimizer state, and this "
            "run does not shard (batch.sharding none); add --sharding fsdp (with --world-size / --nproc-per-node 2 "
            "or more), or leave --offload out"
        )
    if batch.sharded_gradients:
        raise UserError(
            "--sharded-gradients: keeps FSDP2's gradients sharded through the accumulation window, and this run does "
            "not shard (batch.sharding none); add --sharding fsdp, or leave --sharded-gradients out"
        )


def memory_summary(recipe: Recipe) -> list[str]:
    """What the recipe's memory knobs do, one phrase each (for the plan and the run's first lines)."""
    parts = []
    if recipe.model.quantize is not None:
        parts.append(QUANTIZED_SUMMARY[recipe.model.quantize])
    if recipe.model.activation_checkpointing:
        parts.append("activation checkpointing (each block recomputed in backward: about a third more compute)")
    if recipe.batch.sharding == "fsdp" and recipe.batch.sharded_gradients:
        parts.append("sharded gradients (one reduce-scatter per micro-batch instead of per optimizer step)")
    if recipe.batch.sharding == "fsdp" and recipe.batch.offload == "cpu":
        parts.append("CPU offload (parameters, gradients and optimizer state in CPU memory; the optimizer steps "
                     "on the CPU)")
    return parts


def with_knobs_of(recipe: Recipe, other: Recipe) -> Recipe:
    """`recipe` with `other`'s memory knobs (what a plan may have taken by itself: a resumed run keeps them)."""
    return recipe.model_copy(update={
        "model": recipe.model.model_copy(update={"activation_checkpointing": other.model.activation_checkpointing}),
        "batch": recipe.batch.model_copy(update={"sharded_gradients": other.batch.sharded_gradients,
                                                 "offload": other.batch.offload}),
    })
