"""The planner, pure Python: `make_plan` turns a paper's recipe and the largest micro-batch that fits into a `Plan`
(m x N x W = the paper's batch when possible, else the LR rule; the schedule in optimizer steps); `lr_at(plan, step)`
is the LR the training loop uses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field, model_validator

from ..errors import MicroBatchError, UserError
from .batchnorm import BatchNormPlan, label_disagreement, plan_batchnorm
from .gates import planned_gates
from .overlay import Change, overlay
from .phases import plan_phases, schedule_in_steps
from .recipe import Recipe, default_packing
from .schedules import StepSchedule
from .segments import MicroBatchMax, PerLength, Segment, epoch_steps, micro_batch_cap, phase_index
from .split import Choice, Frozen, LrRule, SplitPolicy, choice, exact_choice, fast_choice, lr_rule
from .throughput_choice import ThroughputChoice
from .weightfiles import WeightsRecord

MALLADI_SOURCE = "Malladi et al. 2022 SDE rule for Adam: (1-b1)xk, (1-b2)xk, eps/sqrt(k) (arXiv 2205.10287)"
FAST_WHEN_BELOW = 0.5  # show the `fast` alternative when the exact micro-batch is below half the maximum


class AdamOption(Frozen):
    """The optional Adam hyper-parameter changes that go with the square-root rule."""

    betas: tuple[float, float]
    eps: float
    source: str = MALLADI_SOURCE


class LrScaling(Frozen):
    """The LR rule the split took (`exact` when the batch is the paper's), its source, and Adam's beta/eps option
    that goes with the square-root rule."""

    rule: LrRule
    source: str
    adam_option: AdamOption | None = None


class Plan(Frozen):
    """What `reproduce run` executes, made of its parts: the split, the LR rule, the schedule in optimizer steps and
    the segments. Saved as YAML with the recipe inside it (planfile.py)."""

    format: Literal["reproduce-plan/2"] = "reproduce-plan/2"
    recipe_path: str | None = None
    recipe: Recipe
    policy: Literal["exact", "fast", "throughput"]
    micro_batch_max: int
    split: Choice  # the main batch's micro-batch x accumulation x world size, its effective batch and LR
    alternative: Choice | None = None  # the other policy's split, when worth showing
    lr_scaling: LrScaling
    dataset_size: int | None  # training samples at the main sequence length
    steps_per_epoch: int | None
    partial_window: int  # the samples of an epoch's last window
    schedule: StepSchedule  # the recipe's schedule.warmup / decay in optimizer steps, from step 0
    # the plan as stretches of optimizer steps: one `whole` (one batch throughout), or batch.phases / batch.ramp's
    segments: list[Segment]
    batchnorm: BatchNormPlan | None = None  # BatchNorm: the run's BN batch against the paper's, and the options
    batchnorm_warning: str | None = None  # the warning when BatchNorm's batch is not the paper's
    warnings: list[str] = []
    # policy throughput: the exact splits timed and why the micro-batch was chosen
    throughput: ThroughputChoice | None = None
    # the memory knobs the plan took (activation checkpointing, sharded gradients), or the ways it weighed, and why
    memory_notes: list[str] = []
    # model.weights: the pretrained weights the run starts from, with their fingerprint (`--resume` refuses others)
    weights: WeightsRecord | None = None
    # the data files' content fingerprint when the run started (`--resume` refuses data that changed since)
    data_fingerprint: str | None = None

    # the parts' numbers most readers want: attributes `_derived` sets once, not fields (the type checker's view)
    if TYPE_CHECKING:
        micro_batch: int = Field(init=False)
        accumulation_steps: int = Field(init=False)
        world_size: int = Field(init=False)
        effective_batch: int = Field(init=False)
        exact: bool = Field(init=False)
        lr: float = Field(init=False)
        optimizer_steps: int | None = Field(init=False)
        warmup_steps: int = Field(init=False)
        unit: Literal["samples", "sequences"] = Field(init=False)
        paper_effective_batch: int = Field(init=False)
        effective_tokens: int | None = Field(init=False)
        arithmetic: str = Field(init=False)
        per_rank_batch: int = Field(init=False)
        has_phases: bool = Field(init=False)  # the batch changes (batch.phases or batch.ramp), not one `whole` segment

    @model_validator(mode="after")
    def _derived(self) -> Plan:
        """The split's, the schedule's and the batch's numbers as attributes of the validated plan: never saved,
        never read from a file (a plan file's key of these names is unknown)."""
        split, batch = self.split, self.recipe.batch
        tokens = split.effective_batch * batch.sequence_length if batch.sequence_length else None
        derived = {
            "micro_batch": split.micro_batch, "accumulation_steps": split.accumulation_steps,
            "world_size": split.world_size, "effective_batch": split.effective_batch, "exact": split.exact,
            "lr": split.lr, "optimizer_steps": self.schedule.end_step, "warmup_steps": self.schedule.warmup_steps,
            "unit": batch.count_unit, "paper_effective_batch": batch.sequences, "effective_tokens": tokens,
            "arithmetic": split.arithmetic if tokens is None else f"{split.arithmetic} sequences ({tokens} tokens)",
            "per_rank_batch": split.micro_batch * split.accumulation_steps,
            "has_phases": bool(self.segments) and self.segments[0].kind != "whole",
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # (a frozen model: set once, here)
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy runs no validator: the copy's numbers are derived again from its parts."""
        copy = super().model_copy(update=update, deep=deep)
        copy._derived()  # type: ignore[operator]  # the validator is a plain method at run time
        return copy


def make_plan(
    recipe: Recipe,
    micro_batch_max: MicroBatchMax,
    world_size: int = 1,
    policy: Literal["exact", "fast", "throughput"] = "exact",
    dataset_size: PerLength | None = None,
    recipe_path: str | None = None,
    micro_batch: int | None = None,
    batchnorm_layers: int | None = None,
    *,
    memory_notes: Sequence[str] = (),
    weights: WeightsRecord | None = None,
    data_fingerprint: str | None = None,
    throughput: ThroughputChoice | None = None,
) -> Plan:
    """The plan for `recipe` on `world_size` processes that each fit `micro_batch_max` samples.

    With batch phases, the micro-batch that fits and the dataset size may be per sequence length. `throughput` is
    `exact` at the throughput search's `micro_batch`. `batchnorm_layers`: as counted in the built model. An unset
    `data.packing` takes the data's default into the plan's recipe, so run, verify and resume group alike."""
    way = default_packing(recipe)  # data.packing unset: instruction data takes packed or sorted, the plan keeps it
    if way is not None:
        recipe = overlay(recipe, [Change("data.packing", way)], recipe_path or "the recipe")
    sizes = dataset_size if isinstance(dataset_size, Mapping) else None
    main_length = recipe.batch.sequence_length
    cap = micro_batch_max[main_length] if isinstance(micro_batch_max, Mapping) else micro_batch_max
    size = dataset_size.get(main_length) if isinstance(dataset_size, Mapping) else dataset_size
    check_arguments(recipe, cap, world_size, policy)
    split_policy = "exact" if policy == "throughput" else policy  # throughput: exact, its micro-batch chosen
    warnings: list[str] = []
    capped = micro_batch_cap(cap, recipe.batch.sequences, world_size)
    if capped < cap:
        warnings.append(f"micro-batch capped at {capped}: the paper's batch of {recipe.batch.sequences} over "
                        f"{world_size} process(es) needs no more per step")
    chosen, alternative = choose_split(recipe, capped, world_size, split_policy, micro_batch, warnings)
    norm = plan_batchnorm(recipe, chosen.micro_batch, capped, world_size, batchnorm_layers)
    disagreement = label_disagreement(recipe.model, batchnorm_layers)  # the recipe's label against the model
    if disagreement:
        warnings.append(disagreement)
    batchnorm = norm.note if norm is not None else None  # added by `warn_last`
    rule, source, adam_option = scale_lr(recipe, chosen, warnings)
    size = size or recipe.data.train_size
    steps_per_epoch, partial = epoch_steps(size, chosen.effective_batch, world_size, recipe.data.drop_last)
    epoch_end: list[str] = []  # said only of a run that reaches an epoch's end (below, once its steps are known)
    at = len(warnings)
    warn_partial_epoch(recipe, size, chosen.effective_batch, world_size, partial, epoch_end)
    if recipe.loss is not None and recipe.loss.normalization == "micro-batch-mean":
        warnings.append("loss.normalization: micro-batch-mean: each micro-batch's mean over its own items, averaged "
                        "over the window's micro-batches and processes (the Hugging Face Trainer before transformers "
                        "v4.46.0): not the large batch's gradient where micro-batches hold different counts")
    phases = plan_phases(recipe, micro_batch_max, world_size, size, sizes, split_policy, chosen, warnings)
    segments = phases or [Segment(  # a plan without batch phases: its one batch from step 0 to the end
        kind="whole", start_step=0, micro_batch_max=cap, paper_effective_batch=recipe.batch.sequences,
        sequence_length=main_length, dataset_size=size, steps_per_epoch=steps_per_epoch,
        **chosen.model_dump(include={"micro_batch", "accumulation_steps", "effective_batch", "exact", "lr_factor"}))]
    schedule, phases = schedule_in_steps(recipe, recipe_path, chosen, segments, phases, steps_per_epoch, warnings)
    full = size // chosen.effective_batch if size else 0
    if not (phases or schedule.end_step is None) and 0 < full and schedule.end_step <= full:
        epoch_end = []  # the run ends within the first epoch's full windows: it never meets the last one
    warnings[at:at] = epoch_end
    warn_last(recipe, batchnorm, schedule.end_step, phases, warnings, norm)
    plan = Plan(
        recipe_path=recipe_path, recipe=recipe, policy=policy, micro_batch_max=cap, split=chosen,
        alternative=alternative, lr_scaling=LrScaling(rule=rule, source=source, adam_option=adam_option),
        dataset_size=size, steps_per_epoch=steps_per_epoch, partial_window=partial, schedule=schedule,
        segments=phases or segments, batchnorm=norm, batchnorm_warning=batchnorm, warnings=warnings,
        throughput=throughput, memory_notes=list(memory_notes), weights=weights, data_fingerprint=data_fingerprint,
    )
    planned_gates(plan)  # each gate at an optimizer step of the run, or one line now
    return plan


def finish_plan(plan: Plan, **parts: object) -> Plan:
    """A plan made before (a plan file's) with the parts a run changes or adds: its recipe with the command's
    options, the records of the pretrained weights it starts from (None for random ones) and of the data files;
    validated as a new Plan (a part it does not have is refused)."""
    return Plan.model_validate({**{name: getattr(plan, name) for name in Plan.model_fields}, **parts})


def check_arguments(recipe: Recipe, micro_batch_max: int, world_size: int, policy: str) -> None:
    """The plan's own arguments, each refused with the argument's name."""
    if micro_batch_max < 1:
        raise MicroBatchError(f"must be >= 1 (got {micro_batch_max})", field="micro_batch_max")
    if world_size < 1:
        raise UserError(f"must be >= 1 (got {world_size})", field="world_size")
    if policy not in ("exact", "fast", "throughput"):
        raise UserError(f"expected exact, fast or throughput (got {policy!r})", field="policy")
    paper_batch = recipe.batch.sequences
    if world_size > paper_batch:
        raise UserError(f"{world_size} processes exceed the paper's effective batch of {paper_batch} "
                        f"{recipe.batch.count_unit}: each process needs at least one", field="world_size")


def choose_split(recipe: Recipe, cap: int, world_size: int, policy: SplitPolicy, micro_batch: int | None,
                 warnings: list[str]) -> tuple[Choice, Choice | None]:
    """The main batch's split under `policy` and the other policy's, when worth showing. `cap` is already
    `micro_batch_cap`ped; `micro_batch`, when given, is the exact split's (the throughput search's choice)."""
    paper_batch = recipe.batch.sequences
    exact = exact_choice(recipe, cap, world_size)
    if micro_batch is not None and exact is not None:
        per_rank = exact.micro_batch * exact.accumulation_steps
        if not 1 <= micro_batch <= cap or per_rank % micro_batch:
            raise UserError(f"micro_batch: {micro_batch} is not an exact split of {per_rank} per process at most {cap}")
        exact = choice(recipe, "exact", micro_batch, per_rank // micro_batch, world_size)
    fast = fast_choice(recipe, cap, world_size)
    chosen, alternative = (exact or fast, None) if policy == "exact" else (fast, None)
    if policy == "exact" and exact is None:
        warnings.append(
            f"no exact split: {paper_batch} {recipe.batch.count_unit} is not divisible by world size "
            f"{world_size}; using the nearest batch {fast.effective_batch}"
        )
    elif (policy == "exact" and exact is not None and fast.micro_batch != exact.micro_batch
          and exact.micro_batch < FAST_WHEN_BELOW * cap):
        alternative = fast
    elif policy == "fast" and exact is not None and exact.micro_batch != fast.micro_batch:
        alternative = exact
    return chosen, alternative


def scale_lr(recipe: Recipe, chosen: Choice, warnings: list[str]) -> tuple[LrRule, str, AdamOption | None]:
    """The LR rule for the chosen batch (`exact` when it is the paper's), its source, and Adam's beta/eps option."""
    rule, source = lr_rule(recipe, chosen.exact)
    if not chosen.exact:
        warnings.append(
            f"effective batch {chosen.effective_batch} is not the paper's {recipe.batch.sequences} "
            f"(x{chosen.batch_factor:.4g}): LR {recipe.optimizer.lr:g} -> {chosen.lr:.6g} by the {rule} rule"
        )
    adam_option = None  # Malladi et al.'s beta/eps changes are for Adam itself; LAMB's paper changed only the LR
    if rule == "sqrt" and recipe.optimizer.family == "adam" and recipe.optimizer.name != "lamb":
        k, (beta1, beta2) = chosen.batch_factor, recipe.optimizer.betas
        adam_option = AdamOption(betas=(max(0.0, 1 - k * (1 - beta1)), max(0.0, 1 - k * (1 - beta2))),
                                 eps=recipe.optimizer.eps / math.sqrt(k))
    return rule, source, adam_option


def warn_partial_epoch(recipe: Recipe, dataset_size: int | None, effective_batch: int, world_size: int, partial: int,
                       warnings: list[str]) -> None:
    """The warning for an epoch shorter than one optimizer step, or one that ends on a partial window."""
    if dataset_size is None:
        return
    unit, drop_last = recipe.batch.count_unit, recipe.data.drop_last
    if dataset_size < effective_batch:
        warnings.append(f"an epoch ({dataset_size} {unit}) is shorter than one optimizer step ({effective_batch}): "
                        + ("with drop_last no step would ever run" if drop_last else "every step is partial"))
    elif partial:  # kept (epoch_steps) when every process gets an item of it
        what = ("dropped (drop_last)" if drop_last else f"normalised by the {partial} it holds"
                if partial >= world_size else f"dropped: fewer than the {world_size} processes")
        warnings.append(f"the last window of each epoch holds {partial} of {effective_batch} {unit}: {what}")


def warn_last(recipe: Recipe, batchnorm: str | None, total: int | None, phases: list[Segment], warnings: list[str],
              norm: BatchNormPlan | None = None) -> None:
    """The warnings that close the list: BatchNorm over micro-batches (and the BN choice's own lines), a batch phase
    the run never reaches, and the recipe's own deviations from the paper."""
    if batchnorm:
        warnings.append(batchnorm)
    if norm is not None:
        warnings.extend(norm.lines[1:])
    for index, phase in enumerate(phases):
        if total is not None and phase.start_step >= total and index:
            warnings.append(f"the batch of step {phase.start_step + 1} on ({phase.effective_batch}) is never reached: "
                            f"the run has {total} optimizer steps")
            break
    warnings.extend(f"deviation from the paper: {text.strip()}" for text in recipe.deviations)
    model = recipe.model
    if recipe.task == "segmentation" and model.pretrained and model.weights is None and model.backbone_weights is None:
        warnings.append(f"this run starts from random weights; the paper started from {model.pretrained} and its "
                        "numbers assume it: give --backbone-weights FILE for an ImageNet backbone, or --weights FILE "
                        "for a whole model (a run's model.pt) (docs/segmentation.md)")


# ---- the learning rate of each step ------------------------------------------------------------------------------


def lr_at(plan: Plan, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): the schedule it falls in (the recipe's, or that of the
    last phase before it with its own), times its segment's LR-rule factor over that schedule's."""
    segments = plan.segments
    index, schedule, factor = phase_index(segments, step), plan.schedule, plan.split.lr_factor
    for owner in segments[:index + 1]:  # the last segment at or before the step with a schedule of its own
        if owner.schedule is not None:
            schedule, factor = owner.schedule, owner.lr_factor
    value = schedule.lr_at(step)
    segment = segments[index]
    if segment.lr_factor != factor:
        value = value * segment.lr_factor / factor
    return value


def first_plateau_step(plan: Plan) -> int | None:
    """Plateau decay: the first optimizer step (0-based) whose LR a decrease could change, None otherwise.

    The first evaluation counted (after the warm-up) sets the best; ReduceLROnPlateau decreases after `patience + 1`
    evaluations without improvement, so at the earliest on the step after the (patience + 2)-th."""
    decay = plan.recipe.schedule.decay
    every = plan.recipe.evaluation.every_steps
    if decay.kind != "plateau" or not every or decay.patience is None:  # (plateau requires a patience)
        return None
    first = every * max(1, math.ceil(plan.warmup_steps / every))  # 1-based step of the first counted evaluation
    return first + (decay.patience + 1) * every


def lr_points(plan: Plan) -> list[list[float]]:
    """`[step, lr]` (1-based step) wherever the schedule changes shape: the start, each warm-up's end, each
    phase start and milestone (and the step before), each decay's end, the last step; with plateau decay, up to the
    first step a decrease could change."""
    total = plan.optimizer_steps
    if total is None:
        return []
    schedules = [plan.schedule, *(seg.schedule for seg in plan.segments if seg.schedule is not None)]
    marks, jumps = {0, total - 1}, set()
    for schedule in schedules:
        marks.update((schedule.start_step + schedule.warmup_steps,
                      schedule.decay_end_step if schedule.decay_end_step is not None else total - 1))
        jumps.update(schedule.decay_milestones)
        jumps.add(schedule.start_step)
    jumps.update(segment.start_step for segment in plan.segments if segment.kind == "phase")
    marks.update(jumps)
    marks.update(step - 1 for step in jumps)
    limit = first_plateau_step(plan)
    if limit is not None:
        marks = {step for step in marks if step < limit} | {limit}
    return [[step + 1, lr_at(plan, step)] for step in sorted(marks) if 0 <= step < total]
