"""Which sharding a run uses and which combinations cannot run (pure Python, no torch).

`batch.sharding` (`run --sharding` overrides it): `fsdp` shards parameters, gradients and optimizer state with
FSDP2 (`fully_shard`); `none` keeps a whole copy on every process (DDP under several)."""

from __future__ import annotations

from ..errors import UserError
from .recipe import Recipe

# Optimizers each rank can step on its own shard of every parameter and get exactly the unsharded update: element by
# element, or (LARS, LAMB) with whole-tensor norms reduced over the shards (train/optim/large_batch.py). Not
# Adafactor: its factored second moments are row and column means over whole matrices (on FSDP2's sharded DTensors
# its in-place updates fail: "in-place operations that require placement changes are not supported").
SHARDABLE_OPTIMIZERS = ("sgd", "nesterov", "adam", "adamw", "lars", "lamb")


def check_sharding(recipe: Recipe, processes: int) -> None:
    """One UserError line for a combination FSDP cannot run; nothing for `none`."""
    if recipe.batch.sharding != "fsdp":
        return
    if processes < 2:
        raise UserError(
            "batch.sharding: fsdp shards the model over several processes, but this run has 1; add "
            "`nproc_per_node` K (K >= 2) or launch it under torchrun, or run it unsharded with `batch.sharding` none"
        )
    name = recipe.optimizer.name
    if name not in SHARDABLE_OPTIMIZERS:
        raise UserError(
            f"optimizer.name: {name} cannot step FSDP's sharded parameters exactly (its update needs statistics of "
            f"whole tensors, and each process holds a shard); with batch.sharding fsdp use one of "
            f"{', '.join(SHARDABLE_OPTIMIZERS)}, or `batch.sharding` none"
        )
