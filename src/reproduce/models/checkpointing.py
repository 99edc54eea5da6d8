"""What a step keeps of its activations, set on the model's instance (module tree and state dict unchanged).

`model.activation_checkpointing`: each block keeps only its input, and backward recomputes it (transformers' own
gradient checkpointing, else `torch.utils.checkpoint` per block, or per weight layer for the MLP and CNN).
`model.offload_activations`: what forward saves goes to CPU memory and back (parameters stay, as in torchtune).
`model.loss_chunks`: the head becomes the identity and train/losses.py applies it chunk by chunk.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UserError
from .small import MLP, Block, SmallCNN

WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def enable(model: nn.Module, name: str, selective: bool = False) -> int:
    """Checkpoint `model` per block (`selective`: keeping matmuls' and attention's outputs); the number of blocks."""
    pretrained = _transformers_models(model)
    # transformers' layers call torch.utils.checkpoint.checkpoint with these (its default preserves the RNG state)
    kwargs = {"use_reentrant": False, "context_fn": lambda: contexts(selective=selective)}
    for module in model.modules():
        module.selective_checkpoint = selective
    if pretrained:
        count = 0
        for inner in pretrained:
            if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            count += sum(1 for m in inner.modules() if getattr(m, "gradient_checkpointing", False))
        if count:
            return count
    blocks = checkpoint_blocks(model)
    if blocks:
        for block in blocks:
            block.forward = types.MethodType(_checkpointed_forward, block)
        return len(blocks)
    # the built-in models without blocks: per layer (a factory's must declare them)
    layered = [m for owner in model.modules() if isinstance(owner, (MLP, SmallCNN)) for m in owner.modules()
               if _layered(m)]
    if layered:
        for sequence in layered:
            sequence.forward = types.MethodType(_segmented_forward, sequence)
        return sum(len(_segments(sequence)) for sequence in layered)
    raise UserError(
        f"model.activation_checkpointing: {name} has no blocks to checkpoint ({type(model).__name__}: no transformer "
        "or residual blocks, and none declared); declare its blocks as Hugging Face models do: a class "
        "attribute `_no_split_modules = [\"MyBlock\"]` naming the block classes, or set activation_checkpointing: "
        "false"
    )


def check_checkpointable(recipe) -> None:
    """One line when the recipe's model (built on the meta device) has nothing to checkpoint."""
    if not recipe.model.activation_checkpointing or recipe.model.hf is not None:  # (hf: loaded from disk)
        return
    from . import build_on_meta

    build_on_meta(recipe)


def enabled(model: nn.Module) -> bool:
    return any(
        getattr(m, "gradient_checkpointing", False)
        or getattr(getattr(m, "forward", None), "__func__", None) in (_checkpointed_forward, _segmented_forward)
        for m in model.modules()
    )


def block_test(model: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether a module of `model` is a block: Hugging Face's `_no_split_modules` classes, the built-in GPT's
    `Block`, torchvision's `Bottleneck` / `BasicBlock` (what FSDP shards, and what is checkpointed)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    types_: tuple[type, ...] = (Block,)
    resnet = sys.modules.get("torchvision.models.resnet")  # only when the model came from torchvision
    if resnet is not None:
        types_ += (resnet.Bottleneck, resnet.BasicBlock)
    return lambda module: isinstance(module, types_) or type(module).__name__ in names


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost blocks of `model` (a block inside a block is recomputed with it), torchvision ViT's too."""
    is_block = block_test(model)
    vit = sys.modules.get("torchvision.models.vision_transformer")
    encoder = (vit.EncoderBlock,) if vit is not None else ()
    return _outermost(model, lambda child: is_block(child) or isinstance(child, encoder))


def _outermost(module: nn.Module, matches: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The outermost modules below `module` that match, in order."""
    found: list[nn.Module] = []
    for child in module.children():
        found += [child] if matches(child) else _outermost(child, matches)
    return found


def _transformers_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers `PreTrainedModel`s in `model` (HFLogits holds one; peft wraps one)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return []

    def matches(module: nn.Module) -> bool:
        return isinstance(module, modeling.PreTrainedModel) and module.supports_gradient_checkpointing

    return [model] if matches(model) else _outermost(model, matches)


@contextlib.contextmanager
def _recomputing(module: nn.Module) -> Iterator[None]:
    """Around a recomputation: BatchNorm's running statistics stay as forward left them (momentum 0 keeps them
    exactly, the batch count is put back), so they are updated once per step."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(norm.momentum, None if norm.num_batches_tracked is None else norm.num_batches_tracked.clone())
             for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, (momentum, count) in zip(norms, saved, strict=True):
                norm.momentum = momentum
                if count is not None:
                    norm.num_batches_tracked.copy_(count)


def _matmuls_saved(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy (torchtitan's): keep matmuls' and attention's outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _saved_ops() -> frozenset:
    """The operators `_matmuls_saved` keeps, looked up once (the policy is asked at every operator of a block)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


def contexts(module: nn.Module | None = None, selective: bool = False
             ) -> tuple[contextlib.AbstractContextManager, ...]:
    """`checkpoint`'s context_fn: the recomputation under `_recomputing` and forward's torch function modes (the same
    kernels: probe/gpu_like.py); `selective`: PyTorch's selective checkpointing contexts around both."""
    modes = list(torch.overrides._get_current_function_mode_stack())
    selective = selective or bool(getattr(module, "selective_checkpoint", False))

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            active = torch.overrides._get_current_function_mode_stack()
            for mode in modes:
                if not any(mode is other for other in active):
                    stack.enter_context(mode)
            if module is not None:
                stack.enter_context(_recomputing(module))
            if selective:
                stack.enter_context(recompute_ops)
            yield

    if not selective:
        return contextlib.nullcontext(), recomputing()
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward_ops, recompute_ops = create_selective_checkpoint_contexts(_matmuls_saved)
    return forward_ops, recomputing()


def _run(module: nn.Module, function, *args, **kwargs):
    if not (module.training and torch.is_grad_enabled()):
        return function(*args, **kwargs)  # evaluation, or no_grad: nothing to save
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: contexts(module), **kwargs)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    return _run(self, type(self).forward.__get__(self), *args, **kwargs)


def _layered(module: nn.Module) -> bool:
    """An nn.Sequential of plain layers with two weight layers or more to cut it at."""
    return isinstance(module, nn.Sequential) and sum(isinstance(m, WEIGHT_LAYERS) for m in module) >= 2 and all(
        not any(True for _ in layer.children()) for layer in module)


def _segments(sequence: nn.Sequential) -> list[list[nn.Module]]:
    """The layers of `sequence` cut before each weight layer: [Linear, ReLU, Dropout], [Linear, ReLU], ..."""
    segments: list[list[nn.Module]] = []
    for layer in sequence:
        if not segments or isinstance(layer, WEIGHT_LAYERS):
            segments.append([])
        segments[-1].append(layer)
    return segments


def _segmented_forward(self: nn.Sequential, x):
    for segment in _segments(self):
        holder = nn.Sequential(*segment)  # not registered: the layers keep their place (and names) in `self`
        holder.training = self.training
        x = _run(holder, holder.forward, x)
    return x


# ---- model.offload_activations --------------------------------------------------------------------------------------

_HOST = ["cpu"]  # where saved activations go: CPU memory; the estimate meter's stand-in for it is "meta"


@contextlib.contextmanager
def host(device: str) -> Iterator[None]:
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


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        return type(self).forward(self, *args, **kwargs)


def offload_activations(model: nn.Module) -> nn.Module:
    model.forward = types.MethodType(_offloaded_forward, model)
    return model


# ---- model.loss_chunks ----------------------------------------------------------------------------------------------

HEAD_NAMES = ("lm_head", "head")


def _passes_through(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def defer_head(model: nn.Module, name: str) -> nn.Linear:
    """Make `model` return the head's input; the head, whose weight the loss then uses."""
    found = [(path, module) for path, module in model.named_modules() if path.rsplit(".", 1)[-1] in HEAD_NAMES]
    if not found:
        raise UserError(f"model.loss_chunks: {name} has no output head named {' or '.join(HEAD_NAMES)} (the linear "
                        "layer that makes the logits); leave loss_chunks out for this model")
    path, head = found[-1]
    if type(head) is not nn.Linear:
        raise UserError(f"model.loss_chunks: {name}'s {path} is a {type(head).__name__}, not a plain nn.Linear (LoRA "
                        "or a quantised layer on the head): leave loss_chunks out, or the head out of lora")
    head.forward = types.MethodType(_passes_through, head)
    head.deferred_to_loss = True
    return head


def deferred_head(model: nn.Module) -> nn.Linear | None:
    return next((m for m in model.modules() if getattr(m, "deferred_to_loss", False)), None)
