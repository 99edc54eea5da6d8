"""Learning-rate schedules in optimizer steps: the recipe's, each batch phase's own, and plateau decay.

Pure Python, no torch. A schedule (`StepSchedule`) covers consecutive optimizer steps: a linear warm-up from its start,
then its decay (constant, step milestones, cosine, linear, polynomial) to `decay_end_step`. The recipe's
`schedule.warmup` / `decay` is the first one, from step 0; a batch phase that gives its own `lr`, `warmup` or `decay`
(LAMB's second stage warms up again, You et al. 2019) starts another at its first step, with lengths counted in its
own units (its steps, epochs, samples or tokens at its batch). A schedule runs until the next one starts or the run
ends, and its decay ends there unless `decay.until` says otherwise. A phase without a schedule of its own continues
the one before it, with its own LR-rule factor when its batch is not the paper's.

`plan_lr(plan, step)` is the LR of optimizer step `step` (0-based) as `reproduce run` uses it; `lr_points(plan)` are
the `[step, lr]` pairs (1-based steps, as metrics.jsonl numbers them) where the schedule changes shape.

Plateau decay (He et al. 2016, "divided by 10 when the error plateaus") is `torch.optim.lr_scheduler.ReduceLROnPlateau`
at the evaluation points: `Plateau` keeps its state (best value, bad evaluations, cooldown, the LR scale) as plain
numbers for the checkpoint, and multiplies the planned LR by its scale. Its decreases depend on the run, so the plan
knows the schedule only up to the first step where one could happen (`first_plateau_step`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from .errors import UserError
from .recipe import Decay, Length, Recipe

if TYPE_CHECKING:
    from .phases import PlanPhase
    from .planner import Plan


class StepSchedule(BaseModel):
    """One schedule in optimizer steps (0-based, absolute): what a batch phase's own `lr/warmup/decay` plans to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_step: int
    end_step: int | None  # where the next schedule starts or the run ends (None: unknown)
    lr: float  # the peak, with the phase's LR-rule factor
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0
    decay_kind: str = "constant"
    decay_milestones: list[int] = []
    decay_factor: float = 0.1
    decay_end_step: int | None = None
    min_lr: float = 0.0
    power: float = 1.0

    def lr_at(self, step: int) -> float:
        """The LR of optimizer step `step` (0-based, absolute) under this schedule."""
        peak, warmup, since = self.lr, self.warmup_steps, step - self.start_step
        if since < warmup:
            return self.warmup_start_lr + (peak - self.warmup_start_lr) * since / warmup
        kind = self.decay_kind
        if kind in ("constant", "plateau"):  # plateau: the run multiplies this by its Plateau's scale
            return peak
        if kind == "step":
            return peak * self.decay_factor ** sum(step >= m for m in self.decay_milestones)
        end = self.decay_end_step if self.decay_end_step is not None else self.end_step
        begin = self.start_step + warmup
        if end is None or end <= begin:
            return peak
        progress = min(1.0, max(0.0, (step - begin) / (end - begin)))
        if kind == "cosine":
            return self.min_lr + (peak - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        if kind == "linear":
            return peak + (self.min_lr - peak) * progress
        return self.min_lr + (peak - self.min_lr) * (1 - progress) ** self.power


def global_schedule(plan: Plan) -> StepSchedule:
    """The recipe's own schedule (schedule.warmup / decay) as the plan holds it, from step 0."""
    return StepSchedule(
        start_step=0, end_step=plan.optimizer_steps, lr=plan.lr, warmup_steps=plan.warmup_steps,
        warmup_start_lr=plan.warmup_start_lr, decay_kind=plan.decay_kind, decay_milestones=plan.decay_milestones,
        decay_factor=plan.decay_factor, decay_end_step=plan.decay_end_step, min_lr=plan.min_lr,
        power=plan.recipe.schedule.decay.power,
    )


def plan_lr(plan: Plan, step: int) -> float:
    """The LR of optimizer step `step` (0-based): the schedule it falls in, at its batch phase's LR-rule factor.

    A phase whose batch is not the paper's multiplies the schedule it continues by its own factor over that
    schedule's (the main batch's for the recipe's schedule, the owning phase's for a phase's own)."""
    owner = schedule_owner(plan.phases, step)
    schedule, factor = (owner.schedule, owner.lr_factor) if owner is not None else (global_schedule(plan),
                                                                                   plan.lr_factor)
    value = schedule.lr_at(step)
    if plan.phases:
        from .phases import phase_index

        phase = plan.phases[phase_index(plan.phases, step)]
        if phase.lr_factor != factor:
            value = value * phase.lr_factor / factor
    return value


def schedule_owner(phases: list[PlanPhase], step: int) -> PlanPhase | None:
    """The last phase at or before `step` that starts a schedule of its own (None: the recipe's schedule)."""
    owner = None
    for phase in phases:
        if phase.start_step > step:
            break
        if phase.schedule is not None:
            owner = phase
    return owner


# ---- planning the phases' own schedules ---------------------------------------------------------------------


def first_own_schedule_step(recipe: Recipe, phases: list[PlanPhase]) -> int | None:
    """The first step of the first phase with a schedule of its own: where the recipe's schedule ends."""
    for spec, phase in zip(recipe.batch.phases or [], phases, strict=False):
        if spec.has_schedule:
            return phase.start_step
    return None


def attach_phase_schedules(recipe: Recipe, phases: list[PlanPhase], total: int | None, warnings: list[str],
                           source: str | None = None, first_warmup: int = 0) -> list[PlanPhase]:
    """`phases` with each phase's own schedule (`batch.phases[i].lr / warmup / decay`) planned into its steps;
    errors name `source` (the recipe's file). `first_warmup`: the recipe's own warm-up, in steps."""
    specs = recipe.batch.phases or []
    if not any(spec.has_schedule for spec in specs):
        return phases
    from .phases import own_steps

    starts = [phase.start_step for spec, phase in zip(specs, phases, strict=True) if spec.has_schedule]
    if first_warmup > starts[0]:
        first = next(index for index, spec in enumerate(specs) if spec.has_schedule)
        warnings.append(f"schedule.warmup: {first_warmup} steps, but batch.phases[{first}] starts its own schedule at "
                        f"step {starts[0] + 1}: the recipe's warm-up never reaches its peak")
    result = list(phases)
    for index, (spec, phase) in enumerate(zip(specs, phases, strict=True)):
        if not spec.has_schedule:
            continue
        what = f"{source}: batch.phases[{index}]" if source else f"batch.phases[{index}]"
        later = [start for start in starts if start > phase.start_step]
        end = later[0] if later else total
        if end is None:
            raise UserError(f"{what}: its own schedule needs the run's length in optimizer steps, which is unknown "
                            "(set data.train_size)")
        if end <= phase.start_step:
            raise UserError(f"{what}: its own schedule has no length to run over: the phase starts at step "
                            f"{phase.start_step + 1}, but " + (f"the run ends after {end} optimizer steps" if not later
                                                               else f"the next schedule starts at step {end + 1}"))
        paper = phase.paper_effective_batch

        def steps(length: Length, name: str, phase=phase, paper=paper, what=what) -> int:
            return own_steps(length, phase, paper, f"{what}.{name}")

        span = end - phase.start_step
        peak = (spec.lr if spec.lr is not None else recipe.optimizer.lr) * phase.lr_factor
        warmup = spec.warmup
        warmup_steps, start_lr = 0, 0.0
        if warmup is not None:
            warmup_steps = round(warmup.ratio * span) if warmup.ratio is not None else steps(warmup, "warmup")
            start_lr = (warmup.start_lr if warmup.start_lr is not None
                        else (warmup.start_factor or 0.0) * peak)
        if warmup_steps > span:
            warnings.append(f"{what}.warmup: {warmup_steps} steps, longer than the {span} steps its schedule runs")
        decay = spec.decay or _inherited_decay(recipe.schedule.decay, what)
        milestones = []
        if decay.milestones is not None:
            milestones = [phase.start_step + steps(Length(**{decay.milestones.unit: value}), "decay.milestones")
                          for value in decay.milestones.value]
        decay_end = phase.start_step + steps(decay.until, "decay.until") if decay.until is not None else end
        min_lr = decay.min_lr * phase.lr_factor if decay.min_lr is not None else (decay.min_ratio or 0.0) * peak
        schedule = StepSchedule(
            start_step=phase.start_step, end_step=end, lr=peak, warmup_steps=warmup_steps, warmup_start_lr=start_lr,
            decay_kind=decay.kind, decay_milestones=milestones, decay_factor=decay.factor, decay_end_step=decay_end,
            min_lr=min_lr, power=decay.power,
        )
        result[index] = phase.model_copy(update={"schedule": schedule})
    return result


def _inherited_decay(decay: Decay, what: str) -> Decay:
    """A phase's decay when it gives none: the recipe's kind and its final LR, over the phase's own schedule."""
    if decay.kind == "step":
        raise UserError(f"{what}.decay: required: the recipe's step decay counts its milestones from the run's start; "
                        "give the phase's own (e.g. {kind: step, milestones: {steps: [...]}})")
    return decay.model_copy(update={"until": None, "milestones": None})


# ---- the schedule as points --------------------------------------------------------------------------------


def first_plateau_step(plan: Plan) -> int | None:
    """Plateau decay: the first optimizer step (0-based) whose LR a decrease could change, None otherwise.

    ReduceLROnPlateau decreases after `patience + 1` evaluations without improvement on the best one; the first
    evaluation counted (one after the warm-up) sets the best, so the earliest is the (patience + 2)-th counted
    evaluation, and the step after it is the first with the lower LR.
    """
    decay = plan.recipe.schedule.decay
    every = plan.recipe.evaluation.every_steps
    if decay.kind != "plateau" or not every:
        return None
    first = every * max(1, math.ceil(plan.warmup_steps / every))  # 1-based step of the first counted evaluation
    return first + (decay.patience + 1) * every


def lr_points(plan: Plan) -> list[list[float]]:
    """`[step, lr]` (1-based optimizer step, the LR the run uses in it) at every place the schedule changes shape:
    the start, the end of each warm-up, each batch phase's start (and the step before it), each step milestone (and
    the step before it), each end of decay, the last step. With plateau decay, up to the first step a decrease could
    change (its LR as planned, before any decrease)."""
    total = plan.optimizer_steps
    if total is None:
        return []
    schedules = [global_schedule(plan), *(phase.schedule for phase in plan.phases if phase.schedule is not None)]
    marks, jumps = {0, total - 1}, set()
    for schedule in schedules:
        marks.update((schedule.start_step + schedule.warmup_steps,
                      schedule.decay_end_step if schedule.decay_end_step is not None else total - 1))
        jumps.update(schedule.decay_milestones)
        jumps.add(schedule.start_step)
    jumps.update(phase.start_step for phase in plan.phases if phase.kind == "phase")
    marks.update(jumps)
    marks.update(step - 1 for step in jumps)
    limit = first_plateau_step(plan)
    if limit is not None:
        marks = {step for step in marks if step < limit} | {limit}
    return [[step + 1, plan_lr(plan, step)] for step in sorted(marks) if 0 <= step < total]


# ---- plateau decay at evaluation points ---------------------------------------------------------------------


class Plateau:
    """`torch.optim.lr_scheduler.ReduceLROnPlateau`'s decisions, on a scale of the planned LR.

    `step(value)` at each evaluation (after the warm-up): better than the best by the threshold resets the count of
    bad evaluations; more than `patience` of them multiply the LR by `factor` (not below `min_lr`; a decrease
    smaller than `eps` is skipped), then `cooldown` evaluations are not counted. `state` is plain numbers, kept in
    checkpoints so a resumed run decides as the uninterrupted one.
    """

    EPS = 1e-8  # ReduceLROnPlateau's default eps

    def __init__(self, plan: Plan, state: dict | None = None) -> None:
        decay = plan.recipe.schedule.decay
        self.factor, self.patience = decay.factor, decay.patience
        self.mode = decay.mode or ("max" if decay.metric == "eval_accuracy" else "min")
        self.threshold = 1e-4 if decay.threshold is None else decay.threshold
        self.threshold_mode = decay.threshold_mode or "rel"
        self.cooldown = decay.cooldown or 0
        self.metric = decay.metric
        self.peak = plan.lr
        self.min_lr = plan.min_lr
        self.state = state or {"best": math.inf if self.mode == "min" else -math.inf, "bad": 0, "cooldown": 0,
                               "scale": 1.0, "evaluations": 0, "decreases": []}

    @staticmethod
    def metric_value(metric: str, evaluation: dict) -> float | None:
        if metric == "eval_error":
            accuracy = evaluation.get("eval_accuracy")
            return None if accuracy is None else 1.0 - accuracy
        return evaluation.get(metric)

    def better(self, value: float, best: float) -> bool:
        if self.mode == "min":
            bound = best * (1 - self.threshold) if self.threshold_mode == "rel" else best - self.threshold
            return value < bound
        bound = best * (1 + self.threshold) if self.threshold_mode == "rel" else best + self.threshold
        return value > bound

    def step(self, value: float, at_step: int) -> bool:
        """One evaluation's value (after optimizer step `at_step`, 1-based); True when the LR decreased."""
        state = self.state
        state["evaluations"] += 1
        if self.better(value, state["best"]):
            state["best"], state["bad"] = value, 0
        else:
            state["bad"] += 1
        if state["cooldown"] > 0:
            state["cooldown"] -= 1
            state["bad"] = 0
        if state["bad"] <= self.patience:
            return False
        old = self.peak * state["scale"]
        new = max(old * self.factor, self.min_lr)
        state["cooldown"], state["bad"] = self.cooldown, 0
        if old - new <= self.EPS:
            return False
        state["scale"] = new / self.peak
        state["decreases"].append([at_step, new])
        return True
