"""How a model's weights are stored and which of them train: `model.dtype` and `model.lora` (through peft).

`model.dtype: bf16` (or fp16) stores the weights in that dtype, as fine-tuning recipes load a base model. A
transformers model gets the dtypes `from_pretrained(..., dtype=...)` gives it (`in_dtype`): its parameters in that
dtype but those its class keeps in float32 (`_keep_in_fp32_modules`), its buffers as the class builds them: the
rotary embedding's `inv_freq` stays float32 (`model.to(bf16)` would round it: an angle error of about 2.5 rad at
position 2047 for LLaMA-7B's frequencies), BERT's position ids int64. Any other model is cast whole (`model.to`);
`model.lora` freezes them and adds low-rank adapters (peft's `get_peft_model`), which peft keeps in float32
(`model.lora.dtype: bf16` casts them, as QLoRA does);
`model.quantize` stores the frozen linear layers in int8 or nf4 first (models/quantize.py).
The optimizer sees only what trains (`train/optim/optimizers.py` takes parameters that require a gradient).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

from ..errors import UserError
from ..plan.recipe import Lora, Recipe

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def adapt(model: nn.Module, recipe: Recipe) -> nn.Module:
    """The built model with its weights in `model.dtype` and, with `model.lora`, adapters on the named modules."""
    spec = recipe.model
    name = spec.builtin or spec.factory or spec.hf or "the model"
    if spec.dtype != "fp32":
        model = in_dtype(model, TORCH_DTYPES[spec.dtype])
    if spec.quantize is not None:  # the frozen base in int8 / nf4, then the adapters on it (models/quantize.py)
        from .quantize import quantize

        model = quantize(model, recipe, name)
    if spec.lora is not None:
        model = with_lora(model, spec.lora, name)
    return model


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its weights in `dtype`, as transformers' from_pretrained / from_config with `dtype` builds a
    transformers model (every floating parameter in `dtype` but those of its `_keep_in_fp32_modules`, the buffers
    untouched); any other module `.to(dtype)`, buffers included (PyTorch's own convention: BatchNorm's statistics)."""
    transformers = sys.modules.get("transformers")  # not imported: no transformers model here
    inner = [m for m in model.modules() if transformers is not None and isinstance(m, transformers.PreTrainedModel)]
    if not inner:
        return model.to(dtype)
    kept = {name for pretrained in inner for name in (getattr(pretrained, "_keep_in_fp32_modules", None) or ())}
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # a tied parameter once
            # transformers keeps a parameter in float32 when a part of its name is one of those modules' names
            if parameter.is_floating_point() and parameter.dtype != dtype and not kept & set(name.split(".")):
                parameter.data = parameter.data.to(dtype)
    return model


def place(model: nn.Module, recipe: Recipe, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model on `device`, in `dtype`; weights the recipe stores in bf16/fp16 stay so when the run computes in
    float32 (its default), and only a run in another dtype (float64: verify, the equivalence tests) casts them all."""
    spec = recipe.model
    stored = spec.dtype != "fp32" or (spec.lora is not None and spec.lora.dtype != "fp32")
    if stored and dtype == torch.float32:
        return model.to(device=device)
    return model.to(device=device, dtype=dtype)


def adaptable_modules(model: nn.Module) -> list[str]:
    """The last part of the names of the modules LoRA can adapt (linear, embedding and convolution layers)."""
    kinds: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        kinds = (*kinds, Conv1D)
    except ImportError:
        pass
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if name and isinstance(module, kinds)}
    return sorted(names)


def with_lora(model: nn.Module, lora: Lora, model_name: str) -> nn.Module:
    """peft's LoRA on `model`: adapters of rank r on the target modules, every other weight frozen."""
    from .quantize import quiet_bitsandbytes

    quiet_bitsandbytes()  # peft imports bitsandbytes where it is installed
    try:
        import peft
    except ImportError:
        raise UserError("model.lora: needs peft, which is not installed (pip install peft)") from None
    names = [name for name, _ in model.named_modules() if name]
    for target in lora.target_modules:
        if not any(name == target or name.endswith("." + target) for name in names):
            known = ", ".join(adaptable_modules(model))
            raise UserError(f"model.lora.target_modules: {model_name} has no module named {target!r} "
                            f"(modules LoRA can adapt: {known})")
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), bias="none",
    )
    with warnings.catch_warnings():
        # peft sets fan_in_fan_out itself for GPT-2's Conv1D and says so; transformers deprecation notices
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        try:
            model = peft.get_peft_model(model, config)
        except ValueError as exc:  # a target of a kind LoRA cannot adapt
            raise UserError(f"model.lora.target_modules: {exc}") from None
    if lora.dtype != "fp32":  # peft keeps adapters in fp32; QLoRA casts them to bf16
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(TORCH_DTYPES[lora.dtype])
    return model
