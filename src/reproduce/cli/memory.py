"""The memory options shared by plan, probe, run and verify: --activation-checkpointing, --sharded-gradients,
--offload (recipe fields: reproduce/memory_options.py)."""

from __future__ import annotations

from enum import Enum

from ..memory_options import with_memory_options
from ..recipe import Recipe

CHECKPOINTING_HELP = (
    "Recompute each block's activations in backward instead of keeping them (model.activation_checkpointing): "
    "less activation memory for about a third more compute; exact."
)
SHARDED_GRADIENTS_HELP = (
    "With --sharding fsdp: reduce-scatter the gradients after every micro-batch so they stay sharded through the "
    "accumulation window (batch.sharded_gradients); more communication, exact."
)
OFFLOAD_HELP = (
    "With --sharding fsdp: cpu keeps parameters, gradients and optimizer state in CPU memory (batch.offload)."
)


class Offload(str, Enum):
    none = "none"
    cpu = "cpu"


def apply_memory(recipe: Recipe, activation_checkpointing: bool = False, sharded_gradients: bool = False,
                 offload: Offload | None = None) -> Recipe:
    """The recipe with the memory options given on the command line (one line, exit 2, for a bad combination)."""
    changed = with_memory_options(recipe, activation_checkpointing, sharded_gradients,
                                  offload.value if offload is not None else None)
    if changed.model.activation_checkpointing:  # a model with no blocks: one line now, before anything runs
        from ..models.checkpointing import check_checkpointable

        check_checkpointable(changed)
    return changed


def apply_memory_to_run(recipe: Recipe, plan, resume: bool, out, activation_checkpointing: bool = False,
                        sharded_gradients: bool = False, offload: Offload | None = None):
    """`reproduce run`'s recipe and plan with the memory options; a resumed run keeps those it was started with."""
    changed = apply_memory(recipe, activation_checkpointing, sharded_gradients, offload)
    if changed == recipe:
        return recipe, plan
    if resume:
        from ..errors import UserError

        raise UserError(f"--activation-checkpointing/--sharded-gradients/--offload: the run in {out} was started "
                        "without them; resume it as it was started (its plan.yaml keeps its memory options)")
    return changed, plan.model_copy(update={"recipe": changed}) if plan is not None else None
