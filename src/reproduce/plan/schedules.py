"""Learning-rate schedules in optimizer steps: the recipe's, each batch phase's own, and plateau decay. No torch.

A `StepSchedule` covers consecutive optimizer steps: a linear warm-up from its start, then its decay to
`decay_end_step`. The recipe's starts at step 0; a batch phase with its own `lr`, `warmup` or `decay` (LAMB's second
stage warms up again, You et al. 2019) starts another at its first step. A schedule runs until the next one starts
or the run ends; a phase without its own continues the one before, at its own LR-rule factor.

Plateau decay (He et al. 2016, "divided by 10 when the error plateaus") is ReduceLROnPlateau at the evaluation
points: `Plateau` keeps its state as plain numbers for the checkpoint and scales the planned LR. Its decreases depend
on the run, so the plan knows the schedule only up to the first step where one could happen."""

from __future__ import annotations

import math
from typing import Any

from .recipe.schedule import Decay, DecayKind
from .split import Frozen


class StepSchedule(Frozen):
    """One schedule in optimizer steps (0-based, absolute): what a batch phase's own `lr/warmup/decay` plans to."""

    start_step: int
    end_step: int | None  # where the next schedule starts or the run ends (None: unknown)
    lr: float  # the peak, with the phase's LR-rule factor
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0
    decay_kind: DecayKind = "constant"  # (a kind it does not know is refused: never another decay)
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
        return self.min_lr + (peak - self.min_lr) * float((1 - progress) ** self.power)


# ---- plateau decay at evaluation points ---------------------------------------------------------------------


class Plateau:
    """`torch.optim.lr_scheduler.ReduceLROnPlateau`'s decisions, on a scale of the planned LR.

    `step(value)` at each evaluation after the warm-up; `state` is plain numbers, kept in checkpoints so a resumed
    run decides as the uninterrupted one."""

    EPS = 1e-8  # ReduceLROnPlateau's default eps

    def __init__(self, decay: Decay, peak: float, min_lr: float, state: dict[str, Any] | None = None) -> None:
        """`decay`: the recipe's plateau decay; `peak` and `min_lr`: the planned LR and its floor (plan.lr, min_lr)."""
        self.factor, self.patience = decay.factor, decay.patience
        self.mode = decay.mode or ("max" if decay.metric == "eval_accuracy" else "min")
        self.threshold = 1e-4 if decay.threshold is None else decay.threshold
        self.threshold_mode = decay.threshold_mode or "rel"
        self.cooldown = decay.cooldown or 0
        self.metric = decay.metric
        self.peak = peak
        self.min_lr = min_lr
        self.state = state or {"best": math.inf if self.mode == "min" else -math.inf, "bad": 0, "cooldown": 0,
                               "scale": 1.0, "evaluations": 0, "decreases": []}

    @staticmethod
    def metric_value(metric: str, evaluation: dict[str, Any]) -> float | None:
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
