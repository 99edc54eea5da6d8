"""A quantised frozen base (`model.quantize: int8 | nf4`): bitsandbytes' 8-bit or 4-bit linear layers under LoRA.

int8 is LLM.int8() (Dettmers et al. 2022, arXiv 2208.07339), nf4 QLoRA's (Dettmers et al. 2023, arXiv 2305.14314),
every BitsAndBytesConfig setting explicit; quantised in memory as `from_pretrained` does, all but the output head (on
the meta device at their true sizes). The frozen weights are the same for every micro-batch, so accumulation stays
exact; on CUDA int8 picks its outlier columns per micro-batch, so a sample's forward depends a little on the others.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..plan.recipe import Recipe

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXTRA = "pip install 'reproduce[quantize]'  (bitsandbytes==0.50.2)"
NF4_BLOCK = 64  # bitsandbytes' 4-bit block


def quiet_bitsandbytes() -> None:
    """Drop bitsandbytes' import-time warning that the optional "kernels" package is missing (it is optional)."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_kernels_notice)  # (once: addFilter skips a repeat)


def _no_kernels_notice(record: Any) -> bool:
    return "kernels-community" not in str(record.msg)


def bitsandbytes() -> Any:
    quiet_bitsandbytes()
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(f"model.quantize: needs bitsandbytes, which is not installed ({EXTRA})") from None
    return bnb


def quantization_config(recipe: Recipe) -> Any:
    from transformers import BitsAndBytesConfig

    if recipe.model.quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_has_fp16_weight=False)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=recipe.model.double_quant is not False,
        bnb_4bit_compute_dtype=COMPUTE_DTYPES[recipe.precision], bnb_4bit_quant_storage=torch.uint8,
    )


def _linear_kinds() -> tuple[type, ...]:
    """nn.Linear and GPT-2's Conv1D ((in, out) weights): transformers is there wherever peft or quantising is."""
    from transformers.pytorch_utils import Conv1D

    return nn.Linear, Conv1D


def quantize(model: nn.Module, recipe: Recipe, model_name: str) -> nn.Module:
    """The model with its linear layers (but the head) in bitsandbytes' int8 or nf4, every base weight frozen."""
    bnb = bitsandbytes()
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    kinds = _linear_kinds()
    # the output head (lm_head or head, or tied to an embedding), left unquantised as from_pretrained leaves it
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    skip = [name for name, module in model.named_modules() if isinstance(module, kinds)
            and (name.rsplit(".", 1)[-1] in ("lm_head", "head") or id(module.weight) in embeddings)]
    originals = {name: module for name, module in model.named_modules()
                 if type(module) in kinds and name not in skip}
    if not originals:
        found = "only its output head" if skip else "none"
        raise UserError(f"model.quantize: {model_name} has no linear layers to quantise ({found}: "
                        f"{recipe.model.quantize} applies to nn.Linear layers and GPT-2's Conv1D)")
    config = quantization_config(recipe)
    cached = bnb.functional.name2qmap.get("dynamic")  # double quantisation's 8-bit code, cached at first use:
    if cached is None or cached.is_meta:  # made on the CPU, never on meta
        with torch.device("cpu"):
            bnb.functional.name2qmap["dynamic"] = bnb.functional.create_dynamic_map()
    replace_with_bnb_linear(model, modules_to_not_convert=skip or None, quantization_config=config)
    for name, old in originals.items():
        new = model.get_submodule(name)
        weight = old.weight.data
        if type(old) is not nn.Linear:  # Conv1D keeps (in, out): the bitsandbytes layer takes (out, in)
            weight = weight.t().contiguous()
        if recipe.model.quantize == "int8":
            param = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            param = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK,
                                      compress_statistics=recipe.model.double_quant is not False,
                                      quant_storage=torch.uint8, module=new)
        # `.to(device)` quantises as from_pretrained does; on meta `_quantize` gives the packed shapes without data
        new.weight = param._quantize(weight.device) if weight.is_meta else param.to(weight.device)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        new.register_load_state_dict_pre_hook(_int8_scales_in_place if recipe.model.quantize == "int8"
                                              else _nf4_state_in_place)
    flag = "is_loaded_in_8bit" if recipe.model.quantize == "int8" else "is_loaded_in_4bit"
    for module in model.modules():  # what peft reads to put its bitsandbytes LoRA layers on these
        if module is model or hasattr(module, "config"):
            setattr(module, flag, True)
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename notice
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if not recipe.model.upcast_embeddings:  # QLoRA's qlora.py: embeddings and head back in the model's dtype
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding) or name in skip:
                module.to(COMPUTE_DTYPES[recipe.model.dtype])
    return model


def _int8_scales_in_place(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A state dict into a Linear8bitLt that has run (a resume): its row scales, moved to the layer's state at the
    first forward, go back on the weight, which the load overwrites in place."""
    if getattr(module.weight, "SCB", None) is None and module.state.SCB is not None:
        module.weight.SCB = module.state.SCB


def _nf4_state_in_place(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A state dict into a Linear4bit: the quantisation state saved beside the weight copied into the layer's own."""
    state = module.weight.quant_state
    if state is None:
        return
    ours = state.as_dict(packed=True)
    for key, value in ours.items():
        saved = state_dict.pop(f"{prefix}weight.{key}", None)
        if saved is None:
            continue
        if key.startswith("quant_state."):
            if not torch.equal(saved.cpu(), value.cpu()):
                raise UserError(f"model.quantize: {prefix}weight was saved with another 4-bit quantisation "
                                "(block size, type or shape)")
            continue
        value.copy_(saved)


def quantized_states(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Each bitsandbytes layer with its scales or quantisation state, taken before `to_empty` replaces its weight."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: nothing was quantised
    if bnb is None:
        return []
    found: list[tuple[nn.Module, Any]] = []
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            found.append((module, module.weight.SCB if module.weight.SCB is not None else module.state.SCB))
        elif isinstance(module, bnb.nn.Linear4bit):
            found.append((module, module.weight.quant_state))
    return found


def materialize_quantized(states: list[tuple[nn.Module, Any]], device: torch.device) -> None:
    """After `to_empty` under `FakeTensorMode` (the estimate meter): each layer's scales or quantisation state on
    `device` too, set on the plain fake weight (which cannot be re-classed as bitsandbytes' parameter)."""
    def made(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return torch.empty_like(tensor, device=device) if tensor is not None and tensor.is_meta else tensor

    for module, kept in states:
        weight = module.weight
        if hasattr(module, "state"):  # Linear8bitLt: the weight is its int8 rows, SCB their fp32 scales
            weight.CB, weight.SCB, weight.has_fp16_weights = weight.data, made(kept), False
            module.state.CB = module.state.SCB = None
            continue
        state = kept
        state.absmax, state.code, state.offset = made(state.absmax), made(state.code), made(state.offset)
        if state.state2 is not None:
            state.state2.absmax, state.state2.code = made(state.state2.absmax), made(state.state2.code)
        weight.quant_state = module.quant_state = state
        weight.bnb_quantized = True


def compute_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Run the 4-bit layers in `dtype` (verify) by their dequantised weight, exact; the number of layers changed.
    bitsandbytes 0.50.2's CPU 4-bit matmul is wrong for float64 inputs (max error 1.6 on a 32 x 64 layer)."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: nothing was quantised
    if bnb is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.compute_dtype = dtype
        layer.forward = types.MethodType(_dequantized_forward, layer)
    return len(layers)


def _dequantized_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bnb_functional

    weight = bnb_functional.dequantize_4bit(self.weight.data, self.weight.quant_state).to(self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(self.compute_dtype)
    return nn.functional.linear(x.to(self.compute_dtype), weight, bias).to(x.dtype)
