"""The memory knobs of a run, as recipe fields, and the options that set them (pure Python, no torch). Each is
exact: the run's weights are those of the plain large-batch loop.

- `model.activation_checkpointing`: each block's activations recomputed in backward (models/checkpointing.py);
- `batch.sharded_gradients` (FSDP2): gradients reduce-scattered after every micro-batch (train/distributed/fsdp.py);
- `batch.offload: cpu` (FSDP2): parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy);
- `model.quantize: int8 | nf4`: the frozen base's linear layers in 8 or 4 bits under LoRA (models/quantize.py); the
  base then computes with its quantised weights, the same numbers for every micro-batch."""

from __future__ import annotations

from .recipe import Recipe

QUANTIZED_SUMMARY = {
    "int8": "int8 base (LLM.int8(): 1 byte a frozen weight and an fp32 scale a row; bitsandbytes)",
    "nf4": "nf4 base (QLoRA's 4-bit NormalFloat with double quantisation: about half a byte a frozen weight; "
           "bitsandbytes)",
}


def memory_summary(recipe: Recipe) -> list[str]:
    """What the recipe's memory knobs do, one phrase each (for the plan and the run's first lines)."""
    parts = []
    if recipe.model.quantize is not None:
        parts.append(QUANTIZED_SUMMARY[recipe.model.quantize])
    optimizer = recipe.optimizer
    if optimizer.bitsandbytes:  # QLoRA's paged_adamw_32bit, bitsandbytes' AdamW8bit
        state = "8-bit state (about 2 bytes a parameter instead of 8)" if optimizer.state_bits == 8 else "32-bit state"
        paged = ", paged (its state in CUDA unified memory, paged to the CPU when the GPU runs short)" if (
            optimizer.paged) else ""
        parts.append(f"bitsandbytes {optimizer.name} of {state}{paged}")
    if recipe.model.activation_checkpointing and recipe.model.selective_checkpointing:
        parts.append("selective activation checkpointing (each block keeps its matrix products; the ops between "
                     "them recomputed in backward)")
    elif recipe.model.activation_checkpointing:
        parts.append("activation checkpointing (each block recomputed in backward: about a third more compute)")
    if recipe.model.loss_chunks:
        parts.append(f"chunked loss (the output head and cross-entropy over {recipe.model.loss_chunks} chunks of "
                     "tokens, each recomputed in backward)")
    if recipe.model.offload_activations:
        parts.append("activation offloading (saved activations in CPU memory between forward and backward)")
    if optimizer.implementation is not None:
        parts.append(f"optimizer kernels: {optimizer.implementation}")
    if recipe.batch.sharding == "fsdp" and recipe.batch.sharded_gradients:
        parts.append("sharded gradients (one reduce-scatter per micro-batch instead of per optimizer step)")
    if recipe.batch.sharding == "fsdp" and recipe.batch.offload == "cpu":
        parts.append("CPU offload (parameters, gradients and optimizer state in CPU memory; the optimizer steps "
                     "on the CPU)")
    return parts
