"""Plateau decay in a run (`schedule.decay: {kind: plateau}`), stepped at each evaluation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ...errors import UserError
from ...plan.planner import Plan, lr_at
from ...plan.schedules import Plateau

if TYPE_CHECKING:
    from ...data import Datasets


class PlanScheduler(torch.optim.lr_scheduler.LambdaLR):
    """The LR of optimizer step s: `lr_at(plan, s)` x the plateau decay's scale; `state_dict` adds the
    plateau's state (plain numbers), which a state without it leaves where it starts."""

    def __init__(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        plateau = plan.schedule.decay_kind == "plateau"
        self._plateau = Plateau(plan.recipe.schedule.decay, plan.lr, plan.schedule.min_lr) if plateau else None
        plateau = self._plateau
        super().__init__(optimizer, lambda step: lr_at(plan, step) / plan.lr * (
            plateau.state["scale"] if plateau is not None else 1.0))

    @property
    def plateau(self) -> Plateau | None:
        return self._plateau

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_plateau", None)
        if self._plateau is not None:
            state["plateau"] = dict(self._plateau.state)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        saved = state.pop("plateau", None)
        super().load_state_dict(state)
        if self._plateau is not None and saved is not None:
            self._plateau.state = saved

    def plateau_step(self, value: float, step: int) -> bool:
        """One evaluation's metric after step `step` (from 1); on a decrease the next step's
        LR is set at once."""
        decreased = self._plateau.step(value, step)
        if decreased:
            for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
                group["lr"] = base * factor(self.last_epoch)
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        return decreased


def check_plateau(plan: Plan, data: Datasets) -> None:
    """A plateau decay needs evaluation data to watch (the recipe's evaluation.every_steps is checked on load)."""
    decay = plan.recipe.schedule.decay
    if decay.kind == "plateau" and data.eval is None:
        raise UserError(f"schedule.decay: kind plateau watches {decay.metric}, but this run has no evaluation data; "
                        "give `eval_data_path` PATH (or data.eval_path)")


def step_plateau(setup, evaluation: dict | None, step: int) -> dict:
    """The plateau decay's step after step `step`'s evaluation (from 1), on every rank alike (rank 0's
    metric broadcast); the record's fields."""
    scheduler = setup.scheduler
    plateau = getattr(scheduler, "plateau", None)
    if plateau is None or step < setup.plan.warmup_steps:  # evaluations during the warm-up are not counted
        return {}
    value = Plateau.metric_value(plateau.metric, evaluation or {})
    if setup.world.distributed and not setup.sharded:  # a sharded model evaluated on every rank
        shared = torch.tensor([math.nan if value is None else value], dtype=torch.float64, device=setup.device)
        torch.distributed.broadcast(shared, src=0)
        value = None if math.isnan(float(shared)) else float(shared)
    if value is None:
        return {}
    if scheduler.plateau_step(value, step):
        return {"plateau_lr": scheduler.get_last_lr()[0]}
    return {}
