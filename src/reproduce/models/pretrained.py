"""Models that start from weights on this machine (`model.weights`, `model.hf`): a Hugging Face folder, whose
config is the architecture and whose weights must cover it, or one state dict file (torchvision's, nanoGPT's
ckpt.pt, ...) whose keys and shapes must be the model's, else one line. On the meta device only configs and headers
are read.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..plan.builtin_names import hf_model_folder
from ..plan.recipe import Recipe
from ..plan.weightfiles import WeightsOnDisk, safetensors_header
from ..storage.files import check_torch_file
from .architectures import ARCHITECTURES, check_vocab_size, needs_transformers
from .hf import HF_KIND_FOR_TASK, HFLogits
from .weights import SHOWN, TORCH_DTYPES, on_meta, quiet, shown

AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}


def from_folder(folder: Path, auto_class: str, recipe: Recipe, field: str, overrides: dict | None = None,
                new_head: bool = False) -> nn.Module:
    """The transformers model of `folder` (config only on meta); missing weights refused but for a `new_head`."""
    transformers = needs_transformers(f"{field}:")
    auto = getattr(transformers, auto_class)
    overrides = dict(overrides or {})
    try:
        if on_meta():
            config, unused = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                                     return_unused_kwargs=True, **overrides)
            # in the run's dtype, not config.json's (a bf16 folder in an fp32 run would halve the estimate)
            return auto.from_config(config, dtype=TORCH_DTYPES[recipe.model.dtype], **unused)
        with warnings.catch_warnings(), quiet(transformers):
            warnings.simplefilter("ignore", UserWarning)
            # tensors of another shape are loaded as initialised and listed in `info`: refused below in one line
            model, info = auto.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                               ignore_mismatched_sizes=True, dtype=TORCH_DTYPES[recipe.model.dtype],
                                               **overrides)
    except OSError as exc:
        raise UserError(f"{field}: cannot load a model from {folder}: {str(exc).splitlines()[0]}") from None
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise UserError(f"{field}: cannot load {folder} as {auto_class}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    missing = [key for key in info.get("missing_keys", []) if key and not new_head]
    mismatched = info.get("mismatched_keys", [])
    if missing or mismatched:
        names = list(missing) + [_shapes(m) for m in mismatched]
        listed = "; ".join(names[:SHOWN])
        raise UserError(f"{field}: {folder}: its weights do not cover {model.__class__.__name__} of its config: "
                        f"{len(missing)} missing, {len(mismatched)} of another shape ({listed}); transformers would "
                        "initialise them at random")
    return model


def _shapes(mismatched: Any) -> str:
    if isinstance(mismatched, tuple) and len(mismatched) == 3:
        return f"{mismatched[0]}: file {list(mismatched[1])}, model {list(mismatched[2])}"
    return str(mismatched[0] if isinstance(mismatched, tuple) else mismatched)


def load_hf_model(recipe: Recipe, data_info: dict | None, weights: WeightsOnDisk | None = None) -> nn.Module:
    """`model.hf` (or a weights folder in its place) from a local folder or the local cache, never the network."""
    spec = recipe.model
    expected = HF_KIND_FOR_TASK.get(recipe.task)
    kind = spec.kind or expected
    if kind is None:
        raise UserError("model.kind: required with hf for task custom (causal-lm or sequence-classification)")
    if expected is not None and kind != expected:
        raise UserError(
            f"model.kind: {kind} does not fit task {recipe.task} (which needs {expected}: "
            f"{'token logits (B, T, V)' if expected == 'causal-lm' else 'one row of class logits per sample'})"
        )
    needs_transformers(f"model.hf: loading {spec.hf!r}:")
    if weights is not None and weights.is_folder:
        local, name, field = weights.path, str(weights.path), "model.weights"
    else:
        name, field = spec.hf, "model.hf"
        folder = Path(spec.hf).expanduser()
        if spec.hf.startswith(("/", ".", "~")) and not folder.is_dir():
            raise UserError(f"model.hf: no such folder {spec.hf!r}")
        # from the cache's snapshot folder: given a name, transformers 5.24 still asks the hub for adapter_config.json
        local = hf_model_folder(spec.hf)
        if local is None or not (local / "config.json").is_file():
            raise UserError(
                f"model.hf: {spec.hf!r} is not on this machine (a local folder, or the local Hugging Face cache); "
                f"reproduce never downloads at run time: fetch it first (huggingface-cli download {spec.hf})")
    model = from_folder(local, AUTO_CLASSES[kind], recipe, field, spec.kwargs,
                        new_head=kind == "sequence-classification")
    if kind == "causal-lm":
        check_vocab_size(data_info, model.config.vocab_size, field, repr(name))
    if kind == "sequence-classification" and getattr(model.config, "pad_token_id", None) is None:
        raise UserError(
            f"model.kwargs: {name!r} has no pad_token_id, which sequence classification needs to find each "
            "row's last token; inputs are padded with 0, so add kwargs: {pad_token_id: 0} if 0 is the padding id"
        )
    return HFLogits(model, kind)


def builtin_from_folder(recipe: Recipe, weights: WeightsOnDisk, data_info: dict | None) -> nn.Module:
    """A transformers built-in of the weights folder's config, with the recipe's kwargs (`vocab_size`: `widen`)."""
    spec = recipe.model
    arch = ARCHITECTURES.get(spec.builtin or "")
    if arch is None or arch.library != "transformers":
        what = f"built-in {spec.builtin}" if spec.builtin else f"factory {spec.factory}"
        raise UserError(f"model.weights: {weights.path} is a Hugging Face folder, whose config.json is a transformers "
                        f"architecture; the {what} is not one: give a state dict file instead (.safetensors, .pt)")
    check_family(spec.builtin, weights)
    overrides: dict = {}
    for key, value in spec.kwargs.items():
        for target in arch.aliases.get(key, (key,)):
            overrides[target] = value
    vocab = overrides.pop("vocab_size", None)
    model = from_folder(weights.path, arch.auto_class, recipe, "model.weights", overrides)
    if vocab is not None and vocab != model.config.vocab_size:
        widen(model, vocab, weights)
    if arch.kind != "mae":
        check_vocab_size(data_info, model.config.vocab_size, "model.weights", str(weights.path))
    return arch.wrap(model)


def check_family(builtin: str, weights: WeightsOnDisk) -> None:
    """A folder in place of a transformers built-in holds its family (config model_type), else one line."""
    arch = ARCHITECTURES.get(builtin)
    if arch is None or arch.library != "transformers":
        return
    family = getattr(getattr(needs_transformers(f"{builtin}:"), arch.config_class), "model_type", None)
    theirs = (weights.config or {}).get("model_type")
    if family and theirs and theirs != family:
        raise UserError(f"model.weights: {weights.path} holds a {theirs} model ({weights.architecture}), and the "
                        f"built-in {builtin} is a {family} one: give a {family} folder, or name the folder's own "
                        f"architecture with model: {{hf: {weights.path}}}")


def widen(model: nn.Module, vocab: int, weights: WeightsOnDisk) -> None:
    """Alpaca's smart_tokenizer_and_embedding_resize: more token rows, each the mean of the pretrained ones."""
    old = model.config.vocab_size
    if vocab < old:
        raise UserError(f"model.kwargs.vocab_size: {vocab} is smaller than the vocabulary of {weights.path} ({old}); "
                        "a pretrained embedding can only be widened")
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
            if embedding is not None and embedding.weight.shape[0] == vocab:
                embedding.weight[old:] = embedding.weight[:old].mean(dim=0, keepdim=True)


# ---- one state dict file into a built model ---------------------------------------------------------------------


def read_state_dict(weights: WeightsOnDisk, shapes_only: bool, field: str = "model.weights") -> dict[str, Any]:
    """The file's tensors (or shapes) by name: a checkpoint's state dict, a common prefix dropped."""
    path = weights.files[0]
    if path.suffix == ".safetensors":
        if shapes_only:
            state: Any = {name: torch.Size(entry["shape"]) for name, entry in safetensors_header(path).items()
                          if name != "__metadata__"}
        else:
            from safetensors.torch import load_file

            state = load_file(str(path))
    else:
        state = _torch_load(path, field)
    if isinstance(state, dict) and not _is_state_dict(state):
        for key in ("model", "state_dict", "model_state_dict"):  # nanoGPT's ckpt.pt, Lightning's, a common one
            if isinstance(state.get(key), dict) and _is_state_dict(state[key]):
                state = state[key]
                break
    if not isinstance(state, dict) or not _is_state_dict(state):
        keys = ", ".join(map(str, list(state)[:5])) if isinstance(state, dict) else type(state).__name__
        raise UserError(f"{field}: {path}: holds no state dict of tensors by name (found: {keys})")
    for prefix in ("_orig_mod.", "module."):  # torch.compile's and DDP's wrappers
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix):]: value for key, value in state.items()}
    if shapes_only:
        state = {key: (value if isinstance(value, torch.Size) else value.shape) for key, value in state.items()}
    return state


def _is_state_dict(value: dict) -> bool:
    return bool(value) and all(isinstance(k, str) and isinstance(v, (torch.Tensor, torch.Size))
                               for k, v in value.items())


def _torch_load(path: Path, field: str = "model.weights") -> Any:
    damaged = check_torch_file(path)  # torch.load does not check the stored checksums: a flipped bit loads
    if damaged:
        raise UserError(f"model.weights: {path} is {damaged}" if damaged.startswith("damaged") else
                        f"model.weights: {path}: {damaged}")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # the legacy (non-zip) format cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # (torch's message advises weights_only=False: never repeated here)
        raise UserError(f"{field}: {path}: holds Python objects besides tensors, which reproduce does not "
                        "unpickle (torch.load weights_only)") from None
    except Exception as exc:  # (torch's RuntimeError, zlib.error, ... of an archive damaged past its checks)
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{field}: {path}: not a torch file ({said})") from None


def mismatches(module: nn.Module, shapes: dict[str, torch.Size]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, other shape) against `module`'s state dict; a tied parameter by any of its names."""
    expected = {key: value.shape for key, value in module.state_dict(keep_vars=True).items()}
    tied: dict[int, set[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), set()).add(name)
    alias = {name: names for names in tied.values() for name in names}
    missing = [key for key in expected if key not in shapes and not (alias.get(key, set()) & shapes.keys())]
    unexpected = [key for key in shapes if key not in expected]
    other = [f"{key}: file {list(shapes[key])}, model {list(expected[key])}" for key in shapes
             if key in expected and tuple(shapes[key]) != tuple(expected[key])]
    return missing, unexpected, other


def check_state_dict_file(model: nn.Module, weights: WeightsOnDisk, name: str) -> nn.Module:
    """The module of `model` the file loads into, every key and shape checked: else one line with counts."""
    shapes = read_state_dict(weights, shapes_only=True)
    inner = getattr(model, "model", None)  # a wrapper's transformers model (its own names), or the model itself
    targets = [inner, model] if isinstance(model, HFLogits) and isinstance(inner, nn.Module) else [model]
    found = [(target, mismatches(target, shapes)) for target in targets]
    target, (missing, unexpected, other) = min(found, key=lambda item: sum(map(len, item[1])))
    if missing or unexpected or other:
        parts = [_counted(missing, "missing", ", "), _counted(unexpected, "unexpected", ", "),
                 _counted(other, "of another shape", "; ")]
        matching = len(shapes) - len(unexpected) - len(other)
        raise UserError(f"model.weights: {weights.path}: its keys do not match {name}'s: {', '.join(parts)}; "
                        f"{matching} of the file's {len(shapes)} tensors match")
    return target


def _counted(names: list[str], what: str, separator: str) -> str:
    return f"{len(names)} {what}" + (f" ({shown(names, separator)})" if names else "")


def load_state_dict_file(model: nn.Module, weights: WeightsOnDisk, name: str) -> None:
    """Load the file into `model` (or the transformers model it wraps); on the meta device only checked."""
    target = check_state_dict_file(model, weights, name)
    if on_meta():
        return
    state = read_state_dict(weights, shapes_only=False)
    with torch.no_grad():
        target.load_state_dict(state, strict=False)  # every key checked above; tied names load once
