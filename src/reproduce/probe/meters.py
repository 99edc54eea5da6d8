"""Three ways to measure one trial, behind one interface: `meter.measure(micro_batch) -> Measurement`.

A trial builds the recipe's model, optimizer and precision, runs a warm-up step (making the optimizer state), then
`MEASURED_STEPS` steps of `ACCUMULATED` real-shape micro-batches, as `run` builds them (the second's forward runs
while the first's gradients are held: +1x the parameters); at the cap (N = 1) one alone. N > 2 holds (N - 2) more
inputs, small beside one's activations (bench/run_memory.py). Only `torch.OutOfMemoryError` fails a trial.

- `cuda`: real trials; `max_memory_reserved` decides, `max_memory_allocated` is reported; a budget below the card's
  is enforced with `set_per_process_memory_fraction`, else it is `mem_get_info`'s free plus this process's reserve.
- `cpu`: the same trials on the CPU, exact for the tensors (`MemoryTracker`, which enforces the budget); CI's.
- `estimate`: the step on fake tensors as CUDA runs it (fake_step.py, gpu_like.py), each trial run to its end. To
  the tracked tensors (with `UNSEEN_ACTIVATIONS`) it adds `ESTIMATE_MARGIN` of the peak (allocator segments,
  fragmentation) and the cuBLAS/cuBLASLt workspaces (8 MiB + 1 to 32 MiB); the CUDA context is outside the budget
  (hardware/catalog.py), fp16's GradScaler left out. Under FSDP one rank's peak comes from the parts
  (sharded_memory.py). `bench/gpu_check.py` sets it beside a card's measured peak.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..data.batches import to_device
from ..errors import UserError
from ..hardware.catalog import DEFAULT_CAPABILITY, Gpu, MiB
from ..models import build_on_meta
from ..plan.units import available_host_memory, format_size
from ..train.setup import build
from ..train.step import optimizer_step
from .fake_step import FakeStepResult, block_sizes, materialize, run_fake_step  # noqa: F401  (materialize: its interface)
from .gpu_like import UNSEEN_ACTIVATIONS, GpuKind
from .search import Measurement
from .sharded_memory import Blocks, mixed_precision_step, sharded_peak
from .tracker import MemoryTracker
from .workload import Workload

MEASURED_STEPS = 1
ACCUMULATED = 2  # micro-batches in a measured window: enough to hold gradients across a forward pass
WARM_UP_LIMIT = 8  # warm-up steps allowed to find one the optimizer really takes (fp16 may skip a few)
ESTIMATE_MARGIN = 0.05  # allocator segments and fragmentation, as a fraction of the estimated peak
CUBLAS_WORKSPACE = 8_519_680  # bytes per cuBLAS handle and stream, PyTorch's default
HOST_SHARE = 0.8  # the cpu meter allocates for real: budgets above this share of free RAM are refused


class Meter:
    name = "meter"
    device = "cpu"

    def __init__(self, workload: Workload, budget_bytes: int, headroom: float, time_steps: bool = True,
                 cap: int | None = None):
        self.workload = workload  # prepared (data built) by the first `measure`
        self.budget_bytes = budget_bytes
        self.limit_bytes = int(budget_bytes * (1 - headroom))
        self.time_steps = time_steps
        self.cap = cap  # the per-rank batch: a micro-batch this large needs no accumulation
        self.notes: list[str] = []

    def window(self, micro_batch: int, device: torch.device, dtype: torch.dtype) -> list:
        """The micro-batches of one measured optimizer step, on the device."""
        count = 1 if self.cap is not None and micro_batch >= self.cap else ACCUMULATED
        return [to_device(self.workload.batch(micro_batch), device, dtype) for _ in range(count)]

    def measure(self, micro_batch: int) -> Measurement:
        raise NotImplementedError

    def prepare(self) -> None:
        """What every trial shares, built before the first (so no trial counts or times it)."""
        self.workload.prepare()

    def trial(self, micro_batch: int, device: torch.device, tracker: MemoryTracker | None = None
              ) -> tuple[Callable[[], object], int]:
        """One trial's step, built and warmed up: the measured step, and the micro-batches it runs. `tracker`: the cpu
        meter's, already counting (a step built outside the trial charges it what it holds)."""
        setup = build(self.workload.plan, device, data=self.workload.data)
        window = self.window(micro_batch, device, setup.dtype)
        warm_up(setup, window)
        return lambda: optimizer_step(setup, window), len(window)

    def release(self, device: torch.device, failed: bool) -> None:
        """After a trial, its step let go: what a failed one held is garbage now; a full collection costs ~0.3 s, so
        only then (the cuda meter collects after every trial)."""
        if failed:
            gc.collect()

    def close(self) -> None:
        """Undo what the meter changed (the CUDA memory fraction)."""

    def _result(self, micro_batch: int, peak: int | None, tensors: int | None, step: float | None,
                started: float, note: str | None, parts: dict | None = None) -> Measurement:
        fits = peak is not None and peak <= self.limit_bytes
        if peak is not None and not fits:
            note = f"peak {format_size(peak)} is over the limit {format_size(self.limit_bytes)} (budget less headroom)"
        return Measurement(
            micro_batch=micro_batch, fits=fits, peak_bytes=peak, seconds=round(time.perf_counter() - started, 4),
            step_seconds=step, tensor_bytes=tensors, note=None if fits else note, parts=parts,
        )


def warm_up(setup: Any, window: list) -> None:
    """Training steps until the optimizer has really stepped once (its state now exists)."""
    for _ in range(WARM_UP_LIMIT):
        scale = setup.scaler.get_scale() if setup.scaler else None
        result = optimizer_step(setup, window)
        if setup.scaler is None and result.finite:
            return
        if setup.scaler is not None and setup.scaler.get_scale() >= scale:  # fp16: the scaler did not skip
            return


class CpuMeter(Meter):
    """Real trials on the CPU; their tensors counted by `MemoryTracker`, the budget enforced by it."""

    name = "cpu"

    def __init__(self, workload: Workload, budget_bytes: int, headroom: float, time_steps: bool = True,
                 cap: int | None = None):
        available = available_host_memory()
        if available is not None and budget_bytes > HOST_SHARE * available:
            raise UserError(
                f"`meter` cpu: the budget of {format_size(budget_bytes)} would be allocated for real, and this "
                f"machine has {format_size(available)} free; use `meter` estimate to plan for that much memory"
            )
        super().__init__(workload, budget_bytes, headroom, time_steps, cap)
        self.notes.append("cpu meter: tensor storage counted exactly (512 B blocks); no allocator or CUDA overheads")

    def measure(self, micro_batch: int) -> Measurement:
        self.prepare()
        started = time.perf_counter()
        device = torch.device("cpu")
        tracker = MemoryTracker(self.budget_bytes)
        peak = step = note = None
        try:
            with tracker:
                measured, micro_steps = self.trial(micro_batch, device, tracker)
                tracker.reset_peak()
                for _ in range(MEASURED_STEPS):
                    measured()
            peak = tracker.peak
            if self.time_steps and peak <= self.limit_bytes:  # timed outside the tracker (it slows small ops)
                tick = time.perf_counter()
                measured()
                step = round((time.perf_counter() - tick) / micro_steps, 6)  # one micro-step
        except torch.OutOfMemoryError as error:
            note = f"out of memory: {error}"
        measured = None  # type: ignore[assignment]  # the step let go of, and what it holds with it
        self.release(device, failed=note is not None)
        return self._result(micro_batch, peak, peak, step, started, note)


class CudaMeter(Meter):
    """Real trials on the GPU, measured by the caching allocator's own counters."""

    name = "cuda"

    def __init__(self, workload: Workload, budget_bytes: int | None, headroom: float, time_steps: bool = True,
                 cap: int | None = None):
        if not torch.cuda.is_available():
            raise UserError("`meter` cuda: torch sees no CUDA device here (use `meter` estimate or `meter` cpu)")
        self.cuda = torch.device("cuda", torch.cuda.current_device())
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.cuda)
        usable = free + torch.cuda.memory_reserved(self.cuda)
        if budget_bytes is None:
            budget_bytes = usable
        elif budget_bytes > usable:
            raise UserError(
                f"`memory`/`gpu`: {format_size(budget_bytes)} is more than this GPU has free "
                f"({format_size(usable)} of {format_size(total)}); use `meter` estimate to plan for a larger card"
            )
        super().__init__(workload, budget_bytes, headroom, time_steps, cap)
        self.device = f"cuda ({torch.cuda.get_device_name(self.cuda)}, {format_size(total)})"
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.cuda)
        context = total - free - torch.cuda.memory_reserved(self.cuda)
        self.context_bytes = context  # the CUDA context (and any other process): what the driver adds
        self.notes.append(
            f"cuda meter: peak = max_memory_reserved; the CUDA context and other processes use "
            f"{format_size(context)} outside the budget"
        )

    def close(self) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.cuda)
        torch.cuda.empty_cache()

    def release(self, device: torch.device, failed: bool) -> None:
        gc.collect()

    def measure(self, micro_batch: int) -> Measurement:
        self.prepare()
        started = time.perf_counter()
        reserved = allocated = step = note = None
        torch.cuda.empty_cache()
        try:
            measured, micro_steps = self.trial(micro_batch, self.cuda)
            torch.cuda.synchronize(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)
            tick = time.perf_counter()
            for _ in range(MEASURED_STEPS):
                measured()
            torch.cuda.synchronize(self.cuda)
            step = round((time.perf_counter() - tick) / (MEASURED_STEPS * micro_steps), 6)  # one micro-step
            reserved = int(torch.cuda.max_memory_reserved(self.cuda))
            allocated = int(torch.cuda.max_memory_allocated(self.cuda))
        except torch.OutOfMemoryError as error:
            note = f"out of memory: {str(error).splitlines()[0]}"
        measured = None  # type: ignore[assignment]  # the step let go of, and what it holds with it
        self.release(self.cuda, failed=note is not None)
        torch.cuda.empty_cache()
        return self._result(micro_batch, reserved, allocated, step if self.time_steps else None, started, note)


class EstimateMeter(Meter):
    """The training step on fake tensors, as CUDA runs it; with `sharding="fsdp"`, one rank's share of it."""

    name = "estimate"
    device = "estimate (fake tensors on the cpu device)"

    def __init__(self, workload: Workload, budget_bytes: int, headroom: float, gpu: Gpu | None = None,
                 cap: int | None = None, sharding: str = "none", world_size: int = 1,
                 capability: tuple[int, int] | None = None):
        super().__init__(workload, budget_bytes, headroom, time_steps=False, cap=cap)
        self.fixed = CUBLAS_WORKSPACE + (gpu.cublaslt_workspace if gpu is not None else 32 * MiB)
        if self.limit_bytes <= self.fixed:
            raise UserError(
                f"{format_size(budget_bytes)} less headroom leaves nothing once the estimate meter's "
                f"margin of {format_size(self.fixed)} (cuBLAS workspaces on a GPU) is taken off; "
                "use `meter` cpu for a budget this small", field="memory"
            )
        # the GPU whose kernels are counted: the catalog's, one given (bench/gpu_check.py: the card it runs on), or
        # without either an Ampere card (flash attention for bf16/fp16, the memory-efficient kernel for fp32)
        self.gpu = GpuKind(capability or (gpu.capability if gpu is not None else DEFAULT_CAPABILITY))
        self.sharding, self.world_size = sharding, world_size
        self._blocks: Blocks | None = None
        major, minor = self.gpu.capability
        where = gpu.title if gpu is not None and capability is None else (
            f"a GPU of compute capability {major}.{minor}" + ("" if capability else " (no --gpu given)"))
        self.notes.append(
            f"estimate meter: peak = (tracked tensors + {UNSEEN_ACTIVATIONS:.0%} of the activations) x "
            f"{1 + ESTIMATE_MARGIN:g} + {format_size(self.fixed)} (cuBLAS workspaces); attention kernels and their "
            f"backward workspaces, dropout masks and autocast dtypes as CUDA runs them on {where}"
        )
        if workload.recipe.model.activation_checkpointing:
            self.notes.append("activation checkpointing: each block keeps its input, and its recomputation in "
                              "backward is counted like any other op")
        if sharding == "fsdp":
            self.notes.append(
                f"fsdp over {world_size} ranks: parameters, gradients and optimizer state divided over the ranks, "
                "plus the root's and two blocks' parameters gathered in the compute dtype and one block's gradients"
                + ("; gradients reduce-scattered after every micro-batch (sharded gradients)"
                   if workload.recipe.batch.sharded_gradients else
                   "; within an accumulation window the whole model's gradients in fp32 (FSDP2 no_sync)")
                + ("; parameters, sharded gradients and optimizer state offloaded to CPU memory"
                   if workload.recipe.batch.offload == "cpu" else "")
            )

    def decided(self, tracked: int) -> int:
        return math.ceil(tracked * (1 + ESTIMATE_MARGIN)) + self.fixed

    def tensor_limit(self) -> int:
        """The most tracked tensor bytes whose decided peak stays within the limit."""
        return max(0, math.floor((self.limit_bytes - self.fixed) / (1 + ESTIMATE_MARGIN)))

    def blocks(self, model: nn.Module) -> Blocks:
        if self._blocks is None:
            self._blocks = model_blocks(model)
        return self._blocks

    def measure(self, micro_batch: int) -> Measurement:
        self.workload.prepare()
        started = time.perf_counter()
        inputs = self.window(micro_batch, torch.device("cpu"), torch.float32)
        recipe = self.workload.recipe
        model = build_on_meta(recipe, self.workload.data.info)
        blocks = self.blocks(model)
        master_bytes = next((p.element_size() for p in model.parameters()), 4)
        mixed = self.sharding == "fsdp" and recipe.precision != "fp32"
        if mixed:  # FSDP2's MixedPrecisionPolicy: forward and backward on parameters gathered in the compute dtype,
            model = model.to(torch.bfloat16 if recipe.precision == "bf16" else torch.float16)  # and no autocast
        result = run_fake_step(self.workload.plan, self.workload.data.info, inputs, self.gpu, model=model,
                               autocast=not mixed)
        # micro-batches accumulated before the reduction (FSDP2 no_sync), unless reduce-scattered one by one
        window = len(inputs) > 1 and not recipe.batch.sharded_gradients
        parts = step_parts(result, blocks, window, len(inputs) > 1)
        tracked = result.peak
        if self.sharding == "fsdp":
            step = result.step
            if mixed:
                step = mixed_precision_step(step, blocks, master_bytes, result.compute_bytes)
                parts["step"] = step.to_json()
            sharded = sharded_peak(step, blocks, self.world_size, result.compute_bytes, unsharded_window=window,
                                   offload=recipe.batch.offload == "cpu")
            parts["sharded"] = sharded.to_json()
            tracked = sharded.peak
        model = inputs = None
        return self._result(micro_batch, self.decided(tracked), tracked, None, started, None, parts)


def make_meter(kind: str, workload: Workload, budget: int | None, headroom: float, gpu: Gpu | None = None,
               cap: int | None = None, time_steps: bool = True, **sharding: Any) -> Meter:
    """A meter of `kind`: the estimate's counts for `gpu` (and `sharding`, `world_size`), the others time steps."""
    if kind == "estimate":
        return EstimateMeter(workload, budget, headroom, gpu=gpu, cap=cap, **sharding)  # type: ignore[arg-type]
    return {"cuda": CudaMeter, "cpu": CpuMeter}[kind](workload, budget, headroom, time_steps=time_steps, cap=cap)


def model_blocks(model: nn.Module) -> Blocks:
    """The units FSDP wraps (fake_step.block_sizes) and the parameters that train."""
    root, sizes = block_sizes(model)
    return Blocks(root=root, blocks=sizes, trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))


def step_parts(result: FakeStepResult, blocks: Blocks, window: bool, accumulates: bool) -> dict:
    """What a fake step's peak is made of, as a trial keeps it (`Measurement.parts`, in the probe's JSON)."""
    return {
        "at_peak": result.at_peak, "step": result.step.to_json(), "compute_bytes": result.compute_bytes,
        "blocks": {"root": blocks.root, "sizes": list(blocks.blocks), "trainable": blocks.trainable},
        "attention": result.kernels, "window": window, "accumulates": accumulates,
        "peak_stage": result.peak_stage, "loss_bytes": result.loss_bytes, "paged_bytes": result.paged_bytes,
        "optimizer": result.optimizer, "unseen_bytes": result.unseen_bytes,
    }


def fake_parts(meter: Meter, micro_batch: int) -> dict:
    """A cpu or cuda meter's step counted again by category on fake tensors (that meter stops at the budget)."""
    kind = GpuKind(torch.cuda.get_device_capability()) if meter.name == "cuda" else None
    info = meter.workload.data.info
    window = meter.window(micro_batch, torch.device("cpu"), torch.float32)
    model = build_on_meta(meter.workload.recipe, info)
    blocks = model_blocks(model)
    result = run_fake_step(meter.workload.plan, info, window, kind, model=model)
    return step_parts(result, blocks, len(window) > 1, len(window) > 1)


def sharding_meter(meter: Meter, gpu: Gpu | None, workload: Workload | None = None) -> EstimateMeter | None:
    """An estimate meter sharding over two ranks on `meter`'s budget and cap; None below the estimate's margin."""
    capability = torch.cuda.get_device_capability() if meter.name == "cuda" else None
    try:
        return EstimateMeter(workload or meter.workload, meter.budget_bytes, 1 - meter.limit_bytes / meter.budget_bytes,
                             gpu=gpu, cap=meter.cap, sharding="fsdp", world_size=2, capability=capability)
    except UserError:
        return None
