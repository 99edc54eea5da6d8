"""An Accelerate config file (FSDP2 when sharded) and the training loop that uses it, in comments."""

from __future__ import annotations

from typing import Any

import yaml

from ..plan.planner import Plan
from .code import no_torch_optimizer_note, optimizer_source, schedule_words
from .common import TORCH_DTYPES, Export, epoch_tail_note, finetune_notes, header, mean_loss_note, steps_note
from .fsdp import fsdp_blocks, fsdp_notes, sharded

ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def build(plan: Plan) -> Export:
    recipe = plan.recipe
    notes: list[str] = finetune_notes(plan, "Accelerate")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if sharded(plan) else "MULTI_GPU" if plan.world_size > 1 else "NO",
        "mixed_precision": ACCELERATE_PRECISION[recipe.precision],
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": plan.world_size,
        "gpu_ids": "all",
        "use_cpu": False,
        "debug": False,
        "main_training_function": "main",
    }
    accelerator = {"gradient_accumulation_steps": plan.accumulation_steps,
                   "mixed_precision": ACCELERATE_PRECISION[recipe.precision]}
    notes.append(
        "do not pass the scheduler to accelerator.prepare: Accelerate would step it num_processes times per "
        "optimizer step; step it yourself when accelerator.sync_gradients, as below"
    )
    notes += filter(None, (mean_loss_note(plan, "accelerator.backward", "loss_sum * N * W / window_items"),
                           epoch_tail_note(plan, "Accelerate's accumulate()"), no_torch_optimizer_note(plan),
                           steps_note(plan, "the loop's step count")))
    plugin: list[str] = []
    fsdp_plugin = None
    if sharded(plan):
        config["fsdp_config"], fsdp_plugin = accelerate_fsdp(plan)
        notes += fsdp_notes(plan, "Accelerate", "syncs only at the end of accumulate() too (FSDP2's "
                            "set_requires_gradient_sync), and averages the gradients over processes and micro-batches")
        if recipe.precision != "fp32":
            compute = TORCH_DTYPES[recipe.precision]
            notes.append(f"Accelerate's FSDP with mixed_precision {recipe.precision} also reduces gradients in "
                         f"{recipe.precision}: pass the plugin below for fp32 reductions, as reproduce run")
            plugin = [
                "  from accelerate import FullyShardedDataParallelPlugin",
                "  from torch.distributed.fsdp import MixedPrecisionPolicy",
                "  plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="
                f"MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype=torch.float32))",
            ]
    clip = recipe.clip_grad_norm
    build = optimizer_source(plan, "param_groups(model)") or f"...  # {recipe.optimizer.name}, lr {plan.lr!r}"
    usage = [
        "accelerate launch --config_file accelerate.yaml train.py   (saved as accelerate.yaml); in train.py:",
        *plugin,
        f"  accelerator = Accelerator(gradient_accumulation_steps={plan.accumulation_steps}, "
        f"mixed_precision={accelerator['mixed_precision']!r}" + (", fsdp_plugin=plugin)" if plugin else ")"),
        f"  loader = DataLoader(train_set, batch_size={plan.micro_batch}, shuffle={recipe.data.shuffle}, "
        f"drop_last={recipe.data.drop_last})  # per process",
        f"  optimizer = {build}",
        "  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # reproduce plan --emit lightning",
        "  model, optimizer, loader = accelerator.prepare(model, optimizer, loader)",
        f"  for inputs, target in loader:  # until {plan.optimizer_steps or 'the planned number of'} optimizer steps",
        "      with accelerator.accumulate(model):",
        "          accelerator.backward(loss_fn(model(inputs), target))",
        (f"          if accelerator.sync_gradients: accelerator.clip_grad_norm_(model.parameters(), {clip!r})"
         if clip else "          # no gradient clipping (the recipe has none)"),
        "          optimizer.step(); optimizer.zero_grad()",
        "      if accelerator.sync_gradients: scheduler.step()",
    ]
    lines = header(plan, notes, [f"schedule: {schedule_words(plan)}"])
    lines += ["#"] + ["# " + line for line in usage] + ["#"]
    lines.append(yaml.safe_dump(config, sort_keys=False).rstrip())
    values = {"config": config, "accelerator": accelerator, "batch_size": plan.micro_batch}
    if fsdp_plugin is not None:
        values["fsdp_plugin"] = fsdp_plugin  # FullyShardedDataParallelPlugin(**...), what fsdp_config says
    return Export("accelerate", "\n".join(lines) + "\n", values, notes)


def accelerate_fsdp(plan: Plan) -> tuple[dict, dict]:
    """Accelerate's `fsdp_config` (config file keys) and the same as FullyShardedDataParallelPlugin arguments."""
    blocks, _ = fsdp_blocks(plan)
    wrap = "NO_WRAP" if not blocks and plan.recipe.model.builtin in ("mlp", "cnn-bn", "cnn-gn") else \
        "TRANSFORMER_BASED_WRAP"
    config: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": wrap,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_offload_params": False,
    }
    if blocks:
        config["fsdp_transformer_layer_cls_to_wrap"] = ",".join(blocks)  # without it: the model's _no_split_modules
    plugin = {"fsdp_version": 2, "auto_wrap_policy": wrap.lower(), "reshard_after_forward": True,
              "state_dict_type": "SHARDED_STATE_DICT", "transformer_cls_names_to_wrap": blocks or None}
    return config, plugin
