"""Everything a run needs, built one way: model, optimizer, scheduler, scaler, loss and data, on its device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..data import Datasets, build_data
from ..errors import UserError
from ..models import build_model, count_batchnorm, place
from ..plan.batchnorm import label_disagreement
from ..plan.planner import Plan
from ..plan.recipe import Recipe
from .distributed import processes as distributed
from .distributed.processes import World
from .losses import build_loss
from .optim.optimizers import PlanScheduler, build_optimizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("cuda was asked for, but torch sees no CUDA device (use `device` cpu)", field="device")
    if name not in ("cpu", "cuda"):
        raise UserError(f"expected cpu, cuda or auto (got {name!r})", field="device")
    return torch.device(name)


def check_sync_batchnorm(world: World, device: torch.device) -> None:
    """SyncBatchNorm needs several CUDA processes."""
    if not world.distributed:
        raise UserError("sync normalises over the micro-batches of several processes, and this run has one: launch "
                        "it with `world_size` N on N GPUs, or give `batchnorm` keep | frozen | group",
                        field="model.batchnorm")
    if device.type != "cuda":
        raise UserError(f"sync needs CUDA (torch.nn.SyncBatchNorm runs on CUDA only in PyTorch) and this run is on "
                        f"{device.type}: give `batchnorm` keep | frozen | group", field="model.batchnorm")


@dataclass
class Setup:
    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    loss: Any
    data: Datasets
    device: torch.device
    dtype: torch.dtype
    world: World = World()
    sync_counter: distributed.SyncCounter | None = None
    notes: list[str] = field(default_factory=list)
    sharded: bool = field(init=False)  # several processes under FSDP (DDP otherwise)
    unwrapped_model: nn.Module = field(init=False)  # without DDP's wrapper (FSDP2 shards the model in place: none)

    def __post_init__(self) -> None:
        self.sharded = self.world.distributed and self.plan.recipe.batch.sharding == "fsdp"
        self.unwrapped_model = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def autocast(self) -> contextlib.AbstractContextManager:
        precision = self.plan.recipe.precision
        if precision == "fp32" or self.sharded:  # FSDP: its MixedPrecisionPolicy casts the parameters instead
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def build(plan: Plan, device: torch.device, dtype: torch.dtype = torch.float32, seed: int | None = None,
          data: Datasets | None = None, world: World | None = None, recipe: Recipe | None = None) -> Setup:
    """Model, optimizer, scheduler, scaler, loss and data for `plan`, seeded for a reproducible start; under
    several processes the model is wrapped in DDP (a hook counts the synchronisations) or sharded with FSDP2.
    `recipe`: the plan's, or one with other weights and data (evaluation.evaluate_run)."""
    recipe = recipe or plan.recipe
    world = world or World()
    data = data if data is not None else build_data(recipe)
    torch.manual_seed(recipe.seed if seed is None else seed)
    model = place(build_model(recipe, data.info), recipe, device, dtype)  # model.dtype kept in float32 runs
    if recipe.model.batchnorm == "sync":  # refused where it cannot run; else statistics over every process's batch
        check_sync_batchnorm(world, device)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # what the run says about BatchNorm at its start: the plan's choice, and a label the built model disagrees with
    notes, layers = [], count_batchnorm(model)
    if plan.batchnorm is not None:
        notes.append(plan.batchnorm.summary)
    elif layers and not recipe.model.has_batchnorm:  # a model the plan could not count
        notes.append(f"the model has {layers} BatchNorm layers (counted) the recipe does not list in "
                     f"model.norm_layers: BN statistics are computed per micro-batch of {plan.micro_batch}, not over "
                     "the effective batch")
    if recipe.model.batchnorm in ("keep", "sync"):
        disagreement = label_disagreement(recipe.model, layers)
        if disagreement and disagreement not in plan.warnings:
            notes.append(disagreement)
    if recipe.model.batchnorm == "frozen" and plan.batchnorm is not None:  # from random weights: meaningless
        notes.extend(line for line in plan.batchnorm.lines if line.startswith("frozen:"))
    loaded = getattr(model, "backbone_report", None)  # which tensors came from the backbone file, which did not
    if loaded:
        notes.insert(0, loaded)
    if recipe.task == "segmentation" and data.eval is None:
        notes.append("no evaluation data: the run reports no eval loss, mIoU or pixel accuracy (give --eval-data, "
                     "data.eval_path, a voc folder's val list, or images/ and masks/ with train/ and val/)")
    counter = None
    if world.distributed:
        counter = distributed.SyncCounter()
        if recipe.batch.sharding == "fsdp":  # before the optimizer: it must hold the sharded parameters
            from .distributed.fsdp import shard  # torch.distributed.fsdp takes 0.6 s to import: only for sharded runs

            model = shard(model, recipe.precision, world, device, counter, offload=recipe.batch.offload == "cpu")
    optimizer = build_optimizer(plan, model)  # DDP shares the plain module's parameters
    scheduler = PlanScheduler(plan, optimizer)  # counts optimizer steps
    # fp16 under FSDP too: the gradients are DTensors, and the scaler's inf check on them agrees over the ranks
    scaler = torch.amp.GradScaler(device.type) if recipe.precision == "fp16" else None
    if world.distributed and recipe.batch.sharding != "fsdp":
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        model.register_comm_hook(None, counter.hook)
    loss = build_loss(recipe, model)  # a chunked loss applies the model's head (model.loss_chunks)
    return Setup(plan, model, optimizer, scheduler, scaler, loss, data, device, dtype, world, counter, notes)
