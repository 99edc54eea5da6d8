"""The batch split: micro-batch x accumulation x world size, and the LR rule when it is not the paper's batch. No
torch. The planner and phases.py split every segment by the same two rules, `exact_choice` and `fast_choice`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .batchnorm import preferred_micro_batch
from .recipe import Recipe

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


LrRule = Literal["exact", "linear", "sqrt", "none"]
SplitPolicy = Literal["exact", "fast"]


def split_text(micro_batch: int, accumulation_steps: int, world_size: int, total: int | str | None = None) -> str:
    """The batch arithmetic, the one way every line writes it: `m x N x W`, and ` = B` when the total is given."""
    text = f"{micro_batch} x {accumulation_steps} x {world_size}"
    return text if total is None else f"{text} = {total}"


class Frozen(BaseModel):
    """A part of a plan: no field beyond its own, none changed once made."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Choice(Frozen):
    """One way to split the effective batch: micro-batch x accumulation x world size."""

    policy: SplitPolicy
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
        return split_text(self.micro_batch, self.accumulation_steps, self.world_size, self.effective_batch)


def split(recipe: Recipe, cap: int, world_size: int, policy: SplitPolicy) -> Choice:
    """A fixed batch's split: exact when the policy asks for it and it exists, otherwise the nearest batch."""
    exact = exact_choice(recipe, cap, world_size) if policy == "exact" else None
    return exact or fast_choice(recipe, cap, world_size)


def exact_choice(recipe: Recipe, cap: int, world_size: int) -> Choice | None:
    """The largest micro-batch <= cap that splits the paper's batch exactly (BN: the paper's per-device)."""
    paper_batch = recipe.batch.sequences
    if paper_batch % world_size:
        return None
    per_rank = paper_batch // world_size
    per_device = preferred_micro_batch(recipe, world_size)  # the paper's BN batch (per device, or over the processes)
    if per_device and per_device <= cap and per_rank % per_device == 0:
        micro = per_device
    else:
        micro = next(m for m in range(cap, 0, -1) if per_rank % m == 0)
    return choice(recipe, "exact", micro, per_rank // micro, world_size)


def fast_choice(recipe: Recipe, cap: int, world_size: int) -> Choice:
    """A micro-batch in [cap/2, cap] whose batch m x N x W is nearest the paper's (larger m on ties)."""
    paper_batch = recipe.batch.sequences
    best: tuple[int, int, int] | None = None
    for micro in range(cap, max(1, cap // 2) - 1, -1):
        accumulation = max(1, round(paper_batch / (micro * world_size)))
        distance = abs(micro * accumulation * world_size - paper_batch)
        if best is None or distance < best[0]:
            best = (distance, micro, accumulation)
    assert best is not None  # cap >= 1: the range holds at least one micro-batch
    _, micro, accumulation = best
    return choice(recipe, "fast", micro, accumulation, world_size)


def choice(recipe: Recipe, policy: SplitPolicy, micro: int, accumulation: int, world_size: int) -> Choice:
    """The split micro x accumulation x world_size of the recipe's batch, with its LR rule's factor."""
    effective = micro * accumulation * world_size
    factor = effective / recipe.batch.sequences
    rule, _ = lr_rule(recipe, factor == 1)
    lr_factor = {"exact": 1.0, "none": 1.0, "linear": factor, "sqrt": math.sqrt(factor)}[rule]
    return Choice(
        policy=policy, micro_batch=micro, accumulation_steps=accumulation, world_size=world_size,
        effective_batch=effective, exact=factor == 1, batch_factor=factor,
        lr=recipe.optimizer.lr * lr_factor, lr_factor=lr_factor,
    )


def lr_rule(recipe: Recipe, exact: bool) -> tuple[LrRule, str]:
    """The LR rule a split takes (exact, linear, sqrt, none) and its source."""
    rule: LrRule
    if exact:
        rule = "exact"
    elif recipe.scaling_rule == "auto":
        rule = "linear" if recipe.optimizer.family == "sgd" else "sqrt"
    else:
        rule = recipe.scaling_rule
    return rule, OPTIMIZER_RULE_SOURCES.get((recipe.optimizer.name, rule), RULE_SOURCES[rule])
