"""A plan in another trainer's own terms: Hugging Face, Lightning, DeepSpeed, Accelerate, torchrun, or SLURM (no
torch). `export(plan, fmt)` returns the text and the values it is made of (what tests hand to the real libraries).
Every text opens with the batch arithmetic and the LR rule, and says in comments what the framework cannot express or
does differently from `reproduce run` (docs/exports.md): m x N x W always carries over; the schedule where the
framework has it, else as `lr_factor(step)` for LambdaLR; Lightning and Accelerate divide each micro-batch's mean by
N, exact only when every micro-batch holds as many loss-bearing items.
"""

from __future__ import annotations

from ..errors import UserError
from ..plan.launch import GPUS_PER_NODE
from ..plan.planner import Plan
from . import accelerate, deepspeed, hf, lightning, torchrun
from .common import Export

BUILDERS = {"hf": hf.build, "lightning": lightning.build, "deepspeed": deepspeed.build,
            "accelerate": accelerate.build, "torchrun": torchrun.build, "slurm": torchrun.build_slurm}
FORMATS = tuple(BUILDERS)


def check_format(fmt: str) -> str:
    """`fmt` if it is one of FORMATS, else the one-line UserError `reproduce plan --emit` reports."""
    if fmt not in FORMATS:
        raise UserError(f"expected one of {', '.join(FORMATS)} (got {fmt!r})", field="emit_format")
    return fmt


def export(plan: Plan, fmt: str, gpus_per_node: int = GPUS_PER_NODE) -> Export:
    """The plan as `fmt` (one of FORMATS): its text and the values it is made of; `gpus_per_node`: slurm's nodes."""
    if check_format(fmt) == "slurm":
        return torchrun.build_slurm(plan, gpus_per_node)
    return BUILDERS[fmt](plan)

