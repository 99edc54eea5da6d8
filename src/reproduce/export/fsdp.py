"""The sharded forms (`batch.sharding: fsdp`): which blocks are the units, and what each framework does differently."""

from __future__ import annotations

from ..plan.planner import Plan
from ..plan.sharding import SHARDABLE_OPTIMIZERS


def sharded(plan: Plan) -> bool:
    return plan.recipe.batch.sharding == "fsdp"


RESNET_BASIC = ("resnet18", "resnet34")


def fsdp_blocks(plan: Plan) -> tuple[list[str], str | None]:
    """The block classes sharded one by one (none: the model is one unit), and a note when the model must say."""
    model = plan.recipe.model
    if model.builtin == "gpt":
        return ["Block"], None
    if model.builtin in ("mlp", "cnn-bn", "cnn-gn"):
        return [], None
    if model.builtin is not None and model.builtin.startswith("resnet"):
        return ["BasicBlock" if model.builtin in RESNET_BASIC else "Bottleneck"], None
    if model.factory is not None:
        return [], (
            f"{model.factory} is your own model: name its block class (the repeated layer) as the unit to shard; "
            "reproduce run shards Hugging Face models by their _no_split_modules, the built-in GPT's Block and "
            "torchvision's ResNet blocks, and any other model as one unit"
        )
    return [], "the block classes are the model's _no_split_modules (Hugging Face models list them)"


def fsdp_notes(plan: Plan, framework: str, reduction: str, blocks: bool = True) -> list[str]:
    """What a framework's sharded run does differently from `reproduce run --sharding fsdp`; with `blocks`, then
    where its units come from when the model does not say."""
    notes = [
        f"reproduce run shards with FSDP2 (fully_shard per block, then the root) over {plan.world_size} processes, "
        "reduce-scatters the gradients once per optimizer step (no gradient sync on the first "
        f"{plan.accumulation_steps - 1} micro-batches) as a SUM of losses divided by the window's global item count; "
        f"{framework} {reduction}",
    ]
    if plan.recipe.precision != "fp32":
        notes.append(
            f"reproduce run's FSDP mixed precision: parameters all-gathered in {plan.recipe.precision}, gradients "
            "reduced in fp32, fp32 sharded master weights and optimizer state"
        )
    if plan.world_size < 2:
        notes.append("batch.sharding fsdp needs several processes: plan with --world-size 2 or more")
    name = plan.recipe.optimizer.name
    if name not in SHARDABLE_OPTIMIZERS:
        notes.append(f"reproduce run refuses {name} with FSDP (its update needs statistics of whole tensors); check "
                     f"that {framework}'s {name} handles sharded parameters")
    _, block_note = fsdp_blocks(plan)
    return [*notes, block_note] if blocks and block_note else notes
