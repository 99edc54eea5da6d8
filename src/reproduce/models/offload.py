"""Activation offloading (`model.offload_activations: true`): what the model's forward saves for backward is copied
to CPU memory as it is saved and copied back when backward needs it, exact (a copy and its copy back are the same
numbers). PyTorch's `torch.autograd.graph.saved_tensors_hooks`, as `save_on_cpu` does, but parameters stay where they
are (they live on the device anyway; `save_on_cpu` would copy every weight out and back), as torchtune's
OffloadActivations skips them too. Applied around the model's forward (the instance's, as checkpointing does), so
the loss's own saved tensors stay on the device. Copies are synchronous here: less memory, slower steps (the PCIe
copies are not overlapped with compute as torchtune's streams do).

On a CPU run there is nothing to move (the activations are already in CPU memory) and the hooks keep every tensor.
The estimate meter runs on the cpu device standing for a GPU: under `host("meta")` a saved tensor leaves it (only its
shape is kept: fake tensors have no values) and an empty one of that shape comes back in backward, which the
tracker then counts as a GPU would hold it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_HOST = ["cpu"]  # where saved activations go: CPU memory; the estimate meter's stand-in for it is "meta"


@contextlib.contextmanager
def host(device: str) -> Iterator[None]:
    """Send saved activations to `device` instead of the CPU while inside (the estimate meter: "meta")."""
    _HOST.append(device)
    try:
        yield
    finally:
        _HOST.pop()


def _pack(tensor: torch.Tensor) -> Any:
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.device.type == _HOST[-1]:
        return tensor  # a weight (or a view of one, such as its transpose) stays: it is on the device anyway
    if _HOST[-1] == "meta":  # the estimate: fake tensors have no values to keep, only what backward will allocate
        return tensor.device, tensor.shape, tensor.stride(), tensor.dtype
    return tensor.device, tensor.to(_HOST[-1])


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    if len(packed) == 4:
        device, shape, stride, dtype = packed
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    device, tensor = packed
    return tensor.to(device)


def offloaded() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with offloaded():
        return type(self).forward(self, *args, **kwargs)


def offload_activations(model: nn.Module) -> nn.Module:
    """`model` whose forward saves its activations in CPU memory (the module tree unchanged)."""
    model.forward = types.MethodType(_offloaded_forward, model)
    return model
