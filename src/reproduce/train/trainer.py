"""The training run: the paper's large-batch updates, computed N micro-batches at a time.

For each optimizer step, over its window of N micro-batches:
  1. count the window's loss-bearing items (samples, or target tokens != -100) before any backward;
  2. for each micro-batch: summed loss / window count, backward (DDP: `no_sync` on all but the last);
  3. once per window: unscale (fp16), clip, optimizer step, scheduler step, zero_grad(set_to_none=True).
The gradient is then exactly that of the mean loss over the whole effective batch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..errors import Interrupted, TrainingStopped, UserError
from ..planfile import save_plan, write_text_atomic
from ..planner import Plan, lr_at
from . import distributed
from .distributed import World
from .factory import IGNORE_INDEX, SampleLoss, build_data, build_loss, build_model, has_batchnorm

NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
if hasattr(nn, "RMSNorm"):
    NORM_TYPES = (*NORM_TYPES, nn.RMSNorm)
CHECKPOINT_SECONDS = 300.0


class Reporter(Protocol):
    def start(self, plan: Plan, total_steps: int, first_step: int) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


class SilentReporter:
    def start(self, plan: Plan, total_steps: int, first_step: int) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


# ---- set-up -----------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for, but torch sees no CUDA device (use --device cpu)")
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device: expected cpu, cuda or auto (got {name!r})")
    return torch.device(name)


def param_groups(model: nn.Module, weight_decay: float, no_decay: list[str]) -> list[dict]:
    """Split parameters into decayed and not decayed, as the recipe's `no_decay` says (tied ones once)."""
    if not no_decay or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
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
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def build_optimizer(plan: Plan, model: nn.Module) -> torch.optim.Optimizer:
    spec = plan.recipe.optimizer
    groups = param_groups(model, spec.weight_decay, list(spec.no_decay))
    if spec.name in ("sgd", "nesterov"):
        return torch.optim.SGD(groups, lr=plan.lr, momentum=spec.momentum, nesterov=spec.name == "nesterov")
    if spec.name == "adam":
        return torch.optim.Adam(groups, lr=plan.lr, betas=spec.betas, eps=spec.eps)
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=plan.lr, betas=spec.betas, eps=spec.eps)
    if spec.name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(groups, lr=plan.lr, eps=(None, spec.eps))
    raise UserError(f"optimizer.name: {spec.name} has no PyTorch implementation to run here (it can be planned)")


def build_scheduler(plan: Plan, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Counts optimizer steps: the LR of step s is `lr_at(plan, s)`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(plan, step) / plan.lr)


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
    model = build_model(recipe, data.get("info")).to(device=device, dtype=dtype)
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


# ---- data windows -----------------------------------------------------------------------------------


def epoch_order(plan: Plan, size: int, epoch: int, seed: int) -> torch.Tensor:
    """The sample order of `epoch`: a permutation drawn from (seed, epoch) alone, so resume sees the same."""
    return _order(size, epoch, seed, plan.recipe.data.shuffle)


@functools.lru_cache(maxsize=2)  # drawn once per epoch, not once per optimizer step
def _order(size: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


def window(plan: Plan, size: int, step: int, seed: int, rank: int = 0,
           micro_batch: int | None = None) -> tuple[list[torch.Tensor], bool]:
    """This rank's micro-batches (index tensors) for optimizer step `step`, and whether the window is partial.

    The window is the same slice of the epoch's order whatever the micro-batch or world size, so a run that
    changes either (out of memory, resume elsewhere) still takes the same samples into each optimizer step.
    """
    batch = plan.effective_batch
    per_epoch = plan.steps_per_epoch
    epoch, position = divmod(step, per_epoch)
    indices = epoch_order(plan, size, epoch, seed)[position * batch : (position + 1) * batch]
    partial = len(indices) < batch
    mine = torch.tensor_split(indices, plan.world_size)[rank] if partial else (
        indices[rank * plan.per_rank_batch : (rank + 1) * plan.per_rank_batch]
    )
    return list(torch.split(mine, micro_batch or plan.micro_batch)), partial


def smaller_micro_batch(per_rank_batch: int, micro_batch: int) -> int | None:
    """After an out-of-memory error: the largest micro-batch <= half the current one that still divides this
    rank's share of the effective batch (so the effective batch stays exact); None below 1."""
    for candidate in range(micro_batch // 2, 0, -1):
        if per_rank_batch % candidate == 0:
            return candidate
    return None


class StopSignals:
    """SIGINT / SIGTERM set a flag; the loop finishes its optimizer step, checkpoints, and stops."""

    EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.EXIT_CODES:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def agreed(self, world: World, device: torch.device) -> int | None:
        """The signal any rank received (all ranks stop after the same step)."""
        if not world.distributed:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)  # NCCL: CUDA tensors only
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag) or None


def fetch(dataset: Any, indices: torch.Tensor) -> tuple[Any, Any]:
    """The (inputs, targets) of `indices`: sliced directly from tensors where possible, else collated."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = dataset.tensors[0], dataset.tensors[-1]
        return inputs[indices], targets[indices]
    if hasattr(dataset, "batch"):
        return dataset.batch(indices)
    return collate([dataset[int(i)] for i in indices])


def collate(items: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Stack equal shapes; pad sequences of different lengths (inputs with 0, targets with -100)."""
    inputs = [torch.as_tensor(x) for x, _ in items]
    targets = [torch.as_tensor(y) for _, y in items]
    if all(x.shape == inputs[0].shape for x in inputs) and all(y.shape == targets[0].shape for y in targets):
        return torch.stack(inputs), torch.stack(targets)
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(inputs, batch_first=True, padding_value=0), pad(targets, batch_first=True, padding_value=IGNORE_INDEX)


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device != device:
            value = value.to(device, non_blocking=True)
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    return value


class LazyMicroBatch:
    """A micro-batch fetched and moved to the device only when its forward runs.

    The window's loss-bearing items are counted first from the targets alone, so memory holds one
    micro-batch's inputs at a time, as a single micro-batch step does.
    """

    def __init__(self, dataset: Any, indices: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.dataset, self.indices, self.device, self.dtype = dataset, indices, device, dtype

    def targets(self) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return self.dataset.tensors[-1][self.indices]
        return fetch(self.dataset, self.indices)[1]

    def load(self) -> tuple[Any, Any]:
        return to_device(fetch(self.dataset, self.indices), self.device, self.dtype)


def _targets(micro_batch: Any) -> Any:
    return micro_batch.targets() if isinstance(micro_batch, LazyMicroBatch) else micro_batch[1]


def _load(micro_batch: Any) -> tuple[Any, Any]:
    return micro_batch.load() if isinstance(micro_batch, LazyMicroBatch) else micro_batch


# ---- one optimizer step -----------------------------------------------------------------------------


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    count: int
    samples: int
    tokens: int
    finite: bool
    grad_syncs: int | None = None


def global_counts(setup: Setup, count: int, samples: int) -> tuple[int, int]:
    """The window's loss-bearing items and samples summed over every rank, before the first backward."""
    if not setup.ddp:
        return count, samples
    totals = torch.tensor([count, samples], dtype=torch.int64, device=setup.device)
    torch.distributed.all_reduce(totals)
    return int(totals[0]), int(totals[1])


def optimizer_step(setup: Setup, micro_batches: list) -> StepResult:
    """One optimizer step over a window of micro-batches: (inputs, targets) on the device, or LazyMicroBatch."""
    model, loss_fn = setup.model, setup.loss
    if isinstance(loss_fn, SampleLoss) and all(isinstance(m, LazyMicroBatch) for m in micro_batches):
        local = samples = sum(len(m.indices) for m in micro_batches)  # every sample bears loss: no fetch needed
    else:
        targets = [_targets(micro_batch) for micro_batch in micro_batches]
        local, samples = sum(loss_fn.count(t) for t in targets), sum(len(t) for t in targets)
        del targets
    count, samples = global_counts(setup, local, samples)
    losses = []
    for index, micro_batch in enumerate(micro_batches):
        inputs, target = _load(micro_batch)
        last = index == len(micro_batches) - 1
        sync = contextlib.nullcontext() if (last or not setup.ddp) else model.no_sync()
        with sync:
            with setup.autocast():
                loss = loss_fn(model(inputs), target) / max(count, 1)
            (setup.scaler.scale(loss) if setup.scaler else loss).backward()
        losses.append(loss.detach())
    window_loss = torch.stack(losses).sum()
    if setup.ddp:  # the logged loss is the mean over the global window
        torch.distributed.all_reduce(window_loss)
    try:
        return _apply_window(setup, window_loss, count, samples)
    except torch.OutOfMemoryError as error:
        raise OptimizerStepOutOfMemory(str(error)) from None


class OptimizerStepOutOfMemory(torch.OutOfMemoryError):
    """Out of memory after the window's gradients were accumulated (unscale, clip or the optimizer's step).

    Still an out-of-memory error to the probe; the run cannot redo such a window (the scaler has unscaled,
    or some parameters have stepped), so it stops instead of lowering the micro-batch.
    """


def _apply_window(setup: Setup, window_loss: torch.Tensor, count: int, samples: int) -> StepResult:
    """Unscale, clip, step, schedule and zero the accumulated gradients of one window."""
    model = setup.model
    if setup.scaler:
        setup.scaler.unscale_(setup.optimizer)
    clip = setup.plan.recipe.clip_grad_norm
    if clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:  # the norm for the metrics, without clip_grad_norm_'s rescaling pass
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    loss_value, norm_value = float(window_loss), float(grad_norm)
    finite = math.isfinite(loss_value) and math.isfinite(norm_value)
    if setup.scaler:
        setup.scaler.step(setup.optimizer)  # skips the update itself when fp16 gradients overflowed
        setup.scaler.update()
        finite = math.isfinite(loss_value)
    elif finite:  # a non-finite step never touches the weights (the run stops, or skips it)
        setup.optimizer.step()
    setup.scheduler.step()
    setup.optimizer.zero_grad(set_to_none=True)
    tokens = count if setup.plan.recipe.task == "language-modeling" else 0
    syncs = setup.sync_counter.take() if setup.sync_counter else None
    return StepResult(loss_value, norm_value, count, samples, tokens, finite, syncs)


@torch.no_grad()
def evaluate(setup: Setup, batch: int | None = None) -> dict | None:
    """Mean loss (and accuracy) over the eval split, in batches of `batch` (default: the micro-batch)."""
    dataset = setup.data.get("eval")
    if dataset is None or len(dataset) == 0:
        return None
    model = setup.core
    was_training = model.training
    model.eval()
    total_loss, total_count, correct = 0.0, 0, 0
    batch = max(batch or setup.plan.micro_batch, 1)
    for start in range(0, len(dataset), batch):
        indices = torch.arange(start, min(start + batch, len(dataset)))
        inputs, target = to_device(fetch(dataset, indices), setup.device, setup.dtype)
        with setup.autocast():
            output = model(inputs)
        total_loss += float(setup.loss(output, target))
        total_count += setup.loss.count(target)
        if setup.plan.recipe.task == "classification":
            correct += int((output.argmax(-1) == target).sum())
    model.train(was_training)
    result = {"eval_loss": total_loss / max(total_count, 1), "eval_items": total_count}
    if setup.plan.recipe.task == "classification":
        result["eval_accuracy"] = correct / max(total_count, 1)
    return result


# ---- checkpoints ------------------------------------------------------------------------------------


def save_checkpoint(setup: Setup, path: Path, step: int, metrics_offset: int, extra: dict) -> None:
    """Atomically: write a temporary file, then rename over the previous checkpoint."""
    state = {
        "step": step,
        "model": setup.core.state_dict(),
        "optimizer": setup.optimizer.state_dict(),
        "scheduler": setup.scheduler.state_dict(),
        "scaler": setup.scaler.state_dict() if setup.scaler else None,
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if setup.device.type == "cuda" else None,
        "rng_python": list(random.getstate()[1]),
        "metrics_offset": metrics_offset,
        "micro_batch": extra.get("micro_batch"),
        "extra": extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(setup: Setup, path: Path) -> dict:
    try:
        state = torch.load(path, map_location=setup.device, weights_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot load checkpoint: {type(exc).__name__}: {exc}") from None
    setup.core.load_state_dict(state["model"])
    setup.optimizer.load_state_dict(state["optimizer"])
    setup.scheduler.load_state_dict(state["scheduler"])
    if setup.scaler and state["scaler"]:
        setup.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng_torch"].cpu())
    if state["rng_cuda"] is not None and setup.device.type == "cuda":
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])
    random.setstate((3, tuple(state["rng_python"]), None))
    return state


# ---- the run ----------------------------------------------------------------------------------------


def check_out_dir(out: Path, resume: bool, force: bool) -> None:
    """Never overwrite another run: a non-empty folder needs --resume (same run) or --force."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} exists and is not a folder")
    if resume:
        if not (out / "checkpoints" / "last.pt").is_file():
            raise UserError(f"--resume: {out} has no checkpoints/last.pt to resume from")
        return
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"--out: {out} is not empty (it holds another run); pass --resume to continue it, "
            "--force to overwrite its outputs, or choose another folder"
        )


OUTPUTS = ("plan.yaml", "metrics.jsonl", "summary.json", "model.pt", "loss.png", "checkpoints/last.pt")


def remove_outputs(out: Path) -> None:
    """The files a run writes, removed before another run takes the folder over (--force); nothing else."""
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    if (out / "tensorboard").is_dir():
        shutil.rmtree(out / "tensorboard")


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 4_099 + rank * 7_919_993) % (2**63 - 1)


def seed_step(device: torch.device, value: int) -> None:
    """Seed the generators this run draws from (torch.manual_seed also visits every backend: ~100x slower)."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)


class MetricsLog:
    """metrics.jsonl, appended and flushed once per optimizer step; written by rank 0 alone."""

    def __init__(self, path: Path, offset: int, enabled: bool):
        self.path, self.handle = path, None
        if enabled:
            with open(path, "a+b") as handle:
                handle.truncate(offset)  # drop lines written after the checkpoint we resume from
            self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, record: dict) -> None:
        if self.handle:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def offset(self) -> int:
        return self.handle.tell() if self.handle else 0

    def close(self) -> None:
        if self.handle:
            self.handle.close()


def train(
    plan: Plan,
    out: str | Path,
    *,
    device: str = "auto",
    max_steps: int | None = None,
    resume: bool = False,
    force: bool = False,
    seed: int | None = None,
    checkpoint_every: int | None = None,
    skip_nonfinite: bool = False,
    dtype: torch.dtype = torch.float32,
    reporter: Reporter | None = None,
    data: dict | None = None,
) -> dict:
    """Run `plan`, writing plan.yaml, metrics.jsonl, checkpoints/last.pt, model.pt and summary.json to `out`.

    Under torchrun every rank trains its share of each window; rank 0 alone writes.
    """
    out = Path(out)
    reporter = reporter or SilentReporter()
    world = distributed.world_from_env()
    if world.size != plan.world_size:
        raise UserError(f"plan: world_size is {plan.world_size}, but this job has {world.size} process(es)")
    check_out_dir(out, resume, force)
    asked_seed, seed = seed, plan.recipe.seed if seed is None else seed
    target_device = distributed.init(world, resolve_device(device))
    distributed.barrier(world)  # every rank has looked at --out before rank 0 writes to it
    setup = build(plan, target_device, dtype, seed, data, world)
    train_set = setup.data["train"]
    size = len(train_set)
    if plan.dataset_size != size:
        raise UserError(f"plan: dataset_size {plan.dataset_size} does not match the training set's {size} items")
    if not plan.steps_per_epoch:
        raise UserError(
            f"data: the epoch ({size} {plan.unit}) is shorter than one optimizer step ({plan.effective_batch}) "
            "with drop_last: no step would run; lower the batch or set data.drop_last: false"
        )
    total = plan.optimizer_steps if max_steps is None else min(max_steps, plan.optimizer_steps)
    checkpoint_path = out / "checkpoints" / "last.pt"
    first_step, metrics_offset, micro_batch = 0, 0, plan.micro_batch
    if resume:
        state = load_checkpoint(setup, checkpoint_path)
        first_step, metrics_offset = state["step"], state["metrics_offset"]
        saved_seed = state["extra"].get("seed", seed)
        if asked_seed is not None and asked_seed != saved_seed:
            raise UserError(f"--seed: the run in {out} was started with seed {saved_seed} (got {asked_seed})")
        seed = saved_seed  # the data order and dropout streams of the run being continued
        if first_step >= total:
            raise UserError(f"--resume: {out} has already run {first_step} of {total} optimizer steps; nothing to do")
        if state.get("micro_batch") and state["micro_batch"] < micro_batch and not world.distributed:
            micro_batch = state["micro_batch"]  # the run had lowered it after running out of memory
    main = world.is_main
    if main:
        if force and not resume:  # another run's outputs go, so nothing of it is mistaken for this one's
            remove_outputs(out)
        out.mkdir(parents=True, exist_ok=True)
        save_plan(plan, out / "plan.yaml")
    metrics = MetricsLog(out / "metrics.jsonl", metrics_offset, enabled=main)
    # Checkpoint every K steps when asked; otherwise every CHECKPOINT_SECONDS of wall time, and always at the end.
    last_checkpoint = time.perf_counter()
    for note in setup.notes:
        reporter.message(f"note: {note}")
    reporter.start(plan, total, first_step)
    started = time.perf_counter()
    counters = {"samples": 0, "tokens": 0, "partial_windows": 0, "skipped_nonfinite": 0, "out_of_memory": 0}
    last_record: dict = {}
    eval_every = plan.recipe.evaluation.every_steps
    setup.model.train()
    stop = StopSignals()
    # On a CPU, values below float32's normal range (late in training, in momentum and gradients) make every
    # operation on them ~100x slower; flushing them to zero cost a digits run 3.5 s instead of 72 s.
    flush_denormals = setup.device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        stop.__enter__()
        for step in range(first_step, total):
            tick = time.perf_counter()
            # Dropout and other random draws of step s come from (seed, s, rank) alone: a resumed run draws what
            # the uninterrupted one did, and ranks draw independently of each other.
            seed_step(setup.device, step_seed(seed, step, setup.rank))
            lr = setup.optimizer.param_groups[0]["lr"]
            while True:
                indices, partial = window(plan, size, step, seed, setup.rank, micro_batch)
                micro_batches = [LazyMicroBatch(train_set, i, setup.device, dtype) for i in indices]
                try:
                    result = optimizer_step(setup, micro_batches)
                    break
                except OptimizerStepOutOfMemory as error:
                    raise TrainingStopped(
                        f"out of memory in the optimizer step itself at optimizer step {step + 1}, after the "
                        f"window's gradients were accumulated ({error}); lower --micro-batch-max or free memory, "
                        f"then --resume from {checkpoint_path}"
                    ) from None
                except torch.OutOfMemoryError:
                    # Free the window, halve the micro-batch, double N: the effective batch stays exact.
                    del micro_batches
                    setup.optimizer.zero_grad(set_to_none=True)
                    gc.collect()
                    if setup.device.type == "cuda":
                        torch.cuda.empty_cache()
                    smaller = None if world.distributed else smaller_micro_batch(plan.per_rank_batch, micro_batch)
                    if smaller is None:
                        raise TrainingStopped(
                            f"out of memory at optimizer step {step + 1} with micro-batch {micro_batch}"
                            + (" under several processes (ranks cannot change it alone)" if world.distributed
                               else ": no smaller micro-batch keeps the effective batch exact")
                            + f"; the last good checkpoint is {checkpoint_path}"
                        ) from None
                    counters["out_of_memory"] += 1
                    event = {"event": "out_of_memory", "step": step + 1, "micro_batch": smaller,
                             "accumulation_steps": plan.per_rank_batch // smaller, "was": micro_batch}
                    metrics.write(event)
                    reporter.message(
                        f"out of memory at step {step + 1}: micro-batch {micro_batch} -> {smaller}, accumulation "
                        f"{plan.per_rank_batch // micro_batch} -> {plan.per_rank_batch // smaller}; redoing the window"
                    )
                    micro_batch = smaller
            if not result.finite:
                if not skip_nonfinite and not setup.scaler:
                    raise TrainingStopped(
                        f"non-finite loss or gradient at optimizer step {step + 1} (loss {result.loss}, "
                        f"grad norm {result.grad_norm}); the last good checkpoint is {checkpoint_path}"
                    )
                counters["skipped_nonfinite"] += 1
            counters["samples"] += result.samples
            counters["tokens"] += result.tokens
            counters["partial_windows"] += partial
            record = {
                "step": step + 1,
                "epoch": round((step + 1) / plan.steps_per_epoch, 6),
                "lr": lr,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "samples": result.samples,
                "tokens": result.tokens,
                "items": result.count,
                "micro_batch": micro_batch,
                "accumulation_steps": len(micro_batches),
                "world_size": world.size,
                "partial": partial,
                "skipped": not result.finite,
                "seconds": round(time.perf_counter() - tick, 6),
                "peak_memory_bytes": peak_memory(setup.device),
            }
            if result.grad_syncs is not None:
                record["grad_syncs"] = result.grad_syncs
            done = step + 1 == total
            if main and ((eval_every and (step + 1) % eval_every == 0) or (done and plan.recipe.evaluation.at_end)):
                evaluation = evaluate(setup, micro_batch)
                if evaluation:
                    record.update(evaluation)
            metrics.write(record)
            last_record = record
            reporter.step(record)
            due = (step + 1) % checkpoint_every == 0 if checkpoint_every else (
                time.perf_counter() - last_checkpoint >= CHECKPOINT_SECONDS)
            received = stop.agreed(world, setup.device) if not done else None
            if main and (due or done or received):
                save_checkpoint(setup, checkpoint_path, step + 1, metrics.offset(),
                                {"seed": seed, "micro_batch": micro_batch})
                last_checkpoint = time.perf_counter()
            if received:
                distributed.barrier(world)
                raise Interrupted(
                    f"{signal.Signals(received).name} after optimizer step {step + 1} of {total}; checkpoint "
                    f"written to {checkpoint_path}. Continue with: reproduce run {out / 'plan.yaml'} --out {out} "
                    "--resume",
                    StopSignals.EXIT_CODES[received],
                )
    finally:
        stop.__exit__()
        metrics.close()
        if flush_denormals:
            torch.set_flush_denormal(False)

    elapsed = time.perf_counter() - started
    summary = {
        "steps": total,
        "planned_steps": plan.optimizer_steps,
        "resumed_from_step": first_step,
        "arithmetic": plan.arithmetic,
        "exact": plan.exact,
        "world_size": world.size,
        "final": last_record,
        "seconds": round(elapsed, 3),
        "samples_per_second": round(counters["samples"] / elapsed, 2) if elapsed > 0 else None,
        "window_policy": "drop_last" if plan.recipe.data.drop_last else "partial windows normalised by their items",
        **counters,
        "data": setup.data.get("info", {}),
        "notes": setup.notes,
    }
    if main:
        torch.save(setup.core.state_dict(), out / "model.pt")
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        summary["plot"] = plot_metrics(out / "metrics.jsonl", out / "loss.png")
    distributed.barrier(world)
    reporter.finish(summary)
    return summary


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_metrics(metrics_path: Path, png: Path) -> str:
    """A loss curve PNG when matplotlib is installed (the `plots` extra); otherwise a note saying so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no loss plot: matplotlib is not installed (pip install 'reproduce[plots]')"
    records = read_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        axis.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return str(png)
