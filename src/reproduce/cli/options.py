"""The options several commands share, declared once: the choices, their help texts, the flags turned into the
core's arguments. No command lives here, so every command may import it.

And a user error's names as the user typed them: the core names a request's field (`micro_batch_max`) or a recipe's
dotted path (`batch.sharding`) in backticks, never a flag; here each becomes its flag. A field prints as its option's
flag (from what typer registered, so it cannot drift); a recipe path as its flag when the user typed that flag,
else as the path they wrote. Other names are left as they are.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from functools import cache
from typing import Annotated

import typer
import typer.main

from ..plan.batchnorm import MODES as BATCHNORM_MODES
from ..plan.overlay import Change
from ..plan.recipe import PACKING_WAYS, QUANTIZED_BASES
from ..plan.units import parse_size
from ..probe.runner import ProbeOptions
from .app import app

Policy = Enum("Policy", {"exact": "exact", "fast": "fast", "throughput": "throughput"}, type=str)
Sharding = Enum("Sharding", {"none": "none", "fsdp": "fsdp"}, type=str)
MeterName = Enum("MeterName", {"auto": "auto", "cuda": "cuda", "cpu": "cpu", "estimate": "estimate"}, type=str)
Offload = Enum("Offload", {"none": "none", "cpu": "cpu"}, type=str)

# the choices the core defines (plan/recipe/model.py's quantised bases, plan/batchnorm.py's modes), as typer's enums
Quantize = Enum("Quantize", {name: name for name in QUANTIZED_BASES}, type=str)
BatchNormChoice = Enum("BatchNormChoice", {name: name for name in BATCHNORM_MODES}, type=str)
PackingChoice = Enum("PackingChoice", {name: name for name in PACKING_WAYS}, type=str)


SET_HELP = ("Set a recipe field by its dotted path, as if the file said it: --set optimizer.lr=1e-4 --set "
            "data.max_length=1024 (the value read as YAML, the recipe validated again; repeat for several).")
MICRO_BATCH_MAX_HELP = "Largest micro-batch known to fit on one device (skips the memory probe)."
WORLD_SIZE_HELP = "Number of data-parallel processes (GPUs) the run will use."
POLICY_HELP = (
    "exact: keep the paper's effective batch exactly; fast: the nearest batch with a larger micro-batch; throughput: "
    "the exact split with the most samples per second, timed (BatchNorm keeps the paper's per-device batch)."
)
MEMORY_HELP = "Memory budget of one device to probe for, such as 24GiB, 16GB or 512MiB."
GPU_HELP = "Plan for this GPU's memory (datasheet figure), such as a100-80gb, h100-80gb, rtx4090, t4."
METER_HELP = (
    "cuda: real trials on this GPU; cpu: real trials on the CPU, tensors counted against the budget; "
    "estimate: fake tensors, no real memory (a GPU you do not have). auto: cuda when there is one, else estimate."
)
HEADROOM_HELP = "Fraction of the budget kept free: the largest micro-batch must peak under budget x (1 - headroom)."
NO_CACHE_HELP = "Probe again even when a cached result for this recipe, device and budget exists."
SHARDING_HELP = (
    "none: every process holds the whole model (DDP); fsdp: parameters, gradients and optimizer state sharded "
    "over the processes (FSDP2 full_shard; plan and probe need --world-size 2 or more). Default: the recipe's "
    "batch.sharding."
)
CHECKPOINTING_HELP = (
    "Recompute each block's activations in backward instead of keeping them (model.activation_checkpointing): "
    "less activation memory for about a third more compute; exact."
)
SHARDED_GRADIENTS_HELP = (
    "With --sharding fsdp: reduce-scatter the gradients after every micro-batch so they stay sharded through the "
    "accumulation window (batch.sharded_gradients); more communication, exact."
)
QUANTIZE_HELP = (
    "Store the frozen base's linear layers in 8 bits (int8: LLM.int8()) or 4 bits (nf4: QLoRA) through bitsandbytes, "
    "under the recipe's LoRA (model.quantize; the option overrides the field). Needs the quantize extra."
)
WEIGHTS_HELP = (
    "Start from these pretrained weights, instead of the recipe's model.weights: a Hugging Face model folder "
    "(config.json + safetensors; its config is the architecture) or a state dict file (.safetensors, .pt, .pth)."
)
BACKBONE_WEIGHTS_HELP = (
    "Segmentation built-ins: load an ImageNet-pretrained backbone from this file (a torchvision or timm ResNet state "
    "dict, or an MMSegmentation / MMPretrain checkpoint), instead of the recipe's model.backbone_weights."
)
OFFLOAD_HELP = (
    "With --sharding fsdp: cpu keeps parameters, gradients and optimizer state in CPU memory (batch.offload)."
)

BATCHNORM_HELP = (
    "BatchNorm when the micro-batch is below the paper's BN batch (model.batchnorm): keep (per micro-batch), sync "
    "(SyncBatchNorm over the --world-size CUDA processes), frozen (FrozenBatchNorm2d: fixed statistics, for "
    "pretrained weights), group (GroupNorm, a deviation). The plan prints the BN batch against the paper's."
)

PACKING_HELP = (
    "How each window's samples group into micro-batches (data.packing): none (the micro-batch of m samples), sorted "
    "(by length, at most --token-budget tokens each, padded within), packed (rows of samples, attention confined to "
    "each). The window's samples, and so the gradient, are the same with each. Default: sorted for instruction and "
    "chat data, else none."
)
TOKEN_BUDGET_HELP = ("sorted / packed: tokens per micro-batch, padding included (default: the largest the probe "
                     "measured to fit for sorted, else micro-batch x the longest).")


# The options several commands declare alike, each declared here once (the default is the parameter's).
MicroBatchMaxOption = Annotated[int | None, typer.Option("--micro-batch-max", min=1, help=MICRO_BATCH_MAX_HELP)]
WorldSizeOption = Annotated[int, typer.Option("--world-size", min=1, help=WORLD_SIZE_HELP)]
PolicyOption = Annotated[Policy, typer.Option("--policy", help=POLICY_HELP)]
SetOption = Annotated[list[str] | None, typer.Option("--set", metavar="FIELD.PATH=VALUE", help=SET_HELP)]
# the probe's: the budget and how it is measured (`probe_options`)
MemoryOption = Annotated[str | None, typer.Option("--memory", metavar="SIZE", help=MEMORY_HELP)]
GpuOption = Annotated[str | None, typer.Option("--gpu", metavar="NAME", help=GPU_HELP)]
MeterOption = Annotated[MeterName, typer.Option("--meter", help=METER_HELP)]
HeadroomOption = Annotated[float, typer.Option("--headroom", help=HEADROOM_HELP)]
NoCacheOption = Annotated[bool, typer.Option("--no-cache", help=NO_CACHE_HELP)]
# the aliases of one recipe field each (FIELD_OF_FLAG; `alias_changes` reads them off the command)
WeightsOption = Annotated[str | None, typer.Option("--weights", metavar="PATH", help=WEIGHTS_HELP)]
BackboneWeightsOption = Annotated[str | None, typer.Option("--backbone-weights", metavar="FILE",
                                                           help=BACKBONE_WEIGHTS_HELP)]
QuantizeOption = Annotated[Quantize | None, typer.Option("--quantize", help=QUANTIZE_HELP)]
ShardingOption = Annotated[Sharding | None, typer.Option("--sharding", help=SHARDING_HELP)]
CheckpointingOption = Annotated[bool, typer.Option("--activation-checkpointing", help=CHECKPOINTING_HELP)]
ShardedGradientsOption = Annotated[bool, typer.Option("--sharded-gradients", help=SHARDED_GRADIENTS_HELP)]
OffloadOption = Annotated[Offload | None, typer.Option("--offload", help=OFFLOAD_HELP)]
BatchNormOption = Annotated[BatchNormChoice | None, typer.Option("--batchnorm", help=BATCHNORM_HELP)]
PackingOption = Annotated[PackingChoice | None, typer.Option("--packing", help=PACKING_HELP)]
TokenBudgetOption = Annotated[int | None, typer.Option("--token-budget", min=1, help=TOKEN_BUDGET_HELP)]


def probe_options(memory: str | None, gpu: str | None, meter: MeterName, headroom: float, no_cache: bool
                  ) -> ProbeOptions:
    """The probe's options from the flags (--memory checked now, before anything is built or written)."""
    if memory is not None:
        parse_size(memory, "--memory")
    return ProbeOptions(memory=memory, gpu=gpu, meter=meter.value, headroom=headroom, use_cache=not no_cache)


# Each option that changes the recipe aliases one field; a new recipe knob gets no option (`--set` reaches it).
FIELD_OF_FLAG = {
    "--weights": "model.weights",
    "--backbone-weights": "model.backbone_weights",
    "--data": "data.path",
    "--eval-data": "data.eval_path",
    "--quantize": "model.quantize",
    "--sharding": "batch.sharding",
    "--activation-checkpointing": "model.activation_checkpointing",
    "--sharded-gradients": "batch.sharded_gradients",
    "--offload": "batch.offload",
    "--batchnorm": "model.batchnorm",
    "--packing": "data.packing",
    "--token-budget": "data.token_budget",
}
FLAG_OF_FIELD = {path: flag for flag, path in FIELD_OF_FLAG.items()}


def alias_changes(context: typer.Context) -> list[Change]:
    """The given options of the command that alias a recipe field, as their fields' changes in the table's order
    (a switch only switches its field on)."""
    given = {param.opts[0]: context.params[param.name] for param in context.command.params
             if param.opts and param.opts[0] in FIELD_OF_FLAG and param.name is not None}
    values = {flag: value.value if isinstance(value, Enum) else value for flag, value in given.items()}
    return [Change(path, values[flag], f"`{path}`") for flag, path in FIELD_OF_FLAG.items()
            if values.get(flag) is not None and values.get(flag) is not False]


typed_args: list[str] = []  # the command's arguments as typed (set by `main`), for a "start again with" line
NAME = re.compile(r"`([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)`")


@cache
def request_flags() -> dict[str, str]:
    """Each option's parameter name and its flag, over every command (`micro_batch_max` -> `--micro-batch-max`)."""
    root = typer.main.get_command(app)  # the commands are its own, one level deep
    flags: dict[str, str] = {}
    for command in [root, *getattr(root, "commands", {}).values()]:
        for param in command.params:
            if param.param_type_name == "option":
                flags.setdefault(param.name, param.opts[0])
    return flags


def typed(flag: str, argv: Sequence[str]) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def shown(name: str, argv: Sequence[str]) -> str | None:
    """What the CLI prints for the field `name`: its flag, the path itself, or None for a name that is no field."""
    if name in FLAG_OF_FIELD:  # a recipe field an option aliases: the option when the user typed it
        return FLAG_OF_FIELD[name] if typed(FLAG_OF_FIELD[name], argv) else name
    if "." in name:  # a recipe's path no option sets
        return name
    return request_flags().get(name)


def as_typed(line: str, argv: Sequence[str]) -> str:
    """`line` with each field it names in backticks as the user can give it (see the module's docstring)."""
    return NAME.sub(lambda match: shown(match.group(1), argv) or match.group(0), line)
