"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks, set up so that
accumulation stays the paper's large-batch update exactly:

- gradients reduce-scattered as a plain SUM (each loss is already divided by the window's global count). FSDP2
  averages by default; `set_gradient_divide_factor(1.0)` alone asks for NCCL's PREMUL_SUM, which gloo lacks, so
  `set_force_sum_reduction_for_comms(True)` too (torch's `_get_gradient_divide_factors`); a SUM also sidesteps
  gloo's AVG, which once summed silently (pytorch/pytorch#162338);
- reduction off for all but the window's last micro-batch (`set_requires_gradient_sync`, DDP's `no_sync`); with
  `batch.sharded_gradients` it stays on and FSDP2 sums into sharded gradients (ZeRO-2/3's accumulation);
- `batch.offload: cpu`: `CPUOffloadPolicy`; mixed precision by `MixedPrecisionPolicy` (gathered in bf16 / fp16,
  reduced and kept in fp32); BatchNorm running statistics follow rank 0, as DDP's buffer broadcast does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from .processes import SyncCounter, World

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded before the root: every block (`models.checkpointing.block_test`); none: the root alone."""
    from ...models.checkpointing import block_test

    is_block = block_test(model)
    return [m for m in model.modules() if m is not model and is_block(m)]


def shard(model: nn.Module, precision: str, world: World, device: torch.device, counter: SyncCounter,
          offload: bool = False) -> nn.Module:
    """`fully_shard` each unit, then the root, in place; `offload`: sharded state in (pinned) CPU memory."""
    mesh = init_device_mesh(device.type, (world.size,))
    compute = COMPUTE_DTYPES.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
    units = shard_units(model)
    for unit in reversed(units):  # innermost first: fully_shard needs a module's children sharded before it
        fully_shard(unit, mesh=mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=mesh, mp_policy=policy, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    _counted_module(model, units).set_all_reduce_hook(counter.fsdp_hook)
    _follow_rank_zero_batchnorm(model)
    return model


def _counted_module(model: nn.Module, units: list[nn.Module]) -> FSDPModule:
    """The FSDP module whose reduction runs once per synchronised backward: the root when it owns
    parameters outside the units, else the first unit with parameters."""
    in_units = {id(p) for unit in units for p in unit.parameters()}
    if any(id(p) not in in_units for p in model.parameters()):
        return model  # type: ignore[return-value]
    return next(unit for unit in units if any(True for _ in unit.parameters()))  # type: ignore[return-value]


def _follow_rank_zero_batchnorm(model: nn.Module) -> None:
    """After each training forward every rank takes rank 0's BatchNorm statistics
    (DDP's broadcast_buffers), so whichever rank saves or evaluates sees one set."""
    groups: dict[torch.dtype, list[tuple[nn.Module, str]]] = {}  # one broadcast per dtype: float stats, counts
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for name, buffer in module.named_buffers(recurse=False):
                groups.setdefault(buffer.dtype, []).append((module, name))
    if not groups:
        return

    def broadcast(root: nn.Module, inputs, output) -> None:
        if not root.training:
            return
        with torch.no_grad():
            for group in groups.values():
                flat = torch.cat([getattr(module, name).reshape(-1) for module, name in group])
                dist.broadcast(flat, src=0)
                offset = 0
                for module, name in group:
                    old = getattr(module, name)
                    # a new tensor rather than an in-place copy: autograd saved the old one for BatchNorm's backward
                    setattr(module, name, flat[offset:offset + old.numel()].view_as(old).clone())
                    offset += old.numel()

    model.register_forward_hook(broadcast)
