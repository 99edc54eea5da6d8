"""The torchrun command that runs the plan with `reproduce run`, on one machine or two, or an sbatch script that
runs it on a SLURM cluster."""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from ..plan.builtin_names import why_not_runnable
from ..plan.launch import GPUS_PER_NODE, node_split, torchrun_command
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


SIGNAL_SECONDS = 300  # the warning before the time limit: time to finish a step and write the checkpoint
MAX_RESTARTS = 3  # torchrun's restarts of a failed group inside one allocation
PORT = 29500


def build_slurm(plan: Plan, gpus_per_node: int = GPUS_PER_NODE) -> Export:
    """An sbatch script: one torchrun per node through `srun`, a c10d rendezvous on the job's first host, and a run
    that continues by itself after a requeue (`--auto-resume`)."""
    if plan.world_size == 1:
        raise UserError("`emit_format` slurm: the plan runs on 1 process, which needs no launcher: plan it for several "
                        "(`world_size`) or submit `reproduce run` itself (sbatch --gpus=1 --wrap '...')")
    nodes, per_node = node_split(plan.world_size, gpus_per_node)
    name = run_name(plan)
    out = f"runs/{name}"
    saving = plan_command(plan)
    run = torchrun_command(["plan.yaml", "--out", out, "--auto-resume"], per_node, nodes, None,
                           f"$HEAD_NODE:{PORT}", "python", MAX_RESTARTS, "$SLURM_JOB_ID")
    lines = ["#!/bin/bash", *header(plan, [])]
    lines += comment(f"{nodes} node(s) x {per_node} GPU(s) = the plan's {plan.world_size} processes (their product "
                     "must stay the plan's world size; --gpus-per-node changes the split)")
    lines += comment("1. save the plan beside this script:")
    lines.append("#    " + saving)
    lines += comment(f"2. sbatch this file. {SIGNAL_SECONDS} s before --time runs out the job checkpoints, stops and "
                     "requeues itself; the requeued job (and a torchrun restart after a failed process) continues "
                     f"from {out}/checkpoints/last.pt")
    lines += [
        f"#SBATCH --job-name=reproduce-{name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --time=24:00:00",
        f"#SBATCH --signal=B:USR1@{SIGNAL_SECONDS}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output=reproduce-{name}-%j.out",
        "",
        "set -uo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "",
        "# USR1 (the time limit is near): SIGTERM to the job step's tasks, each node's torchrun, which passes it to",
        "# every rank; the ranks finish the same optimizer step, checkpoint and stop; then the job goes back in the",
        "# queue. (Not `kill -TERM` on srun: srun ends its step with SIGKILL, before any checkpoint.)",
        "stop_and_requeue() {",
        '  echo "time limit near: checkpointing, then requeueing job $SLURM_JOB_ID"',
        '  scancel --signal=TERM "$SLURM_JOB_ID.0"',
        '  wait "$RUN"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "}",
        "trap stop_and_requeue USR1",
        "",
        "srun --kill-on-bad-exit=1 " + " ".join(run) + " &",
        "RUN=$!",
        'wait "$RUN"',
    ]
    values = {"nodes": nodes, "gpus_per_node": per_node, "torchrun": run, "plan_command": saving}
    return Export("slurm", "\n".join(lines) + "\n", values, [])
