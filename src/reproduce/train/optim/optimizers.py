"""The optimizer and LR scheduler of a plan: parameter groups from the recipe's `no_decay`, steps counted in
optimizer steps, and the plateau decay (`schedule.decay: {kind: plateau}`) stepped at each evaluation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...errors import UserError
from ...plan.planner import Plan, lr_at
from ...plan.schedules import Plateau

if TYPE_CHECKING:
    from ...data import Datasets

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)

if hasattr(nn, "RMSNorm"):
    NORM_TYPES = (*NORM_TYPES, nn.RMSNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay: list[str], layer_adaptation: bool = False
                 ) -> list[dict]:
    """Decayed and not decayed parameters, by the recipe's `no_decay` (tied ones once); with
    `layer_adaptation` (LARS, LAMB) the excluded ones also get ratio 1, so they are split off without decay too."""
    if not no_decay or (weight_decay == 0 and not layer_adaptation):
        group = {"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}
        return [{**group, "layer_adaptation": True} if layer_adaptation else group]
    decay, keep, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            excluded = (
                ("bias" in no_decay and name == "bias")
                or ("norm" in no_decay and isinstance(module, NORM_TYPES))
                or ("embedding" in no_decay and isinstance(module, nn.Embedding))
                or ("1d" in no_decay and param.ndim < 2)
            )
            (keep if excluded else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    if layer_adaptation:
        groups[0]["layer_adaptation"], groups[1]["layer_adaptation"] = True, False
    return groups


def build_optimizer(plan: Plan, model: nn.Module) -> torch.optim.Optimizer:
    spec = plan.recipe.optimizer
    layer_wise = spec.name in ("lars", "lamb")
    groups = param_groups(model, spec.weight_decay, list(spec.no_decay), layer_adaptation=layer_wise)
    if spec.bitsandbytes:
        return bitsandbytes_optimizer(plan, groups)
    # torch.optim's arguments for `optimizer.implementation`; none for PyTorch's own choice (foreach on CUDA)
    kernels = {} if spec.implementation is None else {"foreach": spec.implementation == "foreach",
                                                      **({"fused": True} if spec.implementation == "fused" else {})}
    if spec.name in ("sgd", "nesterov"):
        return torch.optim.SGD(groups, lr=plan.lr, momentum=spec.momentum, nesterov=spec.name == "nesterov", **kernels)
    if spec.name in ("adam", "adamw"):
        adam = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
        return adam(groups, lr=plan.lr, betas=spec.betas, eps=spec.eps, **kernels)
    if layer_wise:
        from .large_batch import LAMB, LARS, LARS_TRUST_COEFFICIENT  # (imported by the runs that step with them)

        if spec.name == "lars":
            return LARS(groups, lr=plan.lr, momentum=spec.momentum,
                        trust_coefficient=spec.trust_coefficient or LARS_TRUST_COEFFICIENT)
        return LAMB(groups, lr=plan.lr, betas=spec.betas, eps=spec.eps)
    if spec.name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(groups, lr=plan.lr, eps=(None, spec.eps), **kernels)
    raise UserError(f"optimizer.name: {spec.name} has no PyTorch implementation to run here (it can be planned)")


def bitsandbytes_optimizer(plan: Plan, groups: list[dict]) -> torch.optim.Optimizer:
    """adam/adamw with `paged` and/or `state_bits: 8`: bitsandbytes' (Paged)Adam(W)(8bit), as
    QLoRA and transformers' `optim` use; tensors under 4096 elements keep 32-bit state (min_8bit_size)."""
    from ...models.quantize import bitsandbytes

    spec = plan.recipe.optimizer
    try:
        bnb = bitsandbytes()
    except UserError:
        raise UserError(f"optimizer: {'paged' if spec.paged else 'state_bits: 8'} needs bitsandbytes, which is not "
                        "installed (pip install 'reproduce[quantize]')") from None
    name = spec.bitsandbytes_class
    import warnings

    # on a CPU, at the first step: "Paged optimizers are not supported on CPU" (it steps unpaged, as documented)
    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return getattr(bnb.optim, name)(groups, lr=plan.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


class PlanScheduler(torch.optim.lr_scheduler.LambdaLR):
    """The LR of optimizer step s: `lr_at(plan, s)` x the plateau decay's scale; `state_dict` adds the
    plateau's state (plain numbers), which a state without it leaves where it starts."""

    def __init__(self, plan: Plan, optimizer: torch.optim.Optimizer) -> None:
        plateau = (Plateau(plan.recipe.schedule.decay, plan.lr, plan.schedule.min_lr)
                   if plan.schedule.decay_kind == "plateau" else None)
        self.plateau = plateau
        super().__init__(optimizer, lambda step: lr_at(plan, step) / plan.lr * (
            plateau.state["scale"] if plateau is not None else 1.0))

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("plateau", None)
        if self.plateau is not None:
            state["plateau"] = dict(self.plateau.state)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        saved = state.pop("plateau", None)
        super().load_state_dict(state)
        if self.plateau is not None and saved is not None:
            self.plateau.state = saved

    def plateau_step(self, value: float, step: int) -> bool:
        """One evaluation's metric after step `step` (from 1); on a decrease the next step's
        LR is set at once."""
        decreased = self.plateau.step(value, step)
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
