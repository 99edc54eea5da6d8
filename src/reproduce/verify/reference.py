"""The one-pass reference of `verify`: the large batch's gradient, the mean loss over all the samples, in one pass
when its activations fit half the free memory, else in large chunks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data.batches import to_device
from ..data.loader import fetch_seeded
from ..plan.units import available_host_memory
from ..train.setup import Setup

MEMORY_FRACTION = 0.5  # of the free memory, for the one-pass reference's activations


def one_pass_reference(setup: Setup, train_set: Any, indices: list[torch.Tensor], seed: int, chunk: int | None,
                       parameters: list[nn.Parameter], notes: list[str]) -> tuple[list[torch.Tensor], int, int]:
    """The reference gradient of the samples `indices` hold, the samples a pass takes and the passes."""
    total_samples = sum(len(i) for i in indices)
    if chunk is None:
        chunk = reference_chunk(setup, fetch_seeded(train_set, indices[0], seed), len(indices[0]), total_samples,
                                parameters)
    chunk = max(1, min(chunk, total_samples))
    pieces = list(torch.split(torch.cat(indices), chunk))
    if len(pieces) > 1:
        notes.append(
            f"one pass over {total_samples} samples would not fit in half the free memory: the reference is "
            f"computed in {len(pieces)} chunks of up to {chunk}"
        )
    chunks = [to_device(fetch_seeded(train_set, i, seed), setup.device, setup.dtype) for i in pieces]
    return reference_gradient(setup, chunks), chunk, len(pieces)


def copy_gradients(parameters: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]


def saved_bytes(setup: Setup, inputs: Any, target: Any) -> int:
    """Bytes autograd keeps for the backward pass of one forward on (inputs, target): activation memory."""
    total, seen = 0, set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), setup.autocast():
        setup.loss(setup.model(inputs), target)
    return total


def reference_chunk(setup: Setup, first: tuple, micro: int, total: int, parameters: list[nn.Parameter]) -> int:
    """Samples per reference pass: all of them when their activations fit half the free memory, else fewer."""
    device = setup.device  # bytes free for tensors there (the CPU: MemAvailable), or None when unknown
    free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else available_host_memory()
    if free is None:
        return total
    inputs, target = to_device(first, setup.device, setup.dtype)
    per_sample = saved_bytes(setup, inputs, target) / max(micro, 1)
    weights = 3 * sum(p.numel() * p.element_size() for p in parameters)  # weights, gradients, the recorded copy
    budget = MEMORY_FRACTION * free - weights
    if per_sample <= 0 or per_sample * total <= budget:
        return total
    fits = int(budget // per_sample)
    return max(micro, fits // micro * micro)


def reference_gradient(setup: Setup, chunks: list[tuple[Any, Any]]) -> list[torch.Tensor]:
    """d/dw of (summed loss over every chunk) / (loss-bearing items over every chunk): the large batch's mean loss."""
    model, loss_fn = setup.model, setup.loss
    count = max(sum(loss_fn.count(target) for _, target in chunks), 1)
    if getattr(loss_fn, "window", None) is not None:  # BERT's two terms: masked tokens and sequences
        loss_fn.window(count, sum(len(target) for _, target in chunks))
    model.zero_grad(set_to_none=True)
    for inputs, target in chunks:
        with setup.autocast():
            loss = loss_fn(model(inputs), target) / count
        loss.backward()
    clip = setup.plan.recipe.clip_grad_norm
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    gradients = copy_gradients(setup.optimizer.param_groups[0]["params"])
    model.zero_grad(set_to_none=True)
    return gradients

