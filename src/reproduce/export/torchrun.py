"""The torchrun command that runs the plan with `reproduce run`, on one machine or two."""

from __future__ import annotations

from typing import Any

from ..plan.builtin_names import why_not_runnable
from ..plan.launch import torchrun_command
from ..plan.planner import Plan
from .common import Export, comment, header, plan_command, run_name


def build(plan: Plan) -> Export:
    notes: list[str] = []
    reason = why_not_runnable(plan.recipe)
    if reason:
        notes.append(f"this recipe is plan-only here ({reason}): reproduce run would stop with that error")
    out = f"runs/{run_name(plan)}"
    saving = plan_command(plan)
    run_args = ["plan.yaml", "--out", out]
    command = torchrun_command(run_args, plan.world_size, python="python")
    lines = header(plan, notes)
    lines += comment("1. save the plan:")
    lines.append("#    " + saving)
    if plan.world_size == 1:
        lines += comment("2. run it: one process needs no launcher (reproduce run plan.yaml --out "
                          f"{out}); the same under torchrun:")
    else:
        lines += comment(f"2. run it on {plan.world_size} processes on this machine:")
    lines.append(" ".join(command))
    lines += comment("the same, with reproduce starting torchrun itself:")
    lines.append(f"#    reproduce run plan.yaml --out {out} --nproc-per-node {plan.world_size}")
    values: dict[str, Any] = {"command": command, "plan_command": saving}
    if plan.world_size > 1 and plan.world_size % 2 == 0:
        half = plan.world_size // 2
        multi = torchrun_command(run_args, half, nnodes=2, node_rank=0, rdzv_endpoint="HOST:29500", python="python")
        lines += comment(f"on 2 machines of {half} processes: run on each, with --node-rank=1 on the second "
                          "(HOST: node 0's address):")
        lines.append("#    " + " ".join(multi))
        values["two_nodes"] = multi
    return Export("torchrun", "\n".join(lines) + "\n", values, notes)
