"""One training step on fake tensors, its memory counted by category: what the estimate meter measures.

The model is built on `meta` and materialised in `FakeTensorMode`; the optimizer is the recipe's
(`optimizer.implementation`, else `foreach=True` as on a GPU). The step is the trainer's (a window of micro-batches,
precision, clipping, optimizer step, `zero_grad(set_to_none=True)`) after a warm-up step that makes the optimizer
state. With a `GpuKind` it runs as CUDA would (gpu_like.py, with `UNSEEN_ACTIVATIONS`: `tracker.ALLOWANCE` in
`at_peak`); without, as the CPU does (equal to real CPU tensors). `StepMemory` keeps the most each category held,
`at_peak` what each held at the peak.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..models import build_on_meta
from ..models.checkpointing import host
from ..models.quantize import materialize_quantized, quantized_states
from ..plan.planner import Plan
from ..train.losses import build_loss
from ..train.optim.optimizers import build_optimizer
from .gpu_like import UNSEEN_ACTIVATIONS, GpuKind, as_on_gpu, kernel_workspaces
from .sharded_memory import StepMemory
from .tracker import ACTIVATIONS, GRADIENTS, OPTIMIZER, WEIGHT_COPIES, WEIGHTS, MemoryTracker, rounded

STEP = "optimizer step"  # the phase (and category) of clipping and the optimizer's own temporaries
MEASURED_STEPS = 1


@dataclass
class FakeStepResult:
    peak: int  # the most tensor bytes live at once in the measured step
    at_peak: dict[str, int]  # by category at that moment (sums to `peak`)
    step: StepMemory
    compute_bytes: int  # bytes per element of the compute dtype (what FSDP gathers parameters in)
    kernels: dict[str, int] = field(default_factory=dict)  # attention calls by the kernel counted
    peak_stage: str = "forward"  # forward, backward or optimizer step: where `peak` was reached
    loss_bytes: int = 0  # the most the logits and the loss computed from them held at once (part of activations)
    paged_bytes: int = 0  # optimizer state in bitsandbytes' paged (CUDA unified) memory: outside PyTorch's allocator
    optimizer: str = ""  # the optimizer's class and kernels, as the step ran it
    unseen_bytes: int = 0  # of `step.activations`: the allowance for what no operator returns (GPU rules only)


def run_fake_step(plan: Plan, data_info: dict | None, window: list, gpu: GpuKind | None,
                  model: nn.Module | None = None, autocast: bool = True) -> FakeStepResult:
    """A warm-up step, then the measured one, over `window` (micro-batches of real tensors, made fake here).
    `model`: built on the meta device (here when None); `autocast=False`: the bf16/fp16 precision is the parameters'
    own dtype instead (FSDP's mixed precision, which `reproduce run` uses without autocast)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    recipe = plan.recipe
    if model is None:
        model = build_on_meta(recipe, data_info)
    tracker = MemoryTracker()
    allowance = UNSEEN_ACTIVATIONS if gpu is not None else 0.0  # what a CUDA step allocates that no operator returns
    if gpu is not None:
        tracker.workspaces = kernel_workspaces()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    semantics = as_on_gpu(gpu) if gpu is not None else contextlib.nullcontext()
    # offloaded activations leave the (stand-in) GPU: for the meta device, as a GPU's go to CPU memory
    offloaded_to = host("meta") if gpu is not None else contextlib.nullcontext()
    hooks = []
    packed = any(isinstance(inputs, dict) and "position_ids" in inputs for inputs, _ in window)  # data.packing packed
    with contextlib.nullcontext() if packed else unpacked_sequences(), fake, tracker, semantics as kernels, \
            offloaded_to:
        tracker.phase = WEIGHTS
        materialize(model, torch.device("cpu"))
        tracker.phase = ACTIVATIONS
        buffers = sum(rounded(b.untyped_storage().nbytes()) for b in model.buffers())
        with unset_fake_temporarily():  # bitsandbytes' 8-bit optimizers build their quantisation maps from values
            optimizer = build_optimizer(plan, model)  # (`.tolist()`): real, tiny (256 floats), made here
        if recipe.optimizer.implementation is None and gpu is not None:  # PyTorch's choice on a GPU, which fake
            # tensors would not make (with the CPU's rules, its own choice: one parameter at a time)
            for group in optimizer.param_groups:
                if "foreach" in group:
                    group["foreach"] = True
        hooks.extend(param.register_post_accumulate_grad_hook(lambda p: tracker.retag([p.grad], GRADIENTS))
                     for param in model.parameters() if param.requires_grad)
        # packed: the position ids stay real, so the varlen attention (models/varlen.py) cuts each row at its
        # samples as the run does (fake tensors have no values to read)
        fake_window = [(({k: v if k == "position_ids" else fake.from_tensor(v) for k, v in inputs.items()}
                         if isinstance(inputs, dict) else tree_map_only(torch.Tensor, fake.from_tensor, inputs)),
                        tree_map_only(torch.Tensor, fake.from_tensor, targets)) for inputs, targets in window]
        tracker.charge(fake_window, ACTIVATIONS)
        loss = build_loss(recipe, model)
        for step in range(1 + MEASURED_STEPS):
            if step == 1:
                tracker.allowance = allowance
                tracker.reset_peak()
            precision = recipe.precision if autocast else "fp32"
            fake_step(model, optimizer, loss, fake_window, precision, recipe.clip_grad_norm, tracker)
            if step == 0:
                tracker.retag([t for state in optimizer.state.values() for t in state.values()
                               if isinstance(t, torch.Tensor)], OPTIMIZER)
                paged = paged_bytes(optimizer) if recipe.optimizer.paged else 0
        for hook in hooks:
            hook.remove()
        activations = tracker.most(ACTIVATIONS, ACTIVATIONS)
        unseen = math.ceil(allowance * activations)
        memory = StepMemory(
            weights=tracker.live_by.get(WEIGHTS, 0),
            buffers=buffers,
            gradients=tracker.most(GRADIENTS),
            optimizer_state=tracker.live_by.get(OPTIMIZER, 0),
            activations=activations + unseen,
            weight_copies=tracker.most(WEIGHT_COPIES),
            step_temporaries=tracker.most(STEP, STEP),
            gradients_at_activation_peak=tracker.when_most.get((ACTIVATIONS, ACTIVATIONS), {}).get(GRADIENTS, 0),
            activations_at_gradient_peak=math.ceil((1 + allowance) * max(
                (when.get(ACTIVATIONS, 0) for (phase, name), when in tracker.when_most.items()
                 if name == GRADIENTS and phase == ACTIVATIONS), default=0)),
        )
        compute = 2 if recipe.precision in ("bf16", "fp16") else next(  # what FSDP gathers parameters in
            (p.element_size() for p in model.parameters()), 4)
    at_peak = {name: size for name, size in tracker.peak_by.items() if size}
    return FakeStepResult(tracker.peak, at_peak, memory, compute, dict(getattr(kernels, "kernels", {}) or {}),
                          peak_stage=tracker.peak_stage, loss_bytes=tracker.marked_most, paged_bytes=paged,
                          optimizer=optimizer_kernels(optimizer), unseen_bytes=unseen)


PAGED_MIN = 100_000  # bitsandbytes pages the state of tensors of at least 1e5 elements (`get_state_buffer`)


def paged_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The state a bitsandbytes paged optimizer keeps in CUDA unified memory (cudaMallocManaged, which PyTorch's
    allocator never sees): each moment of a parameter of at least 1e5 elements."""
    return sum(rounded(value.untyped_storage().nbytes()) for param, state in optimizer.state.items()
               if param.numel() >= PAGED_MIN for value in state.values()
               if isinstance(value, torch.Tensor) and value.numel() == param.numel())


def optimizer_kernels(optimizer: torch.optim.Optimizer) -> str:
    """Which optimizer stepped and how: torch.optim's foreach, fused or one parameter at a time, or bitsandbytes'."""
    kind = type(optimizer)
    if not kind.__module__.startswith("torch.optim"):
        return f"{kind.__module__.split('.')[0]} {kind.__name__} (its own kernels, one parameter at a time)"
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    how = ("fused (one kernel a parameter group; no temporaries the size of the parameters)" if group.get("fused")
           else "foreach (temporaries the size of every parameter at once)" if group.get("foreach")
           else "for-loop (one parameter at a time)")
    return f"torch.optim.{kind.__name__}, {how}"


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Let Hugging Face models see that the probe's rows are not packed: without a mask, transformers
    (masking_utils) reads the position ids, which fake tensors lack, and would build a B x S x S mask instead of
    passing `is_causal=True` to SDPA. Only `data.packing: packed` rows pack (left to transformers)."""
    masking_utils = sys.modules.get("transformers.masking_utils")  # loaded by any Hugging Face model
    if masking_utils is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def block_sizes(model: nn.Module) -> tuple[int, tuple[int, ...]]:
    """(parameters in no unit, parameters of each unit) for the units FSDP wraps one by one (`reproduce run`'s own
    choice, `train.distributed.fsdp.shard_units`: transformer blocks, residual blocks); a unit's own parameters,
    not those of a unit inside it (sharded first), and a shared parameter once."""
    from ..train.distributed.fsdp import shard_units

    counted: set[int] = set()
    sizes = []
    for unit in reversed(shard_units(model)):  # innermost first, as fully_shard is applied
        size = 0
        for param in unit.parameters():
            if id(param) not in counted:
                counted.add(id(param))
                size += param.numel()
        sizes.append(size)
    root = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    return root, tuple(reversed(sizes))


def fake_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, window: list, precision: str,
              clip: float | None, tracker: MemoryTracker) -> None:
    """The trainer's step (`optimizer_step`) without what fake tensors cannot do (read values)."""
    count = sum(len(target) for _, target in window)
    if getattr(loss_fn, "window", None) is not None:  # a loss of several counted terms (BERT): fake tensors hold no
        loss_fn.window(count, count)  # counts to read, and the terms' weights change no memory
    for inputs, target in window:
        autocast = contextlib.nullcontext()
        if precision != "fp32":
            autocast = torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
        with autocast:
            output = model(inputs)
            tracker.mark([output])  # the logits and what the loss computes from them, counted apart too
            tracker.marking = True
            loss = loss_fn(output, target) / max(1, count)
            tracker.marking = False
            output = None
        loss.backward()
    tracker.phase = STEP
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker.phase = ACTIVATIONS


def materialize(model: nn.Module, device: torch.device) -> None:
    """`to_empty` on a meta model, keeping tied parameters tied (`to_empty` alone would untie them)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    quantized = quantized_states(model)  # a quantised base's scales, outside parameters and buffers
    model.to_empty(device=device)
    for shared in owners.values():
        first, name = shared[0]
        for module, other in shared[1:]:
            module._parameters[other] = first._parameters[name]
    materialize_quantized(quantized, device)
