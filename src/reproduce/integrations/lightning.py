"""`ExactAccumulation`: Lightning's gradient accumulation made the large batch's.

Lightning's `accumulate_grad_batches = N` divides each micro-batch's loss by N and steps every N batches (and at
the end of an epoch): with a mean loss per micro-batch that is the mean of N micro-batch means, not the mean over
the window's items when their counts differ (tokens), and an epoch's last window of k < N micro-batches is
divided by N too (its update k/N as large). This callback makes it exact: `training_step` returns the batch's
*summed* loss, the callback counts each batch's loss items (`count(batch)`; by default the targets that are not
-100: tokens for a language model, samples for a classifier), sums the window's count over the ranks, and before
the optimizer steps (and before Lightning clips) multiplies the accumulated gradient by N x world size / count:
what Lightning divided by (N, and DDP's average) replaced by the window's global count. Given a plan
(`reproduce.plan_recipe` / `plan_batch`), it also sets `accumulate_grad_batches` from it and applies its LR rule.
Manual optimization is refused (use `reproduce.Accumulator` inside `training_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from ..errors import UserError

__all__ = ["ExactAccumulation", "count_targets"]


def count_targets(batch: Any) -> int:
    """The loss items of a batch `(inputs, targets)`, `{"labels": ...}` or a tensor of targets: the targets that
    are not -100 (tokens of a language model; for a classifier, its samples)."""
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
    """The window's gradient normalised by its global item count (see the module's docstring).

    `plan`: a `reproduce` plan; its accumulation steps become the trainer's `accumulate_grad_batches` and its LR
    factor multiplies the optimizers' learning rates (and the schedulers' base LRs); the trainer's world size must
    be the plan's. `count`: the loss items of a batch (default `count_targets`)."""

    def __init__(self, plan: Any = None, count: Callable[[Any], int] | None = None):
        super().__init__()
        self.plan = plan
        self.count = count or count_targets
        self.window_items = 0
        self.factors: list[float] = []  # each optimizer step's rescaling of the gradient (for the curious)

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
        self.factors.append(factor)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)
