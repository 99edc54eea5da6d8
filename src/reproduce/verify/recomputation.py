"""`reproduce verify` with activation checkpointing: does the recomputation give the gradient the run would have had?

The main check compares the plan's accumulated gradient with the one-pass gradient, with dropout off (two passes
over different batches cannot draw the same masks). Checkpointing adds one more question: a recomputed block must
draw the same dropout masks as its forward did. So the plan's step is run twice more from the same weights and the
same RNG state, with dropout on (as the recipe sets it), once with the recipe's checkpointing and once without;
the two accumulated gradients must agree within the check's tolerance.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..models import build_model
from ..plan.overlay import variant
from ..plan.planner import Plan
from ..train.losses import build_loss
from ..train.setup import Setup
from ..train.step import optimizer_step
from .accumulation import GradientRecorder, _NoSchedule, _relative, dropouts

if TYPE_CHECKING:
    from ..data import Datasets


def recomputation_error(plan: Plan, data: Datasets, micro_batches: list, device: torch.device, dtype: torch.dtype,
                        seed: int) -> tuple[float, bool]:
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
        recorder = GradientRecorder([p for p in model.parameters() if p.requires_grad])
        setup = Setup(plan.model_copy(update={"recipe": recipe}), model, recorder, _NoSchedule(), None,
                      build_loss(recipe, model), data, device, dtype)
        torch.manual_seed(seed + 1)  # the dropout masks: the same stream in both steps
        optimizer_step(setup, micro_batches)
        gradients.append(recorder.gradients)
    difference = math.sqrt(sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(*gradients, strict=True)))
    return _relative(difference, math.sqrt(sum(float(b.double().norm()) ** 2 for b in gradients[1]))), dropout
