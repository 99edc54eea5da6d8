"""The planner: from a paper's recipe and the largest micro-batch that fits, the accumulation plan.

Pure Python, no torch. `plan(recipe, micro_batch_max, world_size, policy)` returns a `Plan`:
micro-batch m, accumulation steps N and world size W with m x N x W = the paper's effective batch when
that is possible; the LR rule applied when it is not; and the schedule converted to optimizer steps.
`lr_at(plan, step)` is the learning rate of optimizer step `step`, used by the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .errors import UserError
from .phases import PlanPhase, lengths_to_steps, phase_index, plan_phases
from .recipe import Length, Recipe

RULE_SOURCES = {
    "exact": "effective batch matched exactly: no hyper-parameter changes (Goyal et al. 2017, footnote 5)",
    "linear": "linear scaling rule: lr x k (Goyal et al. 2017, arXiv 1706.02677, sec. 2.1)",
    "sqrt": "square-root rule: lr x sqrt(k) (Krizhevsky 2014, arXiv 1404.5997; "
    "Malladi et al. 2022, arXiv 2205.10287, for Adam)",
    "none": "scaling_rule: none in the recipe: LR kept although the batch changed",
}
# The layer-wise optimizers were designed so the LR need not follow the SGD / Adam rules; when the batch cannot be
# matched, the plan applies the rule their papers used (the factor is the same: linear x k, square root x sqrt(k)).
OPTIMIZER_RULE_SOURCES = {
    ("lars", "linear"): "LARS: linear LR scaling with gradual warm-up and polynomial decay, the recipe LARS was run "
    "with (You, Gitman and Ginsburg 2017, arXiv 1708.03888; TensorFlow's LARSOptimizer, written with the first author, "
    "recommends exactly these three); the trust ratio bounds each layer's step",
    ("lamb", "sqrt"): "LAMB: square-root LR scaling with linear-epoch warm-up, untuned from batch 512 to 64k "
    "(You et al. 2019, arXiv 1904.00962, sec. 4)",
}
MALLADI_SOURCE = "Malladi et al. 2022 SDE rule for Adam: (1-b1)xk, (1-b2)xk, eps/sqrt(k) (arXiv 2205.10287)"
FAST_WHEN_BELOW = 0.5  # show the `fast` alternative when the exact micro-batch is below half the maximum


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Choice(Frozen):
    """One way to split the effective batch: micro-batch x accumulation x world size."""

    policy: Literal["exact", "fast"]
    micro_batch: int
    accumulation_steps: int
    world_size: int
    effective_batch: int
    exact: bool
    batch_factor: float
    lr: float
    lr_factor: float

    @property
    def arithmetic(self) -> str:
        return f"{self.micro_batch} x {self.accumulation_steps} x {self.world_size} = {self.effective_batch}"


class AdamOption(Frozen):
    """The optional Adam hyper-parameter changes that go with the square-root rule."""

    betas: tuple[float, float]
    eps: float
    source: str = MALLADI_SOURCE


class Plan(Frozen):
    """What `reproduce run` executes. Saved as YAML with the recipe inside it."""

    format: Literal["reproduce-plan/1"] = "reproduce-plan/1"
    recipe_path: str | None = None
    recipe: Recipe
    policy: Literal["exact", "fast"]
    micro_batch_max: int
    micro_batch: int
    accumulation_steps: int
    world_size: int
    unit: Literal["samples", "sequences"]
    effective_batch: int
    effective_tokens: int | None
    paper_effective_batch: int
    exact: bool
    batch_factor: float
    base_lr: float
    lr: float
    lr_factor: float
    lr_rule: Literal["exact", "linear", "sqrt", "none"]
    lr_rule_source: str
    adam_option: AdamOption | None = None
    dataset_size: int | None
    steps_per_epoch: int | None
    partial_window: int
    optimizer_steps: int | None
    warmup_steps: int
    warmup_start_lr: float
    decay_kind: str
    decay_milestones: list[int] = []
    decay_factor: float
    decay_end_step: int | None
    min_lr: float
    batchnorm: str | None = None
    alternative: Choice | None = None
    warnings: list[str] = []
    # batch.phases / batch.ramp: the batch each stretch of optimizer steps takes (empty: the batch above throughout)
    phases: list[PlanPhase] = []
    # the memory knobs the plan took (activation checkpointing, sharded gradients), or the ways it weighed, and why
    memory: list[str] = []

    @property
    def arithmetic(self) -> str:
        text = f"{self.micro_batch} x {self.accumulation_steps} x {self.world_size} = {self.effective_batch}"
        if self.effective_tokens is not None:
            text += f" sequences ({self.effective_tokens} tokens)"
        return text

    @property
    def per_rank_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps


def plan(
    recipe: Recipe,
    micro_batch_max: int | Mapping[int | None, int],
    world_size: int = 1,
    policy: Literal["exact", "fast"] = "exact",
    dataset_size: int | Mapping[int | None, int] | None = None,
    recipe_path: str | None = None,
) -> Plan:
    """The plan for `recipe` on `world_size` processes that each fit `micro_batch_max` samples.

    With batch phases the micro-batch that fits, and the training samples, depend on the sequence length: both may
    be given per length ({sequence_length: value}); a single number holds for every length.
    """
    maxima = micro_batch_max if isinstance(micro_batch_max, Mapping) else None
    sizes = dataset_size if isinstance(dataset_size, Mapping) else None
    main_length = recipe.batch.sequence_length
    if maxima is not None:
        micro_batch_max = maxima[main_length]
    if sizes is not None:
        dataset_size = sizes.get(main_length)
    if micro_batch_max < 1:
        raise UserError(f"--micro-batch-max: must be >= 1 (got {micro_batch_max})")
    if world_size < 1:
        raise UserError(f"--world-size: must be >= 1 (got {world_size})")
    if policy not in ("exact", "fast"):
        raise UserError(f"--policy: expected exact or fast (got {policy!r})")
    paper_batch = recipe.batch.sequences
    if world_size > paper_batch:
        raise UserError(
            f"--world-size: {world_size} processes exceed the paper's effective batch of {paper_batch} "
            f"{recipe.batch.count_unit}: each process needs at least one"
        )
    warnings: list[str] = []
    cap = min(micro_batch_max, math.ceil(paper_batch / world_size))
    if cap < micro_batch_max:
        warnings.append(
            f"micro-batch capped at {cap}: the paper's batch of {paper_batch} over {world_size} "
            f"process(es) needs no more per step"
        )
    exact = _exact_choice(recipe, cap, world_size)
    fast = _fast_choice(recipe, cap, world_size)
    chosen, alternative = (exact, None) if policy == "exact" else (fast, None)
    if policy == "exact" and exact is None:
        chosen = fast
        warnings.append(
            f"no exact split: {paper_batch} {recipe.batch.count_unit} is not divisible by world size "
            f"{world_size}; using the nearest batch {fast.effective_batch}"
        )
    elif policy == "exact" and fast.micro_batch != exact.micro_batch and exact.micro_batch < FAST_WHEN_BELOW * cap:
        alternative = fast
    elif policy == "fast" and exact is not None and exact.micro_batch != fast.micro_batch:
        alternative = exact

    batchnorm = _batchnorm_note(recipe, chosen.micro_batch)
    rule, source = _rule(recipe, chosen.exact)
    if not chosen.exact:
        warnings.append(
            f"effective batch {chosen.effective_batch} is not the paper's {paper_batch} "
            f"(x{chosen.batch_factor:.4g}): LR {recipe.optimizer.lr:g} -> {chosen.lr:.6g} by the {rule} rule"
        )
    # Malladi et al.'s beta/eps changes are for Adam itself; LAMB's paper changed only the LR
    adam_option = (
        _adam_option(recipe, chosen)
        if rule == "sqrt" and recipe.optimizer.family == "adam" and recipe.optimizer.name != "lamb" else None
    )

    dataset_size = dataset_size or recipe.data.train_size
    steps_per_epoch, partial = None, 0
    if dataset_size is not None:
        full, partial = divmod(dataset_size, chosen.effective_batch)
        keep_partial = not recipe.data.drop_last and partial >= world_size  # every process needs an item
        steps_per_epoch = full + 1 if keep_partial and partial else full
        if full == 0:
            warnings.append(
                f"an epoch ({dataset_size} {recipe.batch.count_unit}) is shorter than one optimizer step "
                f"({chosen.effective_batch}): "
                + ("with drop_last no step would ever run" if recipe.data.drop_last else "every step is partial")
            )
        elif partial:
            what = (
                "dropped (drop_last)" if recipe.data.drop_last
                else f"normalised by the {partial} it holds" if keep_partial
                else f"dropped: fewer than the {world_size} processes"
            )
            warnings.append(
                f"the last window of each epoch holds {partial} of {chosen.effective_batch} "
                f"{recipe.batch.count_unit}: {what}"
            )

    phases: list[PlanPhase] = []
    if recipe.batch.phases or recipe.batch.ramp:
        phases = plan_phases(
            recipe, lambda length: maxima.get(length, micro_batch_max) if maxima else micro_batch_max, world_size,
            lambda length: _size_at(length, recipe, dataset_size, sizes),
            lambda fixed, cap: _split(fixed, cap, world_size, policy), chosen, warnings,
        )

    def steps(length: Length | None, what: str) -> int | None:
        if phases and length is not None:
            return lengths_to_steps(phases, recipe, length, what, warnings)
        return _to_steps(length, recipe, chosen.effective_batch, steps_per_epoch, dataset_size, what, warnings)

    total = steps(recipe.schedule.total, "schedule.total")
    warmup = recipe.schedule.warmup
    if warmup is not None and warmup.ratio is not None:
        warmup_steps = round(warmup.ratio * total) if total is not None else 0
    else:
        warmup_steps = steps(warmup, "schedule.warmup") or 0
    if total is not None and warmup_steps > total:
        warnings.append(f"warm-up ({warmup_steps} steps) is longer than the whole run ({total} steps)")
    decay = recipe.schedule.decay
    milestones = []
    if decay.milestones is not None:
        for value in decay.milestones.value:
            single = Length(**{decay.milestones.unit: value})
            milestones.append(steps(single, "schedule.decay.milestones"))
        milestones = [m for m in milestones if m is not None]
    decay_end = steps(decay.until, "schedule.decay.until") if decay.until is not None else total
    if decay.min_lr is not None:
        min_lr = decay.min_lr * chosen.lr_factor
    else:
        min_lr = (decay.min_ratio or 0.0) * chosen.lr
    start_lr = 0.0
    if warmup is not None and warmup.start_lr is not None:
        start_lr = warmup.start_lr
    elif warmup is not None and warmup.start_factor is not None:
        start_lr = warmup.start_factor * chosen.lr

    if batchnorm:
        warnings.append(batchnorm)
    for index, phase in enumerate(phases):
        if total is not None and phase.start_step >= total and index:
            warnings.append(f"the batch of step {phase.start_step + 1} on ({phase.effective_batch}) is never reached: "
                            f"the run has {total} optimizer steps")
            break
    return Plan(
        recipe_path=recipe_path,
        recipe=recipe,
        policy=policy,
        micro_batch_max=micro_batch_max,
        micro_batch=chosen.micro_batch,
        accumulation_steps=chosen.accumulation_steps,
        world_size=world_size,
        unit=recipe.batch.count_unit,
        effective_batch=chosen.effective_batch,
        effective_tokens=(
            chosen.effective_batch * recipe.batch.sequence_length if recipe.batch.sequence_length else None
        ),
        paper_effective_batch=paper_batch,
        exact=chosen.exact,
        batch_factor=chosen.batch_factor,
        base_lr=recipe.optimizer.lr,
        lr=chosen.lr,
        lr_factor=chosen.lr_factor,
        lr_rule=rule,
        lr_rule_source=source,
        adam_option=adam_option,
        dataset_size=dataset_size,
        steps_per_epoch=steps_per_epoch,
        partial_window=partial,
        optimizer_steps=total,
        warmup_steps=warmup_steps,
        warmup_start_lr=start_lr,
        decay_kind=decay.kind,
        decay_milestones=milestones,
        decay_factor=decay.factor,
        decay_end_step=decay_end,
        min_lr=min_lr,
        batchnorm=batchnorm,
        alternative=alternative,
        warnings=warnings,
        phases=phases,
    )


def _split(recipe: Recipe, cap: int, world_size: int, policy: str) -> Choice:
    """One phase's split: exact when the policy asks for it and it exists, otherwise the nearest batch."""
    exact = _exact_choice(recipe, cap, world_size) if policy == "exact" else None
    return exact or _fast_choice(recipe, cap, world_size)


def _size_at(length: int | None, recipe: Recipe, size: int | None, sizes: Mapping | None) -> int | None:
    """Training samples at sequence length `length`: as given, else the main length's data cut at `length`."""
    if sizes is not None and length in sizes:
        return sizes[length]
    main = recipe.batch.sequence_length
    if size is None or length == main or not length or not main:
        return size
    return size * main // length


def _exact_choice(recipe: Recipe, cap: int, world_size: int) -> Choice | None:
    """The largest micro-batch <= cap that splits the paper's batch exactly (BN: the paper's per-device)."""
    paper_batch = recipe.batch.sequences
    if paper_batch % world_size:
        return None
    per_rank = paper_batch // world_size
    per_device = recipe.batch.per_device
    if recipe.model.has_batchnorm and per_device and per_device <= cap and per_rank % per_device == 0:
        micro = per_device
    else:
        micro = next(m for m in range(cap, 0, -1) if per_rank % m == 0)
    return _choice(recipe, "exact", micro, per_rank // micro, world_size)


def _fast_choice(recipe: Recipe, cap: int, world_size: int) -> Choice:
    """A micro-batch in [cap/2, cap] whose batch m x N x W is nearest the paper's (larger m on ties)."""
    paper_batch = recipe.batch.sequences
    best = None
    for micro in range(cap, max(1, cap // 2) - 1, -1):
        accumulation = max(1, round(paper_batch / (micro * world_size)))
        distance = abs(micro * accumulation * world_size - paper_batch)
        if best is None or distance < best[0]:
            best = (distance, micro, accumulation)
    _, micro, accumulation = best
    return _choice(recipe, "fast", micro, accumulation, world_size)


def _choice(recipe: Recipe, policy: str, micro: int, accumulation: int, world_size: int) -> Choice:
    effective = micro * accumulation * world_size
    factor = effective / recipe.batch.sequences
    rule, _ = _rule(recipe, factor == 1)
    lr_factor = {"exact": 1.0, "none": 1.0, "linear": factor, "sqrt": math.sqrt(factor)}[rule]
    return Choice(
        policy=policy, micro_batch=micro, accumulation_steps=accumulation, world_size=world_size,
        effective_batch=effective, exact=factor == 1, batch_factor=factor,
        lr=recipe.optimizer.lr * lr_factor, lr_factor=lr_factor,
    )


def _rule(recipe: Recipe, exact: bool) -> tuple[str, str]:
    if exact:
        rule = "exact"
    elif recipe.scaling_rule == "auto":
        rule = "linear" if recipe.optimizer.family == "sgd" else "sqrt"
    else:
        rule = recipe.scaling_rule
    return rule, OPTIMIZER_RULE_SOURCES.get((recipe.optimizer.name, rule), RULE_SOURCES[rule])


def _adam_option(recipe: Recipe, choice: Choice) -> AdamOption:
    k = choice.batch_factor
    beta1, beta2 = recipe.optimizer.betas
    return AdamOption(
        betas=(max(0.0, 1 - k * (1 - beta1)), max(0.0, 1 - k * (1 - beta2))),
        eps=recipe.optimizer.eps / math.sqrt(k),
    )


def _batchnorm_note(recipe: Recipe, micro: int) -> str | None:
    if not recipe.model.has_batchnorm:
        return None
    per_device = recipe.batch.per_device
    if per_device == micro:
        return None
    paper = f"the paper's per-device {per_device}" if per_device else "the paper's per-device batch (not stated)"
    return (
        f"BatchNorm statistics will be computed over micro-batches of {micro} samples instead of {paper}: "
        "normalisation and running statistics differ from the paper's"
    )


def _to_steps(
    length: Length | None,
    recipe: Recipe,
    effective_batch: int,
    steps_per_epoch: int | None,
    dataset_size: int | None,
    what: str,
    warnings: list[str],
) -> int | None:
    """Optimizer steps covering the same data as `length` does in the paper."""
    if length is None:
        return None
    unit, value = length.unit, length.value
    if unit == "steps":
        samples = value * recipe.batch.sequences  # the paper's steps, kept as the data they cover
    elif unit == "epochs":
        if steps_per_epoch is None:
            message = f"{what}: counted in epochs, but the dataset size is unknown (set data.train_size)"
            if message not in warnings:
                warnings.append(message)
            return None
        return max(0, round(value * steps_per_epoch)) if value else 0
    elif unit == "samples":
        samples = value
    else:
        if recipe.batch.sequence_length is None:
            raise UserError(f"{what}: counted in tokens, but batch.sequence_length is not set")
        samples = value / recipe.batch.sequence_length
    return round(samples / effective_batch)


def lr_at(plan: Plan, step: int) -> float:
    """The learning rate for optimizer step `step` (0-based): warm-up, then the recipe's decay.

    With batch phases the schedule runs on across them; a phase whose batch is not the paper's has its own LR rule
    factor in place of the main batch's.
    """
    value = _scheduled_lr(plan, step)
    if plan.phases:
        phase = plan.phases[phase_index(plan.phases, step)]
        if phase.lr_factor != plan.lr_factor:
            value = value * phase.lr_factor / plan.lr_factor
    return value


def _scheduled_lr(plan: Plan, step: int) -> float:
    peak, warmup = plan.lr, plan.warmup_steps
    if step < warmup:
        return plan.warmup_start_lr + (peak - plan.warmup_start_lr) * step / warmup
    kind = plan.decay_kind
    if kind == "constant":
        return peak
    if kind == "step":
        return peak * plan.decay_factor ** sum(step >= m for m in plan.decay_milestones)
    end = plan.decay_end_step if plan.decay_end_step is not None else plan.optimizer_steps
    if end is None or end <= warmup:
        return peak
    progress = min(1.0, max(0.0, (step - warmup) / (end - warmup)))
    if kind == "cosine":
        return plan.min_lr + (peak - plan.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return peak + (plan.min_lr - peak) * progress
    return plan.min_lr + (peak - plan.min_lr) * (1 - progress) ** plan.recipe.schedule.decay.power
