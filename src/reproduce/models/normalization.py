"""BatchNorm when the micro-batch is smaller than the paper's BN batch: `model.batchnorm: keep | sync | frozen | group`.

Accumulation makes the gradient of a window the large batch's, but BatchNorm normalises each micro-batch with that
micro-batch's own mean and variance: the one thing accumulation cannot make exact. The field's answers
(MMSegmentation, Detectron2), each a choice the plan prints with its cost:

- `keep`: BatchNorm as the model has it, statistics over each micro-batch of one process.
- `sync`: `torch.nn.SyncBatchNorm`, statistics over the micro-batches of all processes (BN batch = micro-batch x
  processes). PyTorch runs it on CUDA only; `train/setup.py` converts the model after placing it, under several
  processes.
- `frozen`: torchvision's `FrozenBatchNorm2d`, the running statistics and affine parameters fixed (Detectron2's
  practice when fine-tuning a pretrained backbone): no batch statistics at all, so no BN batch; with random
  weights it normalises by mean 0 and variance 1, which is meaningless (the plan warns).
- `group`: GroupNorm (Wu & He 2018, arXiv 1803.08494) in place of every BatchNorm, 32 groups (their default,
  sec. 4) or the largest divisor of the channels below it: independent of the batch, a deviation from the paper.
"""

from __future__ import annotations

import math

import torch
from torch import nn

BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)
GROUPS = 32  # Wu & He 2018, sec. 4: "we use G = 32 by default"


def frozen_norm(channels: int) -> nn.Module:
    from torchvision.ops.misc import FrozenBatchNorm2d

    return FrozenBatchNorm2d(channels)


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm over `channels` in 32 groups (or the largest number of groups up to 32 that divides them)."""
    return nn.GroupNorm(math.gcd(GROUPS, channels), channels)


NORM_LAYERS = {"frozen": frozen_norm, "group": group_norm}  # a torchvision `norm_layer=` for each conversion


def is_batchnorm(module: nn.Module) -> bool:
    """A BatchNorm that normalises by batch statistics in training (torchvision's FrozenBatchNorm2d is not one)."""
    return isinstance(module, BATCHNORM_TYPES)


def count_batchnorm(model: nn.Module) -> int:
    """The BatchNorm layers of `model` (any dimension, SyncBatchNorm included)."""
    return sum(1 for module in model.modules() if is_batchnorm(module))


def convert(model: nn.Module, mode: str) -> nn.Module:
    """`model` with every BatchNorm replaced for `mode` ("frozen", "group"); "keep" and "sync" return it unchanged
    (sync is converted once the processes exist: `to_sync`). A frozen BN takes the BatchNorm's affine parameters and
    running statistics; a GroupNorm starts as torchvision initialises one (weight 1, bias 0), as a BatchNorm does."""
    if mode not in NORM_LAYERS:
        return model
    if is_batchnorm(model):
        return _replacement(model, mode)
    for name, child in model.named_children():
        converted = convert(child, mode)
        if converted is not child:
            setattr(model, name, converted)
    return model


def _replacement(norm: nn.modules.batchnorm._BatchNorm, mode: str) -> nn.Module:
    new = NORM_LAYERS[mode](norm.num_features)
    if mode == "frozen":
        new.eps = norm.eps
        with torch.no_grad():
            if norm.affine:
                new.weight.copy_(norm.weight)
                new.bias.copy_(norm.bias)
            if norm.track_running_stats:
                new.running_mean.copy_(norm.running_mean)
                new.running_var.copy_(norm.running_var)
    device = next(iter(norm.parameters()), next(iter(norm.buffers()), None))
    if device is not None:
        new = new.to(device=device.device, dtype=device.dtype)
    return new


def to_sync(model: nn.Module) -> nn.Module:
    """Every BatchNorm as `torch.nn.SyncBatchNorm` (statistics over all processes of the default group)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def set_momentum(model: nn.Module, momentum: float) -> None:
    """Every BatchNorm's running-statistics momentum (PyTorch's: new = (1 - m) x old + m x batch; TensorFlow's decay
    is 1 - m)."""
    for module in model.modules():
        if is_batchnorm(module):
            module.momentum = momentum
