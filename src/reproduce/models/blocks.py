"""The units a model is sharded by: each transformer block or residual block, wrapped by FSDP one by one.

`fsdp_blocks(model)` returns the modules `fully_shard` is applied to before the root: a Hugging Face
model's own `_no_split_modules` classes (GPT2Block, LlamaDecoderLayer, ViTLayer, ...: the classes
Accelerate wraps by default), otherwise the members of every `nn.ModuleList` / `nn.Sequential` made of
two or more modules of one class that hold parameters (the small GPT's blocks, torchvision ResNet's
Bottlenecks), outermost first. Everything else (embeddings, final norm, head, stem) stays in the root.
The estimate meter counts what these units gather (probe/sharding.py); the FSDP run wraps the same ones.
"""

from __future__ import annotations

from torch import nn


def _hf_block_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of `model`, outermost first, none inside another."""
    classes = _hf_block_classes(model)
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if classes:
            if type(module).__name__ in classes and module is not model and _has_parameters(module):
                blocks.append(module)
                return
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            members = [m for m in module.children() if _has_parameters(m)]
            if len(members) >= 2 and len({type(m) for m in members}) == 1:
                blocks.extend(members)
                return
        for child in module.children():
            visit(child)

    visit(model)
    return blocks


def block_sizes(model: nn.Module) -> tuple[int, tuple[int, ...]]:
    """(parameters in no block, parameters of each block), counting a shared parameter once."""
    counted: set[int] = set()
    sizes = []
    for block in fsdp_blocks(model):
        size = 0
        for param in block.parameters():
            if id(param) not in counted:
                counted.add(id(param))
                size += param.numel()
        sizes.append(size)
    root = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    return root, tuple(sizes)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
