"""`reproduce verify` with activation checkpointing: does the recomputation give the gradient the run would have had?

A recomputed block must draw the dropout masks its forward drew, so the plan's step runs twice more from the same
weights and RNG state, dropout on, with and without checkpointing; the two gradients must agree within tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..models import build_model
from ..plan.overlay import variant
from ..plan.planner import Plan, finish_plan
from ..train.losses import build_loss
from ..train.setup import Setup
from ..train.step import optimizer_step

if TYPE_CHECKING:
    from ..data import Datasets


def dropouts(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """Every dropout probability above 0 in `model` (dropout modules' `p`, float `dropout` / `dropout_p` /
    `attn_dropout` attributes): its name as shown, its module and the attribute that holds it."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                yield name or type(module).__name__, module, "p"
            continue
        for attr in ("dropout", "dropout_p", "attn_dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                yield f"{name}.{attr}", module, attr


def recomputation_error(plan: Plan, data: Datasets, micro_batches: list, device: torch.device, dtype: torch.dtype,
                        seed: int, recorder_type: Any, no_schedule: Any) -> tuple[float, bool]:
    """(relative difference of the accumulated gradients with and without checkpointing, dropout on; whether the
    model has dropout to check). `micro_batches` are on the device; both steps start from the same seed."""
    gradients, dropout = [], False
    for checkpointing in (True, False):
        recipe = plan.recipe
        recipe = variant(recipe, {"model.activation_checkpointing": checkpointing})
        torch.manual_seed(seed)
        model = build_model(recipe, data.info).to(device=device, dtype=dtype)
        model.train()
        dropout = dropout or any(dropouts(model))
        recorder = recorder_type([p for p in model.parameters() if p.requires_grad])
        setup = Setup(finish_plan(plan, recipe=recipe), model, recorder, no_schedule(), None,
                      build_loss(recipe, model), data, device, dtype)
        torch.manual_seed(seed + 1)  # the dropout masks: the same stream in both steps
        optimizer_step(setup, micro_batches)
        gradients.append(recorder.gradients)
    difference = math.sqrt(sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(*gradients, strict=True)))
    norm = math.sqrt(sum(float(b.double().norm()) ** 2 for b in gradients[1]))
    return (difference / norm if norm else (0.0 if difference == 0 else math.inf)), dropout
