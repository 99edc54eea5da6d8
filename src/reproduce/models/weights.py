"""How a model's weights are stored (`model.dtype`), which train (`model.lora`, peft), and the trained model as
its users load it: `adapter/` (peft's folder, with the data's tokenizer) and, with `--merged`, `merged/`.

A transformers model in bf16/fp16 keeps what `from_pretrained(dtype=...)` keeps in float32 (the rotary `inv_freq`
in bf16 would be 2.5 rad off at LLaMA's position 2047).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..plan.builtin_names import hf_model_folder
from ..plan.recipe import Lora, Recipe
from ..plan.weightfiles import WeightsOnDisk, inspect
from .quantize import _linear_kinds, quantize, quiet_bitsandbytes

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEFT_PREFIX = "base_model.model."  # a PeftModel's keys: base_model (LoraModel) . model (what LoRA was put on)
SHOWN = 3  # a state dict's names shown in a message


def weights_of(recipe: Recipe) -> WeightsOnDisk | None:
    return inspect(recipe.model.weights) if recipe.model.weights is not None else None


@contextlib.contextmanager
def quiet(transformers: Any):
    """transformers without its progress bar and warnings (tensors that do not fit are refused here in one line)."""
    logging = transformers.utils.logging
    enabled, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if enabled:
            logging.enable_progress_bar()


def shown(names: list[str], separator: str = ", ") -> str:
    return separator.join(names[:SHOWN]) + (f"{separator}..." if len(names) > SHOWN else "")


def on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def adapt(model: nn.Module, recipe: Recipe) -> nn.Module:
    spec = recipe.model
    name = spec.builtin or spec.factory or spec.hf or "the model"
    if spec.dtype != "fp32":
        model = in_dtype(model, TORCH_DTYPES[spec.dtype])
    if spec.quantize is not None:  # the frozen base in int8 / nf4, then the adapters on it (models/quantize.py)
        model = quantize(model, recipe, name)
    if spec.lora is not None:
        model = with_lora(model, spec.lora, name)
    return model


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` in `dtype`: a transformers model as from_pretrained builds it (module docstring), any other whole."""
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
    """The model on `device`, in `dtype`; weights stored in bf16/fp16 stay so in a float32 run."""
    spec = recipe.model
    stored = spec.dtype != "fp32" or (spec.lora is not None and spec.lora.dtype != "fp32")
    if stored and dtype == torch.float32:
        return model.to(device=device)
    return model.to(device=device, dtype=dtype)


def with_lora(model: nn.Module, lora: Lora, model_name: str) -> nn.Module:
    quiet_bitsandbytes()  # peft imports bitsandbytes where it is installed
    try:
        import peft
    except ImportError:
        raise UserError("model.lora: needs peft, which is not installed (pip install peft)") from None
    names = [name for name, _ in model.named_modules() if name]
    for target in lora.target_modules:
        if not any(name == target or name.endswith("." + target) for name in names):
            kinds = (*_linear_kinds(), nn.Embedding, nn.Conv1d, nn.Conv2d)  # the modules LoRA can adapt
            known = ", ".join(sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                     if name and isinstance(module, kinds)}))
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


def peft_model(model: nn.Module) -> Any:
    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def transformers_inside(model: nn.Module) -> tuple[str, Any]:
    """(its name, the outermost transformers model in `model`: under HFLogits and peft's wrappers), or ("", None)."""
    modeling = sys.modules.get("transformers.modeling_utils")  # loaded by any transformers model
    if modeling is None:
        return "", None
    return next(((name, inner) for name, inner in model.named_modules() if isinstance(inner, modeling.PreTrainedModel)),
                ("", None))


def check_merged(model: nn.Module, recipe: Recipe, sharded: bool = False) -> None:
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
    weights = weights_of(recipe)
    if weights is not None:
        return str(weights.path) if weights.is_folder else None
    local = hf_model_folder(recipe.model.hf) if recipe.model.hf is not None else None
    return str(local) if local is not None else None


def save_adapter(model: nn.Module, folder: Path, recipe: Recipe, state: dict | None = None) -> bool:
    """adapter/ with peft's save_pretrained; False without LoRA. `state`: the full state dict (FSDP: gathered)."""
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
    save_tokenizer(recipe, folder)  # AutoTokenizer reads adapter/
    return True


def write_adapter(model: Any, folder: Path, wrapper: str, state: dict | None = None) -> None:
    """What peft's save_pretrained writes, the keys under `wrapper` moved up to base_model.model."""
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
    """merged/: merge_and_unload (in place), or on a quantised base `adapter` on the base folder's model, merged."""
    if recipe.model.quantize is None:
        _, hf_model = transformers_inside(peft_model(model).merge_and_unload())
    else:
        import peft

        kind = type(transformers_inside(peft_model(model).base_model.model)[1])
        with quiet(sys.modules["transformers"]):
            base = kind.from_pretrained(base_folder(recipe), dtype=TORCH_DTYPES[recipe.model.dtype])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename notice
            hf_model = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()

    with quiet(sys.modules["transformers"]):  # (its progress bar of the shards it writes)
        hf_model.save_pretrained(str(folder))
    save_tokenizer(recipe, folder)


def save_tokenizer(recipe: Recipe, folder: Path) -> None:
    """The tokenizer the run's text data was tokenised with, saved in `folder` (none for data of no tokenizer)."""
    if not recipe.data.text_columns:
        return
    from ..data.text import load_tokenizer, tokenizer_name

    try:
        load_tokenizer(*tokenizer_name(recipe)).save_pretrained(str(folder))
    except UserError:
        return
