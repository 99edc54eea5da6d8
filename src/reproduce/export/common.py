"""What every emitted form shares: the arithmetic line, the header of comments, shared notes, Python literals."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..plan.phases import phase_lines
from ..plan.planner import Plan
from ..plan.recipe import Lora
from ..plan.segments import batch_phases

WIDTH = 110


@dataclass(frozen=True)
class Export:
    """One emitted form: its text, the values in it, and the notes on what it does not carry over exactly."""

    fmt: str
    text: str
    values: dict
    notes: list[str] = field(default_factory=list)


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
        text + f", not the paper's {plan.paper_effective_batch} (x{plan.split.batch_factor:.4g}); "
        f"lr {plan.recipe.optimizer.lr:g} -> "
        f"{plan.lr:.6g} by the {plan.lr_scaling.rule} rule (x{plan.split.lr_factor:.4g})"
    )


def comment(text: str) -> list[str]:
    lines = textwrap.wrap(text, WIDTH - 2, break_long_words=False, break_on_hyphens=False)
    return ["# " + lines[0], *("#   " + line for line in lines[1:])] if lines else []


def header(plan: Plan, notes: list[str], extra: list[str] = ()) -> list[str]:
    recipe = plan.recipe
    lines = [arithmetic_line(plan)]
    source = plan.recipe_path or "recipe"
    if recipe.paper is not None:
        source += f": {recipe.paper.title}" + (f" ({recipe.paper.year})" if recipe.paper.year else "")
    lines += comment(source)
    if not plan.exact:
        lines += comment(f"LR rule: {plan.lr_scaling.source}")
    if plan.lr_scaling.adam_option is not None:
        option = plan.lr_scaling.adam_option
        lines += comment(
            f"optional, not applied: betas {[round(b, 6) for b in option.betas]} eps {option.eps:.3g} ({option.source})"
        )
    for text in [*(f"plan warning: {warning}" for warning in plan.warnings), *extra]:
        lines += comment(text)
    phases = batch_phases(plan.segments)  # no one setting switches the batch mid-run: say where reproduce run does
    if phases:
        notes = [*notes, "the batch changes during training; the settings here are the main batch's. reproduce run "
                 "switches at:", *phase_lines(phases, plan.world_size, plan.unit),
                 *(f"batch.phases[{index}] restarts the LR schedule at step {phase.start_step + 1} (lr "
                   f"{phase.schedule.lr:g}, warm-up {phase.schedule.warmup_steps} steps, {phase.schedule.decay_kind}): "
                   "the schedule settings here are the first phase's (reproduce plan --json gives lr_points)"
                   for index, phase in enumerate(phases) if phase.schedule is not None)]
    for note in [*model_notes(plan), *notes]:
        lines += comment(f"NOTE: {note}")
    return lines


TORCH_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}  # as source


def model_notes(plan: Plan) -> list[str]:
    """The model changes a recipe makes (`model.dtype`, `model.lora`), which no trainer setting carries."""
    spec, notes = plan.recipe.model, []
    if spec.dtype != "fp32":
        dtype = TORCH_DTYPES[spec.dtype]
        notes.append(
            f"the recipe stores the weights in {spec.dtype} (model.dtype), as reproduce run does: build or load the "
            f"model in it (model.to({dtype}), or from_pretrained(..., dtype={dtype})) before anything else"
        )
    if spec.lora is not None:
        notes.append(
            "the recipe trains LoRA adapters on frozen weights (model.lora), as reproduce run does with peft: "
            f"model = {lora_source(spec.lora)}; the optimizer takes only the parameters that require a gradient "
            "(peft keeps the adapters in fp32)"
        )
    notes += memory_notes(plan)
    return notes


def memory_notes(plan: Plan) -> list[str]:
    """The memory knobs of the recipe, with the code that sets them as `reproduce run` does."""
    recipe, notes = plan.recipe, []
    if recipe.model.activation_checkpointing:
        notes.append(
            "the recipe checkpoints activations per block (model.activation_checkpointing), as reproduce run does, "
            "before DDP or fully_shard wraps the model: a transformers model with model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}), any other with torch.utils.checkpoint.checkpoint("
            "block_forward, x, use_reentrant=False) around each block (the RNG state is kept: same dropout masks)"
        )
    if recipe.batch.sharding == "fsdp" and recipe.batch.sharded_gradients:
        notes.append(
            "the recipe keeps the gradients sharded through the window (batch.sharded_gradients): leave FSDP2's "
            "gradient sync on for every micro-batch (no set_requires_gradient_sync(False), no no_sync): each backward "
            "reduce-scatters, as a SUM of losses already divided by the window's global item count"
        )
    if recipe.batch.sharding == "fsdp" and recipe.batch.offload == "cpu":
        notes.append("the recipe offloads to the CPU (batch.offload): fully_shard(..., offload_policy="
                     "torch.distributed.fsdp.CPUOffloadPolicy()) on every unit and the root")
    return notes


def finetune_notes(plan: Plan, framework: str) -> list[str]:
    """What a framework's own settings do not carry of a fine-tuning recipe, with the code `reproduce run` uses."""
    recipe, notes = plan.recipe, []
    if recipe.model.quantize is not None:
        notes.append(f"{framework} has no setting for the recipe's {recipe.model.quantize} base (model.quantize): "
                     "load it with from_pretrained(..., quantization_config=transformers.BitsAndBytesConfig(...)) "
                     "(reproduce plan --emit hf writes the config) and call peft.prepare_model_for_kbit_training "
                     "before the adapters, as reproduce run does")
    optimizer = recipe.optimizer.bitsandbytes_class
    if optimizer is not None:
        notes.append(f"{framework} has no setting for the recipe's optimizer state (optimizer.paged / state_bits): "
                     f"step with bitsandbytes.optim.{optimizer}(params, lr=...) in place of torch.optim's, as "
                     "reproduce run does")
    if recipe.loss is not None and recipe.loss.normalization == "micro-batch-mean":
        notes.append("loss.normalization micro-batch-mean: each micro-batch's mean loss divided by the accumulation "
                     "steps (the Hugging Face Trainer before v4.46.0), not by the window's count of items")
    note = packing_note(plan, framework)
    if note:
        notes.append(note)
    return notes


def packing_note(plan: Plan, framework: str) -> str | None:
    """data.packing sorted / packed: no framework setting groups a step's samples so; what to do."""
    way, budget = plan.recipe.data.packing, plan.recipe.data.token_budget
    if way not in ("sorted", "packed"):
        return None
    tokens = f"{budget:,} tokens" if budget else "the micro-batch x the longest example's tokens"
    if way == "sorted":
        how = ("each optimizer step's samples ordered by length and cut into the fewest micro-batches of at most "
               f"{tokens} (rows x the longest row), padded within each")
    else:
        how = (f"each optimizer step's samples packed into micro-batches of at most {tokens}, one row each, position "
               "ids restarting at each sample, under a varlen attention (flash_attention_2 on a GPU: "
               "transformers.DataCollatorWithFlattening's rows)")
    return (f"data.packing {way}: {framework} has no setting for it: reproduce run groups {how}; the loss stays "
            "over the window's target tokens, so the emitted fixed micro-batches give the same update, with more "
            "padding")


def lora_source(lora: Lora, model: str = "model") -> str:
    """`peft.get_peft_model(model, peft.LoraConfig(...))` with the recipe's adapters, as `reproduce run` makes them."""
    return (
        f"peft.get_peft_model({model}, peft.LoraConfig(r={lora.r}, lora_alpha={lora.lora_alpha!r}, "
        f'lora_dropout={lora.dropout!r}, target_modules={py_literal(list(lora.target_modules))}, bias="none"))'
    )


def plan_command(plan: Plan) -> str:
    """The command that saves this plan as plan.yaml (--policy throughput's choice given as the maximum)."""
    largest = plan.micro_batch if plan.policy == "throughput" else plan.micro_batch_max
    return (f"reproduce plan {plan.recipe_path or 'RECIPE'} --micro-batch-max {largest} --world-size "
            f"{plan.world_size}" + (" --policy fast" if plan.policy == "fast" else "") + " --out plan.yaml")


def run_name(plan: Plan) -> str:
    return Path(plan.recipe_path).stem if plan.recipe_path else "run"


def steps_note(plan: Plan, what: str) -> str | None:
    return None if plan.optimizer_steps is not None else (
        f"{what}: the plan has no step count (the dataset size is unknown; set data.train_size in the recipe or "
        "plan a run): set it yourself")


def epoch_tail_note(plan: Plan, framework: str) -> str | None:
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


def mean_loss_note(plan: Plan, framework: str, scale: str) -> str | None:
    """Lightning and Accelerate scale each micro-batch's loss by 1/N (and DDP averages over W)."""
    if plan.recipe.task == "classification" and plan.recipe.data.drop_last:
        return None  # equal micro-batches of samples: the mean of micro-batch means is the batch mean
    return (
        f"{framework} divides each micro-batch's loss by {plan.accumulation_steps} and DDP averages over "
        f"{plan.world_size} process(es): a per-micro-batch mean is exact only when every micro-batch holds the same "
        f"number of loss-bearing items. For token losses return {scale}, where window_items counts the target "
        "tokens != -100 of all N micro-batches on all processes (reproduce run does this)"
    )


def py_literal(value: Any) -> str:
    """A Python literal (floats exactly, by repr)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)  # double quotes: a valid Python literal
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py_literal(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
    return repr(value)


def kwargs_block(name: str, values: dict, comments: dict[str, str]) -> list[str]:
    lines = [f"{name} = dict("]
    for key, value in values.items():
        line = f"    {key}={py_literal(value)},"
        if key in comments:
            line += f"  # {comments[key]}"
        lines.append(line)
    return [*lines, ")"]
