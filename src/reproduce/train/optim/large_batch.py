"""LARS and LAMB, the layer-wise adaptive optimizers of the large-batch papers, from their algorithms.

Every parameter tensor is a "layer" with its own trust ratio, from the whole tensor's norms.
- `LARS`: You, Gitman and Ginsburg 2017 (arXiv 1708.03888), Algorithm 1: local_lr = trust_coefficient x ||w|| /
  (||g|| + weight_decay x ||w||), v = momentum x v + lr x local_lr x (g + weight_decay x w), w = w - v.
- `LAMB`: You et al. 2019 (arXiv 1904.00962), Algorithm 2: Adam's bias-corrected moments, r = m_hat / (sqrt(v_hat)
  + eps), u = r + weight_decay x w, w = w - lr x (||w|| / ||u||) x u.
The ratio is 1 when either norm is 0, and for a group with `layer_adaptation: False` (the recipe's `no_decay`
parameters), which also gets no weight decay, as both papers' official implementations do (TensorFlow's
LARSOptimizer `skip_list`; tensorflow_addons' lamb.py `exclude_from_weight_decay`). Under FSDP2 the update runs
on the local shards and the norms are the whole tensor's (DTensor's own norm).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

LARS_TRUST_COEFFICIENT = 0.001  # eta in You et al. 2017, Algorithm 1 (TensorFlow's LARSOptimizer default `eeta`)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # torch.distributed.tensor takes ~1.5 s to import: a tensor can only be a DTensor once something imported it
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds (itself unless it is a DTensor shard); in-place updates reach it."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def whole_norm(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The 2-norm of the whole tensor whose local part is `local`, sharded as `like` is (all shards under FSDP2)."""
    if not _is_dtensor(like):
        return torch.linalg.vector_norm(local)
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                               stride=like.stride())
    return torch.linalg.vector_norm(whole).full_tensor()


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor, w_norm: torch.Tensor, other_norm: torch.Tensor):
    """numerator / denominator, or 1 when either norm is 0 (a tensor on the device: no synchronisation)."""
    usable = (w_norm > 0) & (other_norm > 0)
    return torch.where(usable, numerator / torch.where(usable, denominator, 1.0), 1.0)


class _LayerWise(torch.optim.Optimizer):
    """What LARS and LAMB share: each parameter with a gradient takes the subclass's `update`, on its local part."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay = group["weight_decay"] if group["layer_adaptation"] else 0.0
            for param in group["params"]:
                if param.grad is not None:
                    weight = _local(param)
                    weight.sub_(self.update(group, param, weight, _local(param.grad), decay))
        return loss


class LARS(_LayerWise):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017, Algorithm 1), heavy-ball momentum. Group options: lr,
    momentum, weight_decay, trust_coefficient, layer_adaptation."""

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 trust_coefficient: float = LARS_TRUST_COEFFICIENT, layer_adaptation: bool = True):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        layer_adaptation=layer_adaptation)
        super().__init__(params, defaults)

    def update(self, group: dict, param: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
               decay: float) -> torch.Tensor:
        lr, momentum = group["lr"], group["momentum"]
        if group["layer_adaptation"]:
            w_norm, g_norm = whole_norm(weight, param), whole_norm(grad, param.grad)
            local_lr = _ratio(group["trust_coefficient"] * w_norm, g_norm + decay * w_norm, w_norm, g_norm)
            step = (grad + decay * weight) * (lr * local_lr)
        else:
            step = grad * lr
        if momentum:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)  # a DTensor for a DTensor parameter
            step = _local(state["momentum_buffer"]).mul_(momentum).add_(step)
        return step


class LAMB(_LayerWise):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019, Algorithm 2). Group options: lr, betas,
    eps, weight_decay, layer_adaptation."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, layer_adaptation: bool = True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, layer_adaptation=layer_adaptation)
        super().__init__(params, defaults)

    def update(self, group: dict, param: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
               decay: float) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m_hat = exp_avg / (1 - beta1 ** state["step"])
        v_hat = exp_avg_sq / (1 - beta2 ** state["step"])
        update = m_hat / (v_hat.sqrt() + group["eps"])
        if decay:
            update = update + decay * weight
        if group["layer_adaptation"]:
            w_norm, u_norm = whole_norm(weight, param), whole_norm(update, param)
            return update * (group["lr"] * _ratio(w_norm, u_norm, w_norm, u_norm))
        return update * group["lr"]
