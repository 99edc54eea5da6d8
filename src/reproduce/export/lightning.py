"""Lightning `Trainer` arguments, `configure_optimizers` and, when sharded, an `FSDPStrategy`."""

from __future__ import annotations

from typing import Any

from ..plan.planner import Plan
from .code import lr_factor_source, no_torch_optimizer_note, optimizer_source, param_groups_source, schedule_words
from .common import (
    TORCH_DTYPES,
    Export,
    epoch_tail_note,
    finetune_notes,
    header,
    kwargs_block,
    mean_loss_note,
    py_literal,
    steps_note,
)
from .fsdp import fsdp_blocks, fsdp_notes, sharded

LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def build(plan: Plan) -> Export:
    recipe = plan.recipe
    notes: list[str] = finetune_notes(plan, "Lightning")
    trainer: dict[str, Any] = {
        "accelerator": "auto",
        "devices": plan.world_size,
        "num_nodes": 1,
        "strategy": "fsdp" if sharded(plan) else "ddp" if plan.world_size > 1 else "auto",
        "accumulate_grad_batches": plan.accumulation_steps,
        "max_steps": plan.optimizer_steps if plan.optimizer_steps is not None else -1,
        "gradient_clip_val": recipe.clip_grad_norm,
        "gradient_clip_algorithm": "norm",
        "precision": LIGHTNING_PRECISION[recipe.precision],
    }
    comments = {
        "devices": f"processes per node: devices x num_nodes = {plan.world_size}",
        "max_steps": "optimizer steps",
    }
    notes += filter(None, (steps_note(plan, "max_steps"),
                           mean_loss_note(plan, "Lightning", "loss_sum * N * W / window_items"),
                           epoch_tail_note(plan, "Lightning"), no_torch_optimizer_note(plan)))
    values = {"trainer": trainer, "batch_size": plan.micro_batch}
    strategy: list[str] = []
    if sharded(plan):
        comments["strategy"] = "FSDP: trainer_kwargs['strategy'] = fsdp_strategy(model), below"
        blocks, _ = fsdp_blocks(plan)
        notes += fsdp_notes(plan, "Lightning's FSDPStrategy",
                            "wraps the model in FSDP1 (FullyShardedDataParallel, flat parameters): the same sharding "
                            "and the same update, gradients averaged over processes and micro-batches instead")
        values["fsdp_blocks"] = blocks
        strategy = ["", "", *_lightning_fsdp_source(plan, blocks)]
    lines = header(plan, notes, [f"schedule: {schedule_words(plan)}"])
    lines += [
        f"batch_size = {plan.micro_batch}  # per device: DataLoader(train_set, batch_size=batch_size, "
        f"shuffle={recipe.data.shuffle}, drop_last={recipe.data.drop_last})",
        *kwargs_block("trainer_kwargs", trainer, comments),
        "# trainer = lightning.Trainer(**trainer_kwargs)",
        *strategy,
        "", "",
        *lr_factor_source(plan), "", "",
        *param_groups_source(plan), "", "",
        *_configure_optimizers(plan),
    ]
    return Export("lightning", "\n".join(lines) + "\n", values, notes)


def _lightning_fsdp_source(plan: Plan, blocks: list[str]) -> list[str]:
    """`def fsdp_strategy(model)`: Lightning's FSDPStrategy sharded per block, with fp32 gradient reductions."""
    compute = None if plan.recipe.precision == "fp32" else TORCH_DTYPES[plan.recipe.precision]  # FSDP's param_dtype
    precision = [] if compute is None else [
        f"    # {plan.recipe.precision}-mixed alone would reduce gradients in {plan.recipe.precision}; fp32 as "
        "reproduce run:",
        f"    kwargs['mixed_precision'] = MixedPrecision(param_dtype={compute}, reduce_dtype=torch.float32,",
        f"                                               buffer_dtype={compute})",
    ]
    return [
        "def fsdp_strategy(model):",
        '    """Lightning\'s FSDPStrategy, one FSDP unit per block as reproduce run shards (blocks by class name)."""',
        *(["    import torch"] if compute else []),
        "    from lightning.pytorch.strategies import FSDPStrategy",
        *(["    from torch.distributed.fsdp import MixedPrecision"] if compute else []),
        "",
        f"    blocks = set({py_literal(blocks)})",
        "    for module in model.modules():  # Hugging Face models name their blocks",
        '        blocks.update(getattr(module, "_no_split_modules", None) or ())',
        "",
        "    def per_block(module, recurse, nonwrapped_numel):",
        "        return recurse or type(module).__name__ in blocks",
        "",
        '    kwargs = {"auto_wrap_policy": per_block, "sharding_strategy": "FULL_SHARD", "state_dict_type": "sharded"}',
        *precision,
        "    return FSDPStrategy(**kwargs)",
    ]


def _configure_optimizers(plan: Plan) -> list[str]:
    build = optimizer_source(plan, "param_groups(self)")
    body = [f"    optimizer = {build}"] if build else [
        f"    optimizer = ...  # {plan.recipe.optimizer.name} at lr {plan.lr!r} over param_groups(self)"
    ]
    return [
        "def configure_optimizers(self):",
        '    """For your LightningModule: the recipe\'s optimizer, its LR stepped once per optimizer step."""',
        "    import torch",
        "",
        *body,
        "    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)",
        '    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}',
    ]
