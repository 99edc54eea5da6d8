"""Everything a run needs, built one way: model, optimizer, scheduler, scaler, loss and data, on its device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data import build_data
from ..errors import UserError
from ..models import build_model, has_batchnorm, place
from ..planner import Plan
from . import distributed
from .distributed import World
from .losses import build_loss
from .optim import build_optimizer, build_scheduler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for, but torch sees no CUDA device (use --device cpu)")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device: expected cpu, cuda or auto (got {name!r})")
    return torch.device(name)


@dataclass
class Setup:
    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    loss: Any
    data: dict
    device: torch.device
    dtype: torch.dtype
    world: World = World()
    sync_counter: distributed.SyncCounter | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ddp(self) -> bool:
        return self.world.distributed

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def core(self) -> nn.Module:
        """The model without DDP's wrapper."""
        return self.model.module if self.ddp else self.model

    def autocast(self) -> contextlib.AbstractContextManager:
        precision = self.plan.recipe.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def build(plan: Plan, device: torch.device, dtype: torch.dtype = torch.float32, seed: int | None = None,
          data: dict | None = None, world: World | None = None) -> Setup:
    """Model, optimizer, scheduler, scaler, loss and data for `plan`, seeded for a reproducible start.

    Under several processes the model is wrapped in DistributedDataParallel (every rank starts from the same
    seed, so from the same weights) with a hook that counts gradient synchronisations.
    """
    recipe = plan.recipe
    world = world or World()
    data = data if data is not None else build_data(recipe)
    torch.manual_seed(recipe.seed if seed is None else seed)
    model = place(build_model(recipe, data.get("info")), recipe, device, dtype)  # model.dtype kept in float32 runs
    notes = []
    if has_batchnorm(model) and not recipe.model.has_batchnorm:
        notes.append(
            "the model has BatchNorm layers but the recipe does not list batchnorm in model.norm_layers: "
            f"BN statistics are computed per micro-batch of {plan.micro_batch}, not over the effective batch"
        )
    optimizer = build_optimizer(plan, model)  # built on the plain module's parameters, which DDP shares
    scheduler = build_scheduler(plan, optimizer)
    scaler = torch.amp.GradScaler(device.type) if recipe.precision == "fp16" else None
    counter = None
    if world.distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        counter = distributed.SyncCounter()
        model.register_comm_hook(None, counter.hook)
    return Setup(plan, model, optimizer, scheduler, scaler, build_loss(recipe), data, device, dtype, world, counter,
                 notes)
