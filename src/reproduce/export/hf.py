"""Hugging Face `TrainingArguments`, with a Trainer subclass when HF's schedulers cannot express the plan's."""

from __future__ import annotations

from typing import Any

from ..plan.planner import Plan
from .code import lr_factor_source, schedule_words
from .common import TORCH_DTYPES, Export, epoch_tail_note, header, kwargs_block, run_name, steps_note
from .fsdp import sharded


def hf_scheduler(plan: Plan) -> tuple[str, dict, list[str]]:
    """HF's `lr_scheduler_type` and `lr_scheduler_kwargs` for the plan, and what they get wrong (empty: exact)."""
    problems = []
    if plan.warmup_steps and plan.schedule.warmup_start_lr:
        problems.append(
            f"HF warms up linearly from lr 0, not from the recipe's {plan.schedule.warmup_start_lr:g}: the first "
            f"{plan.warmup_steps} steps would get lower LRs"
        )
    kind, low = plan.schedule.decay_kind, plan.schedule.min_lr
    plain = "constant_with_warmup" if plan.warmup_steps else "constant"
    if kind == "constant":
        return plain, {}, problems
    if kind == "plateau":
        decay = plan.recipe.schedule.decay
        problems.append(f"plateau decay: {plain} here never decays; HF's lr_scheduler_type reduce_lr_on_plateau "
                        f"(torch's ReduceLROnPlateau, factor {decay.factor:g}, patience {decay.patience}) steps on "
                        f"metric_for_best_model at each evaluation, watching {decay.metric}, but has no warm-up")
        return plain, {}, problems
    if kind == "step":
        problems.append(
            f"HF has no step (multi-step) decay: x{plan.schedule.decay_factor:g} at steps "
            f"{plan.schedule.decay_milestones} cannot be "
            f"an lr_scheduler_type; {plain} alone would never decay"
        )
        return plain, {}, problems
    if plan.optimizer_steps is None:
        problems.append(f"{kind} decay needs max_steps, which the plan does not know (dataset size)")
    elif plan.schedule.decay_end_step != plan.optimizer_steps:
        problems.append(
            f"the recipe's decay ends at step {plan.schedule.decay_end_step} and holds lr {low:.3g} until step "
            f"{plan.optimizer_steps}; HF decays until max_steps"
        )
    if kind == "cosine":
        return ("cosine_with_min_lr", {"min_lr": low}, problems) if low else ("cosine", {}, problems)
    if kind == "linear" and not low:
        return "linear", {}, problems
    power = 1.0 if kind == "linear" else plan.recipe.schedule.decay.power
    return "polynomial", {"lr_end": low, "power": power}, problems  # polynomial with power 1 is linear to lr_end


def build(plan: Plan) -> Export:
    recipe, spec = plan.recipe, plan.recipe.optimizer
    notes: list[str] = []
    comments: dict[str, str] = {}
    values: dict[str, Any] = {
        "output_dir": f"runs/{run_name(plan)}",
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "learning_rate": plan.lr,
        "warmup_steps": plan.warmup_steps,
    }
    comments["per_device_train_batch_size"] = f"x {plan.accumulation_steps} accumulation x {plan.world_size} processes"
    if plan.optimizer_steps is not None:
        values["max_steps"] = plan.optimizer_steps
    else:
        notes.append(steps_note(plan, "max_steps"))
    scheduler, scheduler_kwargs, problems = hf_scheduler(plan)
    values["lr_scheduler_type"] = scheduler
    if scheduler_kwargs:
        values["lr_scheduler_kwargs"] = scheduler_kwargs
    if scheduler == "polynomial" and plan.schedule.decay_kind == "linear":
        comments["lr_scheduler_kwargs"] = "power 1: linear decay to lr_end"
    if problems:
        notes += problems
        notes.append("for the plan's exact schedule use PlanTrainer below in place of Trainer (LambdaLR on lr_factor)")
    values["weight_decay"] = spec.weight_decay
    values["max_grad_norm"] = recipe.clip_grad_norm or 0.0
    if recipe.clip_grad_norm is None:
        comments["max_grad_norm"] = "0: no clipping, as the recipe (HF's default would clip at 1.0)"
    values["bf16"] = recipe.precision == "bf16"
    values["fp16"] = recipe.precision == "fp16"
    _optimizer(spec, values, notes)
    if spec.weight_decay:
        note = _hf_decay_note(plan)
        if note:
            notes.append(note)
    values["dataloader_drop_last"] = recipe.data.drop_last
    values["seed"] = recipe.seed
    if recipe.task == "language-modeling":
        values["average_tokens_across_devices"] = True
        comments["average_tokens_across_devices"] = "the loss over the window's tokens on all processes"
        notes.append(
            "token losses are exact when the model takes num_items_in_batch (HF models do) or you pass "
            "compute_loss_func: the Trainer then divides by the window's target tokens, as reproduce does"
        )
    if recipe.loss is not None and recipe.loss.normalization == "micro-batch-mean":
        notes.append("loss.normalization micro-batch-mean is not a TrainingArguments setting: the Trainer since "
                     "transformers v4.46.0 (PR #34191) normalises by the window's tokens; use a transformers release "
                     "before 4.46.0 for the old arithmetic")
    if recipe.data.packing == "sorted":  # the Trainer's own regrouping of a step's samples (transformers >= 5.24)
        values["train_sampling_strategy"] = "batch_rebalance"
        comments["train_sampling_strategy"] = ("data.packing sorted: each step's samples regrouped by length (not "
                                               "group_by_length, which chooses a step's samples)")
    elif recipe.data.packing == "packed":
        notes.append("data.packing packed: pass data_collator=transformers.DataCollatorWithFlattening() and load the "
                     "model with attn_implementation=\"flash_attention_2\" (a varlen kernel; under sdpa a flattened "
                     "row attends through a dense mask); the step's samples stay the same")
    tail = epoch_tail_note(plan, "HF's Trainer")
    if tail:
        notes.append(tail)
    if sharded(plan):
        notes.append(
            "the recipe shards the model (batch.sharding fsdp): the Trainer runs FSDP through Accelerate; launch it "
            "with the FSDP2 config reproduce plan --emit accelerate prints (accelerate launch --config_file ...)"
        )
    launch = (
        f"launch with {plan.world_size} processes: torchrun --nproc-per-node={plan.world_size} train.py"
        if plan.world_size > 1 else "one process: python train.py"
    )
    lines = header(plan, notes, [f"schedule: {schedule_words(plan)}", launch])
    lines += kwargs_block("training_args", values, comments)
    lines.append("# args = transformers.TrainingArguments(**training_args)")
    lines += quantized_base(recipe)
    if problems:
        lines += ["", "", *lr_factor_source(plan), "", "", *PLAN_TRAINER]
    return Export("hf", "\n".join(lines) + "\n", values, notes)


def _optimizer(spec: Any, values: dict[str, Any], notes: list[str]) -> None:
    """The Trainer's `optim` (and Adam's betas and eps) for the recipe's optimizer, or why there is none."""
    if spec.name in ("sgd", "nesterov"):
        values["optim"] = "sgd"
        values["optim_args"] = f"momentum={spec.momentum!r}" + (",nesterov=True" if spec.name == "nesterov" else "")
    elif spec.name in ("adam", "adamw") and spec.bitsandbytes:  # QLoRA's paged_adamw_32bit, AdamW8bit
        values["optim"] = BITSANDBYTES_OPTIMS[spec.paged, spec.state_bits]
    elif spec.name in ("adam", "adamw"):
        values["optim"] = "adamw_torch"
        if spec.name == "adam" and spec.weight_decay:
            notes.append(
                "HF has no Adam with coupled L2 weight decay (torch.optim.Adam's weight_decay): adamw_torch decays "
                "decoupled, a different update"
            )
    elif spec.name == "adafactor":
        values["optim"] = "adafactor"
        notes.append(
            "HF's adafactor is transformers.Adafactor (relative_step off, scale_parameter off); reproduce runs "
            "torch.optim.Adafactor: not the same update"
        )
    else:
        notes.append(f"{spec.name}: no HF optim for it; pass your own optimizer with Trainer(optimizers=(opt, None))")
    if spec.family == "adam":
        values["adam_beta1"], values["adam_beta2"] = spec.betas
        values["adam_epsilon"] = spec.eps


PLAN_TRAINER = [  # (the export's text, written when HF's schedulers cannot express the plan's)
    "def plan_trainer():",
    '    """A Trainer subclass whose LR follows lr_factor: PlanTrainer = plan_trainer()."""',
    "    import torch",
    "    from transformers import Trainer",
    "",
    "    class PlanTrainer(Trainer):",
    "        def create_scheduler(self, num_training_steps, optimizer=None):",
    "            if self.lr_scheduler is None:",
    "                optimizer = optimizer if optimizer is not None else self.optimizer",
    "                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)",
    "            return self.lr_scheduler",
    "",
    "    return PlanTrainer",
]
BITSANDBYTES_OPTIMS = {(True, 32): "paged_adamw_32bit", (True, 8): "paged_adamw_8bit", (False, 8): "adamw_bnb_8bit"}


def quantized_base(recipe: Any) -> list[str]:
    """The BitsAndBytesConfig a quantised base is loaded with (every setting reproduce uses), and LoRA's config."""
    if recipe.model.quantize is None:
        return []
    if recipe.model.quantize == "int8":
        arguments = "load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_has_fp16_weight=False"
    else:
        arguments = ("load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, "
                     f"bnb_4bit_compute_dtype={TORCH_DTYPES[recipe.precision]}")
    lines = ["", f"# the frozen base in {recipe.model.quantize} (bitsandbytes), as reproduce quantises it:",
             f"# quantization_config = transformers.BitsAndBytesConfig({arguments})",
             "# model = transformers.AutoModelForCausalLM.from_pretrained(WEIGHTS, "
             f"dtype={TORCH_DTYPES[recipe.model.dtype]}, quantization_config=quantization_config)",
             "# model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)"]
    lora = recipe.model.lora
    if lora is not None:
        lines.append(f"# model = peft.get_peft_model(model, peft.LoraConfig(r={lora.r}, "
                     f"lora_alpha={lora.lora_alpha!r}, lora_dropout={lora.dropout!r}, "
                     f"target_modules={list(lora.target_modules)!r}, bias='none'))")
    return lines


def _hf_decay_note(plan: Plan) -> str | None:
    """HF's Trainer exempts biases and LayerNorm/RMSNorm(-named) parameters from weight decay, always."""
    wanted = set(plan.recipe.optimizer.no_decay)
    if wanted == {"bias", "norm"} and not plan.recipe.model.has_batchnorm:
        return None
    said = ", ".join(sorted(wanted)) or "nothing"
    extra = ""
    if plan.recipe.model.has_batchnorm and "norm" in wanted:
        extra = "; HF finds norms by LayerNorm class or 'norm' in the name, so BatchNorm layers (bn1...) are decayed"
    return (
        f"HF's Trainer exempts biases and LayerNorm/RMSNorm parameters from weight decay; the recipe exempts: {said}"
        f"{extra}. Override Trainer.get_decay_parameter_names to match"
    )
