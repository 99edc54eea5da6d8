"""A quantised frozen base (`model.quantize: int8 | nf4`): bitsandbytes' 8-bit or 4-bit linear layers under LoRA.

The settings are transformers' `BitsAndBytesConfig`, as a user of `from_pretrained(quantization_config=...)` writes
them: int8 is `load_in_8bit` (LLM.int8(), Dettmers et al. 2022, arXiv 2208.07339: 1 byte a weight and one fp32 scale
per output row; its default outlier threshold 6.0); nf4 is `load_in_4bit` with `bnb_4bit_quant_type="nf4"` and
`bnb_4bit_use_double_quant` from `model.double_quant`, true unless the recipe says false (QLoRA, Dettmers et al.
2023, arXiv 2305.14314: 4-bit NormalFloat in blocks of 64, whose absmax scales are themselves quantised to 8 bits in
blocks of 256) and the recipe's precision as `bnb_4bit_compute_dtype` (transformers' defaults would be fp4 and
float32, and no double quantisation). All set explicitly.

How the model is quantised: in memory, the way `from_pretrained` does it, without writing the model to disk.
transformers' `replace_with_bnb_linear` swaps each `nn.Linear` (and GPT-2's `Conv1D`) but the output head for a
bitsandbytes layer, and each weight becomes bitsandbytes' `Int8Params` / `Params4bit`, quantised when it is put on
its device, exactly what from_pretrained's bitsandbytes quantizer does with every weight it reads. The same code then
serves a built-in from its config (random weights), a factory's model and weights read from disk, and on the meta
device (the estimate meter) gives the packed weights' true sizes with no data. Saving a random model to a temporary
folder to read it back through from_pretrained would cost a disk copy of the whole model (13 GB for LLaMA-7B in
fp16) for the same layers. Then peft's `prepare_model_for_kbit_training` (every base weight frozen, the weights left
in fp16/bf16 cast to fp32, as Alpaca-LoRA trains; with `model.upcast_embeddings: false` the embeddings and head go
back to the model's dtype, as QLoRA's qlora.py does) and, in `weights.adapt`, peft's LoRA, which puts its
bitsandbytes adapter layers on the quantised ones. Its gradient checkpointing is not used: the recipe's
`activation_checkpointing` applies (models/checkpointing.py, non-reentrant).

The frozen quantised weights are the same numbers for every micro-batch, so accumulation stays exact. What runs
where: bitsandbytes 0.50 quantises and runs both layers forward and backward on a CPU (int8 in training as a
dequantised matmul, `MatMul8bitFp`), in any float dtype, float64 included; on CUDA int8 multiplies int8
activations (`MatMul8bitLt`, fp16), and with the 6.0 threshold the outlier columns computed in fp16 are chosen from
each micro-batch's activations, so there the frozen forward of a sample depends a little on the samples beside it.
Paged optimizers page only on CUDA (on a CPU bitsandbytes steps them unpaged).
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

EXTRA = "pip install 'reproduce[quantize]'  (bitsandbytes==0.50.2)"
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes' 4-bit block and the double quantisation's block of absmax scales


def quiet_bitsandbytes() -> None:
    """Drop the warning bitsandbytes' CPU backend logs at import when the optional "kernels" package (a faster 4-bit
    CPU matmul from the Hugging Face hub) is missing: the layers run without it, and a user would read it as a
    failure. peft imports bitsandbytes too (for its LoRA layers), so this is called before either imports it."""
    import logging

    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _NoKernelsNotice) for f in cpu_ops.filters):
        cpu_ops.addFilter(_NoKernelsNotice())


class _NoKernelsNotice:
    def filter(self, record: Any) -> bool:
        return "kernels-community" not in str(record.msg)


def bitsandbytes() -> Any:
    """The bitsandbytes module, or one line naming the extra that installs it."""
    quiet_bitsandbytes()
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(f"model.quantize: needs bitsandbytes, which is not installed ({EXTRA})") from None
    return bnb


def quantization_config(recipe: Recipe) -> Any:
    """transformers' BitsAndBytesConfig for the recipe: every setting that matters given, none left to defaults."""
    from transformers import BitsAndBytesConfig

    if recipe.model.quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_has_fp16_weight=False)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quantised(recipe),
        bnb_4bit_compute_dtype=COMPUTE_DTYPES[recipe.precision], bnb_4bit_quant_storage=torch.uint8,
    )


def _linear_kinds() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers, (in, out) weights

        return nn.Linear, Conv1D
    except ImportError:
        return (nn.Linear,)


def kept_whole(model: nn.Module) -> list[str]:
    """The linear layers left unquantised: the output head (named lm_head, or sharing its weight with an embedding,
    as tied heads do), as from_pretrained leaves it (`get_keys_to_not_convert`)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [name for name, module in model.named_modules()
            if isinstance(module, _linear_kinds()) and (name.rsplit(".", 1)[-1] in ("lm_head", "head")
                                                        or id(module.weight) in embeddings)]


def quantize(model: nn.Module, recipe: Recipe, model_name: str) -> nn.Module:
    """The model with its linear layers (but the head) in bitsandbytes' int8 or nf4, every base weight frozen."""
    bnb = bitsandbytes()
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    kinds, skip = _linear_kinds(), kept_whole(model)
    originals = {name: module for name, module in model.named_modules()
                 if type(module) in kinds and name not in skip}
    if not originals:
        found = "only its output head" if skip else "none"
        raise UserError(f"model.quantize: {model_name} has no linear layers to quantise ({found}: "
                        f"{recipe.model.quantize} applies to nn.Linear layers and GPT-2's Conv1D)")
    config = quantization_config(recipe)
    _real_dynamic_map(bnb)
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
                                      compress_statistics=double_quantised(recipe), quant_storage=torch.uint8,
                                      module=new)
        # `.to(device)` quantises (what from_pretrained does); on meta it would not, and `_quantize` gives the
        # packed tensors' shapes and dtypes without data (bitsandbytes registers meta kernels for its ops)
        new.weight = param._quantize(weight.device) if weight.is_meta else param.to(weight.device)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        if recipe.model.quantize == "int8":
            new.register_load_state_dict_pre_hook(_int8_scales_in_place)
        else:
            new.register_load_state_dict_pre_hook(_nf4_state_in_place)
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


def double_quantised(recipe: Recipe) -> bool:
    """nf4's absmax scales quantised again (model.double_quant; true unless the recipe says false)."""
    return recipe.model.double_quant is not False


def _real_dynamic_map(bnb: Any) -> None:
    """bitsandbytes caches the 8-bit code of double quantisation at its first use, made on the device of the default
    device context: built first under `torch.device("meta")` (the estimate meter) it would be a meta tensor that no
    real quantisation can copy from afterwards. Made here on the CPU (each use moves it to its tensor's device)."""
    cached = bnb.functional.name2qmap.get("dynamic")
    if cached is None or cached.is_meta:
        with torch.device("cpu"):
            bnb.functional.name2qmap["dynamic"] = bnb.functional.create_dynamic_map()


def _int8_scales_in_place(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Loading a state dict into a Linear8bitLt that has run: bitsandbytes moves its row scales from the weight to
    the layer's state at the first forward and then refuses to load them ("into non-quantized Linear8bitLt"); give the
    weight the same tensor back, which the load then overwrites in place (a resumed run, verify's reset)."""
    if getattr(module.weight, "SCB", None) is None and module.state.SCB is not None:
        module.weight.SCB = module.state.SCB


def _nf4_state_in_place(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Loading a state dict into a quantised Linear4bit: its quantisation state (absmax, code, nested absmax, packed
    metadata), saved beside the weight, is copied into the layer's own (torch's load would call those keys
    unexpected); packed metadata that differs means another quantisation, refused."""
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
    """Each bitsandbytes layer with what it keeps outside its parameters (int8: the row scales; nf4: the
    quantisation state), taken before `to_empty` replaces its weight (see `materialize_quantized`)."""
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
    """After `to_empty` on a meta model under `FakeTensorMode` (the estimate meter): give each bitsandbytes layer its
    scales or quantisation state on `device` too. The fake weight `to_empty` made is a plain (fake) tensor, not
    bitsandbytes' parameter class (a fake tensor cannot be re-classed), so the attributes the layers read from their
    weight are set on it: its bytes are the packed weight's, and the layers' forward and backward run as they do."""
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
    """Run the 4-bit layers in `dtype` (verify in float64 or float32); the number of layers changed.

    Each multiplies by its dequantised weight (`dequantize_4bit`: the code value times its block's absmax, the
    numbers the 4-bit matmul uses, exact in float32 and float64) in `dtype`: bitsandbytes 0.50.2's CPU 4-bit matmul
    gives wrong results for float64 inputs (max error 1.6 on a 32 x 64 layer, against 4e-7 in float32). The 8-bit
    layers already compute in their input's dtype on a CPU (`MatMul8bitFp`: the dequantised weight, then a matmul).
    """
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
