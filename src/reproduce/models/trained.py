"""The trained model as its users load it, beside the run's model.pt.

- With `model.lora`, `adapter/`: peft's `save_pretrained` folder (adapter_config.json, adapter_model.safetensors),
  with the data's tokenizer beside them (`AutoTokenizer.from_pretrained("adapter")`, as a hub adapter holds one),
  which `peft.PeftModel.from_pretrained(base, "adapter")` puts on the base model, transformers' as the weights folder
  loads it (`AutoModelForCausalLM.from_pretrained(WEIGHTS)`), or the built-in module for any other model. The loop
  trains a transformers model inside a module that returns its logits (HFLogits), so the adapter's keys are
  written as they are under the transformers model itself.
- On request (`reproduce run --merged`), `merged/`: the base with the adapters merged in, as a Hugging Face folder
  (`save_pretrained`, with the data's tokenizer), loaded with `from_pretrained` alone. On a quantised base
  (`model.quantize`) the adapters are merged into the base's own weights folder read again unquantised, in
  `model.dtype`, as Alpaca-LoRA's `export_hf_checkpoint.py` does (`load_in_8bit=False`, then
  `PeftModel.from_pretrained(base, adapter).merge_and_unload()`): peft would merge them into the 8-bit / 4-bit layers
  and save those, which `from_pretrained` alone does not read back.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import UserError
from ..plan.builtin_names import hf_model_folder
from ..plan.recipe import Recipe

PEFT_PREFIX = "base_model.model."  # a PeftModel's keys: base_model (LoraModel) . model (what LoRA was put on)


def peft_model(model: nn.Module) -> Any:
    """The model as peft wrapped it (a PeftModel), or None without LoRA."""
    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def transformers_inside(module: nn.Module) -> tuple[str, Any]:
    """(its name in `module`, the first transformers PreTrainedModel in it), or ("", None)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return "", None
    for name, inner in module.named_modules():
        if isinstance(inner, transformers.PreTrainedModel):
            return name, inner
    return "", None


def check_merged(model: nn.Module, recipe: Recipe, sharded: bool = False) -> None:
    """`--merged` needs LoRA on a transformers model, unsharded: one line before any step, else."""
    name = recipe.model.builtin or recipe.model.factory or recipe.model.hf or "the model"
    if sharded:
        raise UserError("not with FSDP sharding (each rank holds a shard); merge adapter/ into the base "
                        "afterwards: PeftModel.from_pretrained(base, adapter).merge_and_unload()", field="merged")
    peft = peft_model(model)
    if peft is None:
        raise UserError("the recipe trains no LoRA adapters (model.lora) to merge; model.pt is the trained "
                        "model", field="merged")
    if transformers_inside(peft.base_model.model)[1] is None:
        raise UserError(f"{name} is not a transformers model, so it has no Hugging Face folder; model.pt "
                        "holds its weights and adapter/ its adapters", field="merged")
    if recipe.model.quantize is not None and base_folder(recipe) is None:
        raise UserError(f"on an {recipe.model.quantize} base the adapters merge into the base's own weights "
                        "folder (model.weights or `weights`: a Hugging Face folder), read again unquantised; this "
                        "run has none, so adapter/ holds its adapters", field="merged")


def base_folder(recipe: Recipe) -> str | None:
    """The Hugging Face folder the base's weights came from (model.weights, or model.hf's folder), or None."""
    from .pretrained import weights_of

    weights = weights_of(recipe)
    if weights is not None:
        return str(weights.path) if weights.is_folder else None
    local = hf_model_folder(recipe.model.hf) if recipe.model.hf is not None else None
    return str(local) if local is not None else None


def save_adapter(model: nn.Module, folder: Path, recipe: Recipe, state: dict | None = None) -> bool:
    """adapter/ with peft's save_pretrained; False when the model has no LoRA adapters. `state`: the model's full
    state dict (FSDP: gathered from the ranks' shards; None: the model's own)."""
    peft = peft_model(model)
    if peft is None:
        return False
    inner, hf_model = transformers_inside(peft.base_model.model)
    config = peft.peft_config["default"]
    before = config.base_model_name_or_path, config.task_type
    config.base_model_name_or_path = recipe.model.weights or recipe.model.hf or before[0]
    if hf_model is not None and recipe.task == "language-modeling" and "MaskedLM" not in type(hf_model).__name__:
        config.task_type = config.task_type or "CAUSAL_LM"  # AutoPeftModelForCausalLM reads it
    try:
        if hf_model is None or not inner:
            peft.save_pretrained(str(folder), state_dict=state)
        else:  # the keys under the transformers model, as PeftModel.from_pretrained(its from_pretrained) has them
            write_adapter(peft, folder, PEFT_PREFIX + inner + ".", state)
    finally:
        config.base_model_name_or_path, config.task_type = before
    tokenizer = data_tokenizer(recipe)  # the data's tokenizer beside the adapters: AutoTokenizer reads adapter/
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return True


def write_adapter(model: Any, folder: Path, wrapper: str, state: dict | None = None) -> None:
    """What peft's save_pretrained writes (its adapter state dict, its config's save_pretrained), the keys under
    `wrapper` (base_model.model.<the wrapper's name for the transformers model>.) moved up to base_model.model.
    (save_pretrained takes a state_dict, but finds the adapters in it by the model's own module names.)"""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, state_dict=state, adapter_name="default")
    state = {PEFT_PREFIX + key[len(wrapper):] if key.startswith(wrapper) else key: value.detach().cpu().contiguous()
             for key, value in state.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    config = model.peft_config["default"]
    inference_mode = config.inference_mode
    config.inference_mode = True  # as save_pretrained stores it
    try:
        config.save_pretrained(str(folder))
    finally:
        config.inference_mode = inference_mode


def save_merged(model: nn.Module, folder: Path, recipe: Recipe, adapter: Path) -> None:
    """merged/: the adapters merged into the base (peft's merge_and_unload: in place, so the run's last use of the
    model), as a Hugging Face folder with the data's tokenizer. On a quantised base: `adapter` (the run's adapter/)
    put on the weights folder's model read again in model.dtype, and merged there."""
    from .pretrained import from_pretrained_kwargs, quiet

    if recipe.model.quantize is None:
        merged = peft_model(model).merge_and_unload()
        _, hf_model = transformers_inside(merged)
    else:
        import peft

        kind = type(transformers_inside(peft_model(model).base_model.model)[1])
        with quiet(sys.modules["transformers"]):
            base = kind.from_pretrained(base_folder(recipe), **from_pretrained_kwargs(recipe))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename notice
            hf_model = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()

    with quiet(sys.modules["transformers"]):  # (its progress bar of the shards it writes)
        hf_model.save_pretrained(str(folder))
    tokenizer = data_tokenizer(recipe)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


def data_tokenizer(recipe: Recipe) -> Any:
    """The tokenizer the run's text data was tokenised with, or None (data of no tokenizer)."""
    if not recipe.data.text_columns:
        return None
    from ..data.text import load_tokenizer, tokenizer_name

    try:
        return load_tokenizer(*tokenizer_name(recipe))
    except UserError:
        return None
