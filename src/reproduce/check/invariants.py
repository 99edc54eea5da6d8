"""The invariants every plan must satisfy, derived here independently of the planner (a `plan` check's verdict)."""

from __future__ import annotations

import math
from typing import Any

from ..errors import UserError
from ..plan.planfile import check_plan
from ..plan.planner import Plan
from ..plan.recipe import Length
from ..plan.segments import batch_phases
from .schema import Budget


def plan_problems(plan: Plan, budget: Budget) -> list[str]:
    """Invariants every plan must satisfy, derived here independently of the planner."""
    problems = []
    try:
        check_plan(plan, "plan")
    except UserError as error:
        problems.extend(line.removeprefix("plan: ") for line in error.lines)
    recipe = plan.recipe
    paper = recipe.batch.sequences
    micro, accumulation, world = plan.micro_batch, plan.accumulation_steps, plan.world_size
    if micro * accumulation * world != plan.effective_batch:
        problems.append(f"effective batch: {micro} x {accumulation} x {world} != {plan.effective_batch}")
    if budget.micro_batch_max is not None and micro > budget.micro_batch_max:
        problems.append(f"micro_batch: {micro} exceeds the budget's micro_batch_max {budget.micro_batch_max}")
    if world != budget.world_size:
        problems.append(f"world_size: {world}, but the budget declares {budget.world_size}")
    if budget.policy == "exact" and paper % budget.world_size == 0 and not plan.exact:
        problems.append(f"exact: {paper} {recipe.batch.count_unit} split over {budget.world_size} process(es) "
                        f"exactly, but the plan's batch is {plan.effective_batch}")
    # the LR rule as stated
    factor = plan.effective_batch / paper
    if plan.exact:
        rule = "exact"
    elif recipe.scaling_rule == "auto":
        rule = "linear" if recipe.optimizer.family == "sgd" else "sqrt"
    else:
        rule = recipe.scaling_rule
    want_lr = recipe.optimizer.lr * {"exact": 1.0, "none": 1.0, "linear": factor, "sqrt": math.sqrt(factor)}[rule]
    if plan.lr_scaling.rule != rule:
        problems.append(f"lr_rule: expected {rule} (scaling_rule {recipe.scaling_rule}, optimizer "
                        f"{recipe.optimizer.name}), the plan applies {plan.lr_scaling.rule}")
    if not math.isclose(plan.lr, want_lr, rel_tol=1e-9):
        problems.append(f"lr: the {rule} rule gives {want_lr:.6g} for batch x{factor:.4g}; the plan has "
                        f"{plan.lr:.6g}")
    if batch_phases(plan.segments):
        # a changing batch's steps come from walking its phases, which must cover the recipe's
        return problems + _phase_schedule_problems(plan)
    # steps converted: the same data as the paper's schedule covers
    dataset = plan.dataset_size
    per_epoch = None
    if dataset is not None:
        full, rest = divmod(dataset, plan.effective_batch)
        per_epoch = full if recipe.data.drop_last or not rest else full + 1
        if plan.steps_per_epoch != per_epoch:
            problems.append(f"steps_per_epoch: {dataset} // {plan.effective_batch} gives {per_epoch}; the "
                            f"plan has {plan.steps_per_epoch}")
    paper_batch = (recipe.batch.sequences, recipe.batch.sequence_length)  # in samples (sequences), for steps
    total = _steps(recipe.schedule.total, *paper_batch, plan.effective_batch, per_epoch)
    if total is not None and plan.optimizer_steps != total:
        problems.append(f"optimizer_steps: schedule.total {recipe.schedule.total.label()} is {total} steps of "
                        f"{plan.effective_batch}; the plan has {plan.optimizer_steps}")
    warmup = recipe.schedule.warmup
    if warmup is not None:
        if warmup.ratio is not None:
            want = round(warmup.ratio * plan.optimizer_steps) if plan.optimizer_steps is not None else None
        else:
            want = _steps(warmup, *paper_batch, plan.effective_batch, per_epoch)
        if want is not None and plan.warmup_steps != want:
            problems.append(f"warmup_steps: expected {want}, the plan has {plan.warmup_steps}")
    milestones = recipe.schedule.decay.milestones
    if milestones is not None:
        want = [_steps(Length(**{milestones.unit: v}), *paper_batch, plan.effective_batch, per_epoch)
                for v in milestones.value]
        if None not in want and plan.schedule.decay_milestones != want:
            problems.append(f"decay_milestones: expected {want}, the plan has {plan.schedule.decay_milestones}")
    if recipe.model.has_batchnorm and recipe.batch.per_device:
        per_device = recipe.batch.per_device
        per_rank = paper // world if paper % world == 0 else None
        fits = budget.micro_batch_max is None or per_device <= budget.micro_batch_max
        if fits and per_rank and per_rank % per_device == 0 and micro != per_device:
            problems.append(f"micro_batch: BatchNorm: the paper's per-device batch {per_device} fits and divides "
                            f"the batch, but the plan uses {micro}")
    return problems


def _phase_schedule_problems(plan: Plan) -> list[str]:
    """With batch phases: each phase's length in steps covers the data the recipe's phase length says, re-derived
    here phase by phase (exact phases keep the paper's steps)."""
    problems = []
    for index, (phase, spec) in enumerate(zip(plan.segments, plan.recipe.batch.phases or [], strict=False)):
        if phase.steps is None:
            continue
        want = _steps(spec, phase.paper_effective_batch, phase.sequence_length, phase.effective_batch,
                      phase.steps_per_epoch)
        if want is not None and want != phase.steps:
            problems.append(f"phases[{index}].steps: batch.phases[{index}] is {spec.label()}, {want} steps of "
                            f"{phase.effective_batch}; the plan has {phase.steps}")
    return problems


def _steps(length: Any, paper_batch: int, sequence_length: int | None, effective: int,
           per_epoch: int | None) -> int | None:
    """`length` in optimizer steps of `effective` samples: the data it covers, at the paper's batch for steps."""
    unit, value = length.unit, length.value
    if unit == "epochs":
        return None if per_epoch is None else round(value * per_epoch)
    samples = {"steps": lambda: value * paper_batch, "samples": lambda: value,
               "tokens": lambda: value / sequence_length}[unit]()
    return round(samples / effective)

