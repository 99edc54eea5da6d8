"""A plan in another trainer's own terms: Hugging Face, Lightning, DeepSpeed, Accelerate, or torchrun.

Pure Python, no torch. `emit(plan, fmt)` returns text to paste or save; `export(plan, fmt)` also returns the
values the text is made of (what tests hand to the real libraries). Every text opens with a comment line
stating the batch arithmetic and the LR rule, and says in comments what the framework cannot express or
does differently from `reproduce run`, instead of leaving it out silently.

Exactness in brief:
- micro-batch, accumulation and world size always carry over (m x N x W is the effective batch);
- the learning-rate schedule carries over exactly where the framework has it (HF cosine, linear, polynomial,
  constant); otherwise `lr_factor(step)`, the plan's own schedule as a plain function, is emitted to use
  with `torch.optim.lr_scheduler.LambdaLR`;
- the loss normalisation: HF's Trainer counts the tokens of the whole accumulation window; Lightning and
  Accelerate divide each micro-batch's mean by N, which is exact only when every micro-batch holds the
  same number of loss-bearing items (always true for samples with drop_last; not for padded tokens).

A recipe with `batch.sharding: fsdp` gets each framework's sharded form: Accelerate's FSDP2 config, Lightning's
`FSDPStrategy`, DeepSpeed ZeRO stage 3 (Hugging Face's Trainer shards through Accelerate: a note points there).
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .builtin_names import why_not_runnable
from .errors import UserError
from .phases import phase_lines
from .planner import Plan
from .sharding import SHARDABLE_OPTIMIZERS

FORMATS = ("hf", "lightning", "deepspeed", "accelerate", "torchrun")
WIDTH = 110


@dataclass(frozen=True)
class Export:
    """One emitted form: its text, the values in it, and the notes on what it does not carry over exactly."""

    fmt: str
    text: str
    values: dict
    notes: list[str] = field(default_factory=list)


def emit(plan: Plan, fmt: str) -> str:
    """The plan as `fmt` (hf, lightning, deepspeed, accelerate, torchrun): text that starts with a comment."""
    return export(plan, fmt).text


def check_format(fmt: str) -> str:
    """`fmt` if it is one of FORMATS, else the one-line UserError `reproduce plan --emit` reports."""
    if fmt not in FORMATS:
        raise UserError(f"--emit: expected one of {', '.join(FORMATS)} (got {fmt!r})")
    return fmt


def export(plan: Plan, fmt: str) -> Export:
    builders = {"hf": _hf, "lightning": _lightning, "deepspeed": _deepspeed, "accelerate": _accelerate,
                "torchrun": _torchrun}
    return builders[check_format(fmt)](plan)


# ---- shared pieces ----------------------------------------------------------------------------------------


def arithmetic_line(plan: Plan) -> str:
    """The first line of every output: m x N x W = batch, and the LR rule applied."""
    text = (
        f"# reproduce plan: micro-batch {plan.micro_batch} x accumulation {plan.accumulation_steps} x world "
        f"{plan.world_size} = {plan.effective_batch} {plan.unit} per optimizer step"
    )
    if plan.effective_tokens is not None:
        text += f" ({plan.effective_tokens} tokens)"
    if plan.exact:
        return text + f", the paper's batch exactly; lr {plan.lr:g} as published (no LR rule)"
    return (
        text + f", not the paper's {plan.paper_effective_batch} (x{plan.batch_factor:.4g}); lr {plan.base_lr:g} -> "
        f"{plan.lr:.6g} by the {plan.lr_rule} rule (x{plan.lr_factor:.4g})"
    )


def _comment(text: str, prefix: str = "# ", wrap: bool = True) -> list[str]:
    if not wrap:
        return [prefix + text]
    lines = textwrap.wrap(text, WIDTH - len(prefix), break_long_words=False, break_on_hyphens=False)
    return [prefix + lines[0], *("#   " + line for line in lines[1:])] if lines else []


def _header(plan: Plan, notes: list[str], extra: list[str] = ()) -> list[str]:
    recipe = plan.recipe
    lines = [arithmetic_line(plan)]
    source = plan.recipe_path or "recipe"
    if recipe.paper is not None:
        source += f": {recipe.paper.title}" + (f" ({recipe.paper.year})" if recipe.paper.year else "")
    lines += _comment(source)
    if not plan.exact:
        lines += _comment(f"LR rule: {plan.lr_rule_source}")
    if plan.adam_option is not None:
        option = plan.adam_option
        lines += _comment(
            f"optional, not applied: betas {[round(b, 6) for b in option.betas]} eps {option.eps:.3g} ({option.source})"
        )
    for warning in plan.warnings:
        lines += _comment(f"plan warning: {warning}")
    for line in extra:
        lines += _comment(line)
    for note in [*notes, *_phase_notes(plan)]:
        lines += _comment(f"NOTE: {note}")
    return lines


def _phase_notes(plan: Plan) -> list[str]:
    """Batch phases and ramps: one framework setting cannot switch the batch mid-run; say where `reproduce run` does."""
    if not plan.phases:
        return []
    return ["the batch changes during training; the settings here are the main batch's. reproduce run switches at:",
            *phase_lines(plan)]


def _name(plan: Plan) -> str:
    return Path(plan.recipe_path).stem if plan.recipe_path else "run"


def _steps_note(plan: Plan, what: str) -> str | None:
    if plan.optimizer_steps is None:
        return (
            f"{what}: the plan has no step count (the dataset size is unknown; set data.train_size in the recipe or "
            "plan a run): set it yourself"
        )
    return None


def _epoch_tail_note(plan: Plan, framework: str) -> str | None:
    """Frameworks step the optimizer at an epoch's end even with fewer than N micro-batches left."""
    if plan.dataset_size is None:
        return None
    per_rank_batches = -(-plan.dataset_size // plan.world_size) // plan.micro_batch  # DistributedSampler pads
    if per_rank_batches % plan.accumulation_steps == 0:
        return None
    ours = (
        "reproduce run drops that incomplete window (drop_last)" if plan.recipe.data.drop_last
        else "reproduce run takes the epoch's remainder as one window normalised by the items it holds"
    )
    left = per_rank_batches % plan.accumulation_steps
    return (
        f"{framework} steps the optimizer at the end of each epoch even when fewer than {plan.accumulation_steps} "
        f"micro-batches remain (about {left} per process here): a smaller batch than the plan's, where {ours}"
    )


def _mean_loss_note(plan: Plan, framework: str, scale: str) -> str | None:
    """Lightning and Accelerate scale each micro-batch's loss by 1/N (and DDP averages over W)."""
    if plan.recipe.task == "classification" and plan.recipe.data.drop_last:
        return None  # equal micro-batches of samples: the mean of micro-batch means is the batch mean
    return (
        f"{framework} divides each micro-batch's loss by {plan.accumulation_steps} and DDP averages over "
        f"{plan.world_size} process(es): a per-micro-batch mean is exact only when every micro-batch holds the same "
        f"number of loss-bearing items. For token losses return {scale}, where window_items counts the target "
        "tokens != -100 of all N micro-batches on all processes (reproduce run does this)"
    )


def _py(value: Any) -> str:
    """A Python literal (floats exactly, by repr)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)  # double quotes: a valid Python literal
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
    return repr(value)


def _kwargs_block(name: str, values: dict, comments: dict[str, str]) -> list[str]:
    lines = [f"{name} = dict("]
    for key, value in values.items():
        line = f"    {key}={_py(value)},"
        if key in comments:
            line += f"  # {comments[key]}"
        lines.append(line)
    return [*lines, ")"]


def lr_factor_source(plan: Plan, name: str = "lr_factor") -> list[str]:
    """`def lr_factor(step)`: the plan's LR of optimizer step `step` (0-based) over the peak, as `lr_at` computes it.

    For `torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)` stepped once per optimizer step.
    """
    peak, warmup = plan.lr, plan.warmup_steps
    lines = [
        f"def {name}(step):",
        f'    """The LR of optimizer step `step` (0-based) over the peak {peak!r}: the plan\'s schedule exactly."""',
    ]
    if warmup:
        start = plan.warmup_start_lr
        lines += [
            f"    if step < {warmup}:",
            f"        return ({start!r} + ({peak!r} - {start!r}) * step / {warmup}) / {peak!r}",
        ]
    kind = plan.decay_kind
    if kind == "constant":
        return [*lines, "    return 1.0"]
    if kind == "step":
        return [*lines, f"    return {plan.decay_factor!r} ** sum(step >= m for m in {plan.decay_milestones!r})"]
    end = plan.decay_end_step if plan.decay_end_step is not None else plan.optimizer_steps
    if end is None or end <= warmup:
        return [*lines, "    return 1.0  # the run's length is unknown (dataset size), so no decay end: constant"]
    lines.append(f"    progress = min(1.0, max(0.0, (step - {warmup}) / ({end} - {warmup})))")
    low = plan.min_lr
    if kind == "cosine":
        lines.insert(2, "    import math")
        cosine = f"{low!r} + ({peak!r} - {low!r}) * 0.5 * (1 + math.cos(math.pi * progress))"
        return [*lines, f"    return ({cosine}) / {peak!r}"]
    if kind == "linear":
        return [*lines, f"    return ({peak!r} + ({low!r} - {peak!r}) * progress) / {peak!r}"]
    power = plan.recipe.schedule.decay.power
    return [*lines, f"    return ({low!r} + ({peak!r} - {low!r}) * (1 - progress) ** {power!r}) / {peak!r}"]


def _schedule_words(plan: Plan) -> str:
    warm = f"warm-up {plan.warmup_steps} steps from lr {plan.warmup_start_lr:g}, " if plan.warmup_steps else ""
    kind = plan.decay_kind
    if kind == "step":
        decay = f"step decay x{plan.decay_factor:g} at steps {plan.decay_milestones}"
    elif kind == "constant":
        decay = "constant"
    else:
        decay = f"{kind} decay to lr {plan.min_lr:.3g} at step {plan.decay_end_step}"
    return warm + decay


NORM_TYPES_SOURCE = [
    "    norms = (  # the norm layers reproduce run exempts for no_decay: norm",
    "        torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,",
    '        torch.nn.modules.instancenorm._InstanceNorm, getattr(torch.nn, "RMSNorm", ()),',
    "    )",
]


def param_groups_source(plan: Plan) -> list[str]:
    """`def param_groups(model)`: the recipe's weight decay and `no_decay` split, as `reproduce run` makes it."""
    spec = plan.recipe.optimizer
    decay = spec.weight_decay
    if not spec.no_decay or decay == 0:
        return [
            "def param_groups(model):",
            f'    """Weight decay {decay!r} on every trainable parameter (the recipe has no no_decay)."""',
            f'    return [{{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": {decay!r}}}]',
        ]
    tests = []
    if "bias" in spec.no_decay:
        tests.append('name == "bias"')
    if "norm" in spec.no_decay:
        tests.append("isinstance(module, norms)")
    if "embedding" in spec.no_decay:
        tests.append("isinstance(module, torch.nn.Embedding)")
    if "1d" in spec.no_decay:
        tests.append("p.ndim < 2")
    return [
        "def param_groups(model):",
        f'    """Weight decay {decay!r}, none on {", ".join(spec.no_decay)} (the recipe\'s no_decay)."""',
        "    import torch",
        "",
        *(NORM_TYPES_SOURCE if "norm" in spec.no_decay else []),
        "    decay, keep, seen = [], [], set()",
        "    for module in model.modules():",
        "        for name, p in module.named_parameters(recurse=False):",
        "            if not p.requires_grad or id(p) in seen:",
        "                continue",
        "            seen.add(id(p))",
        f"            excluded = {' or '.join(tests)}",
        "            (keep if excluded else decay).append(p)",
        f'    return [{{"params": decay, "weight_decay": {decay!r}}}, {{"params": keep, "weight_decay": 0.0}}]',
    ]


def optimizer_source(plan: Plan, params: str) -> str | None:
    """`torch.optim.X(params, ...)` for the recipe's optimizer at the plan's LR; None without a torch one."""
    spec = plan.recipe.optimizer
    lr = plan.lr
    if spec.name in ("sgd", "nesterov"):
        return f"torch.optim.SGD({params}, lr={lr!r}, momentum={spec.momentum!r}, nesterov={spec.name == 'nesterov'})"
    if spec.name in ("adam", "adamw"):
        cls = "Adam" if spec.name == "adam" else "AdamW"
        return f"torch.optim.{cls}({params}, lr={lr!r}, betas={_py(tuple(spec.betas))}, eps={spec.eps!r})"
    if spec.name == "adafactor":
        return f"torch.optim.Adafactor({params}, lr={lr!r}, eps=(None, {spec.eps!r}))"
    return None


def _no_torch_optimizer_note(plan: Plan) -> str | None:
    name = plan.recipe.optimizer.name
    if name in ("lamb", "lars"):
        return (f"{name}: PyTorch has no {name.upper()} optimizer; reproduce's own is "
                f"reproduce.train.large_batch.{name.upper()} (parameter groups from reproduce.train.optim.param_groups "
                f"with layer_adaptation=True), at lr {plan.lr:.6g}")
    return None


# ---- sharding (batch.sharding: fsdp) ----------------------------------------------------------------------


def sharded(plan: Plan) -> bool:
    return plan.recipe.batch.sharding == "fsdp"


RESNET_BASIC = ("resnet18", "resnet34")


def fsdp_blocks(plan: Plan) -> tuple[list[str], str | None]:
    """The block class names sharded one by one (as `reproduce run` finds them), and a note when they must come
    from the model itself. Empty: the model is sharded as one unit (the small MLP and CNNs)."""
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


def fsdp_notes(plan: Plan, framework: str, reduction: str) -> list[str]:
    """What a framework's sharded run does differently from `reproduce run --sharding fsdp`."""
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
    return notes


# ---- Hugging Face -----------------------------------------------------------------------------------------


def hf_scheduler(plan: Plan) -> tuple[str, dict, list[str]]:
    """HF's `lr_scheduler_type` and `lr_scheduler_kwargs` for the plan, and what they get wrong (empty: exact)."""
    problems = []
    if plan.warmup_steps and plan.warmup_start_lr:
        problems.append(
            f"HF warms up linearly from lr 0, not from the recipe's {plan.warmup_start_lr:g}: the first "
            f"{plan.warmup_steps} steps would get lower LRs"
        )
    kind, low = plan.decay_kind, plan.min_lr
    plain = "constant_with_warmup" if plan.warmup_steps else "constant"
    if kind == "constant":
        return plain, {}, problems
    if kind == "step":
        problems.append(
            f"HF has no step (multi-step) decay: x{plan.decay_factor:g} at steps {plan.decay_milestones} cannot be "
            f"an lr_scheduler_type; {plain} alone would never decay"
        )
        return plain, {}, problems
    if plan.optimizer_steps is None:
        problems.append(f"{kind} decay needs max_steps, which the plan does not know (dataset size)")
    elif plan.decay_end_step != plan.optimizer_steps:
        problems.append(
            f"the recipe's decay ends at step {plan.decay_end_step} and holds lr {low:.3g} until step "
            f"{plan.optimizer_steps}; HF decays until max_steps"
        )
    if kind == "cosine":
        return ("cosine_with_min_lr", {"min_lr": low}, problems) if low else ("cosine", {}, problems)
    if kind == "linear" and not low:
        return "linear", {}, problems
    power = 1.0 if kind == "linear" else plan.recipe.schedule.decay.power
    return "polynomial", {"lr_end": low, "power": power}, problems  # polynomial with power 1 is linear to lr_end


def _hf(plan: Plan) -> Export:
    recipe, spec = plan.recipe, plan.recipe.optimizer
    notes: list[str] = []
    comments: dict[str, str] = {}
    values: dict[str, Any] = {
        "output_dir": f"runs/{_name(plan)}",
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "learning_rate": plan.lr,
        "warmup_steps": plan.warmup_steps,
    }
    comments["per_device_train_batch_size"] = f"x {plan.accumulation_steps} accumulation x {plan.world_size} processes"
    if plan.optimizer_steps is not None:
        values["max_steps"] = plan.optimizer_steps
    else:
        notes.append(_steps_note(plan, "max_steps"))
    scheduler, scheduler_kwargs, problems = hf_scheduler(plan)
    values["lr_scheduler_type"] = scheduler
    if scheduler_kwargs:
        values["lr_scheduler_kwargs"] = scheduler_kwargs
    if scheduler == "polynomial" and plan.decay_kind == "linear":
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
    if spec.name in ("sgd", "nesterov"):
        values["optim"] = "sgd"
        values["optim_args"] = f"momentum={spec.momentum!r}" + (",nesterov=True" if spec.name == "nesterov" else "")
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
    tail = _epoch_tail_note(plan, "HF's Trainer")
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
    lines = _header(plan, notes, [f"schedule: {_schedule_words(plan)}", launch])
    lines += _kwargs_block("training_args", values, comments)
    lines.append("# args = transformers.TrainingArguments(**training_args)")
    if problems:
        lines += ["", "", *lr_factor_source(plan), "", "",
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
                  "    return PlanTrainer"]
    return Export("hf", "\n".join(lines) + "\n", values, notes)


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


# ---- Lightning --------------------------------------------------------------------------------------------


LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _lightning(plan: Plan) -> Export:
    recipe = plan.recipe
    notes: list[str] = []
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
    if plan.optimizer_steps is None:
        notes.append(_steps_note(plan, "max_steps"))
    for note in (_mean_loss_note(plan, "Lightning", "loss_sum * N * W / window_items"),
                 _epoch_tail_note(plan, "Lightning"), _no_torch_optimizer_note(plan)):
        if note:
            notes.append(note)
    values = {"trainer": trainer, "batch_size": plan.micro_batch}
    strategy: list[str] = []
    if sharded(plan):
        comments["strategy"] = "FSDP: trainer_kwargs['strategy'] = fsdp_strategy(model), below"
        blocks, block_note = fsdp_blocks(plan)
        notes += fsdp_notes(plan, "Lightning's FSDPStrategy",
                            "wraps the model in FSDP1 (FullyShardedDataParallel, flat parameters): the same sharding "
                            "and the same update, gradients averaged over processes and micro-batches instead")
        if block_note:
            notes.append(block_note)
        values["fsdp_blocks"] = blocks
        strategy = ["", "", *_lightning_fsdp_source(plan, blocks)]
    lines = _header(plan, notes, [f"schedule: {_schedule_words(plan)}"])
    lines += [
        f"batch_size = {plan.micro_batch}  # per device: DataLoader(train_set, batch_size=batch_size, "
        f"shuffle={recipe.data.shuffle}, drop_last={recipe.data.drop_last})",
        *_kwargs_block("trainer_kwargs", trainer, comments),
        "# trainer = lightning.Trainer(**trainer_kwargs)",
        *strategy,
        "", "",
        *lr_factor_source(plan), "", "",
        *param_groups_source(plan), "", "",
        *_configure_optimizers(plan),
    ]
    return Export("lightning", "\n".join(lines) + "\n", values, notes)


LIGHTNING_FSDP_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def _lightning_fsdp_source(plan: Plan, blocks: list[str]) -> list[str]:
    """`def fsdp_strategy(model)`: Lightning's FSDPStrategy sharded per block, with fp32 gradient reductions."""
    compute = LIGHTNING_FSDP_DTYPES.get(plan.recipe.precision)
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
        f"    blocks = set({_py(blocks)})",
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


# ---- DeepSpeed --------------------------------------------------------------------------------------------


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
    if recipe.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif recipe.precision == "fp16":
        config["fp16"] = {"enabled": True}
    if recipe.precision != "fp32":
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
                            "holding a whole gradient, N times the communication) and averages over processes")
        notes.append("ZeRO-3 checkpoints are partitioned; the whole fp32 model comes from DeepSpeed's "
                     "zero_to_fp32.py (reproduce run writes it as model.pt)")
    config["steps_per_print"] = max(1, min(100, (plan.optimizer_steps or 1000) // 20))
    return config, notes


def _deepspeed_scheduler(plan: Plan) -> tuple[dict | None, list[str]]:
    warmup, start, peak, low = plan.warmup_steps, plan.warmup_start_lr, plan.lr, plan.min_lr
    kind, end = plan.decay_kind, plan.decay_end_step
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
        why = f"step decay x{plan.decay_factor:g} at steps {plan.decay_milestones}"
    elif kind == "polynomial":
        why = "polynomial decay"
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


def _deepspeed(plan: Plan) -> Export:
    config, notes = deepspeed_config(plan)
    extra = [
        f"schedule: {_schedule_words(plan)}",
        "DeepSpeed itself reads this file with its comments (hjson); Hugging Face's and Accelerate's deepspeed= "
        "options read strict JSON: drop the # lines first (grep -v '^#')",
        f"launch: deepspeed --num_gpus={plan.world_size} train.py (DeepSpeed checks train_batch_size = "
        f"{plan.micro_batch} x {plan.accumulation_steps} x {plan.world_size})",
    ]
    text = "\n".join(_header(plan, notes, extra)) + "\n" + json.dumps(config, indent=2) + "\n"
    return Export("deepspeed", text, config, notes)


# ---- Accelerate -------------------------------------------------------------------------------------------


ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _accelerate(plan: Plan) -> Export:
    recipe = plan.recipe
    notes: list[str] = []
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
    for note in (_mean_loss_note(plan, "accelerator.backward", "loss_sum * N * W / window_items"),
                 _epoch_tail_note(plan, "Accelerate's accumulate()"),
                 _no_torch_optimizer_note(plan)):
        if note:
            notes.append(note)
    if plan.optimizer_steps is None:
        notes.append(_steps_note(plan, "the loop's step count"))
    plugin: list[str] = []
    fsdp_plugin = None
    if sharded(plan):
        config["fsdp_config"], fsdp_plugin = accelerate_fsdp(plan)
        notes += fsdp_notes(plan, "Accelerate", "syncs only at the end of accumulate() too (FSDP2's "
                            "set_requires_gradient_sync), and averages the gradients over processes and micro-batches")
        _, block_note = fsdp_blocks(plan)
        if block_note:
            notes.append(block_note)
        if recipe.precision != "fp32":
            compute = LIGHTNING_FSDP_DTYPES[recipe.precision]
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
    lines = _header(plan, notes, [f"schedule: {_schedule_words(plan)}"])
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


# ---- torchrun ---------------------------------------------------------------------------------------------


def torchrun_command(
    run_args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
    python: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m reproduce run ...`: what `reproduce run --nproc-per-node` launches
    (`reproduce.train.distributed.torchrun_command` calls this) and what `--emit torchrun` prints."""
    command = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}"]
    return [*command, "-m", "reproduce", "run", *run_args]


def _torchrun(plan: Plan) -> Export:
    notes: list[str] = []
    reason = why_not_runnable(plan.recipe)
    if reason:
        notes.append(f"this recipe is plan-only here ({reason}): reproduce run would stop with that error")
    out = f"runs/{_name(plan)}"
    recipe_path = plan.recipe_path or "RECIPE"
    plan_command = (
        f"reproduce plan {recipe_path} --micro-batch-max {plan.micro_batch_max} --world-size {plan.world_size}"
        + (" --policy fast" if plan.policy == "fast" else "") + " --out plan.yaml"
    )
    run_args = ["plan.yaml", "--out", out]
    command = torchrun_command(run_args, plan.world_size, python="python")
    lines = _header(plan, notes)
    lines += _comment("1. save the plan:")
    lines += _comment(plan_command, prefix="#    ", wrap=False)
    if plan.world_size == 1:
        lines += _comment("2. run it: one process needs no launcher (reproduce run plan.yaml --out "
                          f"{out}); the same under torchrun:")
    else:
        lines += _comment(f"2. run it on {plan.world_size} processes on this machine:")
    lines.append(" ".join(command))
    lines += _comment("the same, with reproduce starting torchrun itself:")
    lines += _comment(f"reproduce run plan.yaml --out {out} --nproc-per-node {plan.world_size}", "#    ", wrap=False)
    values: dict[str, Any] = {"command": command, "plan_command": plan_command}
    if plan.world_size > 1 and plan.world_size % 2 == 0:
        half = plan.world_size // 2
        multi = torchrun_command(run_args, half, nnodes=2, node_rank=0, rdzv_endpoint="HOST:29500", python="python")
        lines += _comment(f"on 2 machines of {half} processes: run on each, with --node-rank=1 on the second "
                          "(HOST: node 0's address):")
        lines += _comment(" ".join(multi), "#    ", wrap=False)
        values["two_nodes"] = multi
    return Export("torchrun", "\n".join(lines) + "\n", values, notes)


__all__ = ["FORMATS", "Export", "arithmetic_line", "check_format", "deepspeed_config", "emit", "export", "hf_scheduler",
           "lr_factor_source", "optimizer_source", "param_groups_source", "torchrun_command"]
