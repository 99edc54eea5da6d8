"""A DeepSpeed config (ZeRO stage 3 when sharded) whose train_batch_size is the plan's m x N x W."""

from __future__ import annotations

import json
from typing import Any

from ..plan.planner import Plan
from ..plan.split import split_text
from .code import schedule_words
from .common import Export, finetune_notes, header
from .fsdp import fsdp_notes, sharded


def deepspeed_config(plan: Plan) -> tuple[dict, list[str]]:
    """The DeepSpeed config dict and its notes: train_batch_size = micro x gas x world, as DeepSpeed checks."""
    recipe, spec = plan.recipe, plan.recipe.optimizer
    notes: list[str] = []
    config: dict[str, Any] = {
        "train_batch_size": plan.effective_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation_steps,
    }
    if recipe.clip_grad_norm:
        config["gradient_clipping"] = recipe.clip_grad_norm
    if recipe.precision != "fp32":  # "bf16" or "fp16", DeepSpeed's key of each
        config[recipe.precision] = {"enabled": True}
        notes.append(
            f"DeepSpeed's {recipe.precision} mode keeps the model in {recipe.precision} with fp32 master weights in "
            "the optimizer, where reproduce autocasts an fp32 model: numerics differ slightly"
        )
    params: dict[str, Any] = {"lr": plan.lr, "weight_decay": spec.weight_decay}
    if spec.name in ("sgd", "nesterov"):
        config["optimizer"] = {"type": "SGD", "params": {**params, "momentum": spec.momentum,
                                                         "nesterov": spec.name == "nesterov"}}
    elif spec.name in ("adam", "adamw"):
        params.update(betas=list(spec.betas), eps=spec.eps)
        if spec.name == "adam":
            params["adam_w_mode"] = False  # DeepSpeed's "Adam" is AdamW unless told otherwise
        config["optimizer"] = {"type": "Adam" if spec.name == "adam" else "AdamW", "params": params}
    elif spec.name == "lamb":
        config["optimizer"] = {"type": "Lamb", "params": {**params, "betas": list(spec.betas), "eps": spec.eps}}
        notes.append("Lamb is DeepSpeed's FusedLamb (trust ratio clamped to [0.01, 10]): check it against the paper's")
    elif spec.name == "adafactor":
        config["optimizer"] = {"type": "Adafactor", "params": {**params, "eps": [None, spec.eps]}}
    else:
        notes.append(f"{spec.name}: no DeepSpeed optimizer; pass yours as deepspeed.initialize(optimizer=...)")
    if spec.weight_decay and spec.no_decay:
        notes.append(
            f"the recipe exempts {', '.join(spec.no_decay)} from weight decay: DeepSpeed decays every parameter it is "
            "given, so pass deepspeed.initialize(model_parameters=param_groups(model)) "
            "(reproduce plan --emit lightning prints param_groups)"
        )
    scheduler, schedule_notes = _deepspeed_scheduler(plan)
    if scheduler:
        config["scheduler"] = scheduler
    notes += schedule_notes
    if sharded(plan):
        config["zero_optimization"] = {
            "stage": 3,  # parameters, gradients and optimizer state partitioned over the processes
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": recipe.precision != "fp32",
        }
        notes += fsdp_notes(plan, "DeepSpeed ZeRO-3",
                            "reduce-scatters every micro-batch's gradients into the partitions (less memory than "
                            "holding a whole gradient, N times the communication) and averages over processes",
                            blocks=False)
        notes.append("ZeRO-3 checkpoints are partitioned; the whole fp32 model comes from DeepSpeed's "
                     "zero_to_fp32.py (reproduce run writes it as model.pt)")
    config["steps_per_print"] = max(1, min(100, (plan.optimizer_steps or 1000) // 20))
    return config, notes


def _deepspeed_scheduler(plan: Plan) -> tuple[dict | None, list[str]]:
    warmup, start, peak, low = plan.warmup_steps, plan.schedule.warmup_start_lr, plan.lr, plan.schedule.min_lr
    kind, end = plan.schedule.decay_kind, plan.schedule.decay_end_step
    notes = []
    exact_alternative = (
        "for the plan's exact schedule pass deepspeed.initialize(lr_scheduler=lambda opt: "
        "torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)) (reproduce plan --emit lightning prints lr_factor)"
    )
    if warmup or kind != "constant":
        notes.append(
            "DeepSpeed steps its scheduler after each optimizer step, starting from iteration -1: during warm-up each "
            "LR arrives one optimizer step later than in reproduce run"
        )
    why = None
    if kind == "step":
        why = f"step decay x{plan.schedule.decay_factor:g} at steps {plan.schedule.decay_milestones}"
    elif kind == "polynomial":
        why = "polynomial decay"
    elif kind == "plateau":
        why = "plateau decay (torch's ReduceLROnPlateau at the evaluations)"
    elif kind == "linear" and low != start:
        why = f"linear decay to lr {low:.3g} (WarmupDecayLR ends at its warmup_min_lr, {start:g} here)"
    elif kind != "constant" and plan.optimizer_steps is None:
        why = f"{kind} decay without a known total step count"
    if why:
        notes.append(f"DeepSpeed's schedulers have no {why}: WarmupLR below holds the peak; {exact_alternative}")
        kind = "constant"
    if kind == "constant":
        if not warmup:
            return None, notes
        if warmup == 1:
            notes.append("DeepSpeed's warm-up lasts at least 2 steps (warmup_num_steps is raised to 2)")
        params = {"warmup_min_lr": start, "warmup_max_lr": peak, "warmup_num_steps": warmup, "warmup_type": "linear"}
        return {"type": "WarmupLR", "params": params}, notes
    if kind == "linear":
        params = {"total_num_steps": end, "warmup_min_lr": start, "warmup_max_lr": peak,
                  "warmup_num_steps": max(1, warmup), "warmup_type": "linear"}
        notes.append("WarmupDecayLR's linear decay also arrives one step later than reproduce run's")
        return {"type": "WarmupDecayLR", "params": params}, notes
    params = {"total_num_steps": end, "warmup_min_ratio": start / peak, "warmup_num_steps": max(1, warmup),
              "cos_min_ratio": low / peak, "warmup_type": "linear"}
    return {"type": "WarmupCosineLR", "params": params}, notes


def build(plan: Plan) -> Export:
    config, notes = deepspeed_config(plan)
    notes = [*finetune_notes(plan, "DeepSpeed's config"), *notes]
    extra = [
        f"schedule: {schedule_words(plan)}",
        "DeepSpeed itself reads this file with its comments (hjson); Hugging Face's and Accelerate's deepspeed= "
        "options read strict JSON: drop the # lines first (grep -v '^#')",
        f"launch: deepspeed --num_gpus={plan.world_size} train.py (DeepSpeed checks train_batch_size = "
        f"{split_text(plan.micro_batch, plan.accumulation_steps, plan.world_size)})",
    ]
    text = "\n".join(header(plan, notes, extra)) + "\n" + json.dumps(config, indent=2) + "\n"
    return Export("deepspeed", text, config, notes)
