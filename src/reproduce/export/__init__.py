"""A plan in another trainer's own terms: Hugging Face, Lightning, DeepSpeed, Accelerate, torchrun, or SLURM.

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
A recipe's model changes (`model.lora`, `model.dtype`) are stated in every form with the code that makes them.

One module per framework; `common` and `code` hold what they share, `fsdp` the sharded pieces.
"""

from __future__ import annotations

from ..errors import UserError
from ..plan.launch import GPUS_PER_NODE
from ..plan.planner import Plan
from . import accelerate, deepspeed, hf, lightning, slurm, torchrun
from .code import lr_factor_source, optimizer_source, param_groups_source
from .common import Export, arithmetic_line
from .deepspeed import deepspeed_config
from .hf import hf_scheduler
from .torchrun import torchrun_command

BUILDERS = {"hf": hf.build, "lightning": lightning.build, "deepspeed": deepspeed.build,
            "accelerate": accelerate.build, "torchrun": torchrun.build, "slurm": slurm.build}
FORMATS = tuple(BUILDERS)


def emit(plan: Plan, fmt: str, gpus_per_node: int = GPUS_PER_NODE) -> str:
    """The plan as `fmt` (hf, lightning, deepspeed, accelerate, torchrun, slurm): text that starts with a comment
    (slurm: `#!/bin/bash`, then the comments); `gpus_per_node`: slurm's nodes."""
    return export(plan, fmt, gpus_per_node).text


def check_format(fmt: str) -> str:
    """`fmt` if it is one of FORMATS, else the one-line UserError `reproduce plan --emit` reports."""
    if fmt not in FORMATS:
        raise UserError(f"expected one of {', '.join(FORMATS)} (got {fmt!r})", field="emit_format")
    return fmt


def export(plan: Plan, fmt: str, gpus_per_node: int = GPUS_PER_NODE) -> Export:
    if check_format(fmt) == "slurm":
        return slurm.build(plan, gpus_per_node)
    return BUILDERS[fmt](plan)


__all__ = ["FORMATS", "Export", "arithmetic_line", "check_format", "deepspeed_config", "emit", "export", "hf_scheduler",
           "lr_factor_source", "optimizer_source", "param_groups_source", "torchrun_command"]
