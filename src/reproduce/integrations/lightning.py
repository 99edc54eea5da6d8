"""`ExactAccumulation`: Lightning's gradient accumulation made the large batch's.

Lightning's `accumulate_grad_batches = N` divides each micro-batch's loss by N: with mean losses, the mean of N
means (not the window's mean when token counts differ), and an epoch's last window of k < N micro-batches divided
by N too. Here `training_step` returns the *summed* loss; the callback counts each batch's loss items (`count`),
sums the window's count over the ranks, and before Lightning clips and steps multiplies the gradient by N x world
size / count. Given a plan it sets `accumulate_grad_batches` and applies the LR rule. Manual optimization is
refused (use `reproduce.Accumulator` in `training_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from ..errors import UserError

__all__ = ["ExactAccumulation", "count_targets"]


def count_targets(batch: Any) -> int:
    """A batch's loss items: its targets (`(inputs, targets)`, `{"labels": ...}` or a tensor) that are
    not -100."""
    targets = batch
    if isinstance(batch, dict):
        targets = batch["labels"]
    elif isinstance(batch, (tuple, list)):
        targets = batch[-1]
    if not isinstance(targets, torch.Tensor):
        raise UserError("cannot count the loss items of this batch: give `count` (a function of the batch)",
                        field="count")
    return int((targets != -100).sum())


class ExactAccumulation(pl.Callback):
    """The window's gradient normalised by its global item count. `plan`: its accumulation steps
    become `accumulate_grad_batches`, its LR factor multiplies the LRs (and schedulers' base LRs); the world size must
    be the plan's. `count`: a batch's loss items (default `count_targets`)."""

    def __init__(self, plan: Any = None, count: Callable[[Any], int] | None = None):
        super().__init__()
        self.plan = plan
        self.count = count or count_targets
        self.window_items = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise UserError("ExactAccumulation: the module optimizes manually, so Lightning does not accumulate: use "
                            "reproduce.Accumulator in its training_step instead", field="automatic_optimization")
        if self.plan is not None:
            if trainer.world_size != self.plan.world_size:
                raise UserError(f"the plan is for {self.plan.world_size} processes and the trainer has "
                                f"{trainer.world_size}: plan again with `world_size` {trainer.world_size}",
                                field="world_size")
            trainer.accumulate_grad_batches = self.plan.accumulation_steps

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        factor = self.plan.split.lr_factor if self.plan is not None else 1.0
        if factor == 1.0:
            return
        for optimizer in trainer.optimizers:  # the plan's LR rule on the user's LR
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.window_items += self.count(batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        items = self.window_items
        if trainer.world_size > 1:  # the window's count over every rank
            items = int(trainer.strategy.reduce(torch.tensor(items, device=pl_module.device), reduce_op="sum"))
        self.window_items = 0
        # Lightning divided each summed loss by N, and DDP averaged over the ranks: what the count replaces
        factor = trainer.accumulate_grad_batches * trainer.world_size / max(items, 1)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)
