"""What can run here, decided without importing torch: the built-in names, and `why_not_runnable(recipe)`.
A test keeps the names equal to the real registries (models.MODELS, models.LOSSES, data.DATA)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from .recipe.data import NamedData
from .recipe.model import SEGMENTATION_MODELS

if TYPE_CHECKING:
    from .recipe import Recipe

SMALL_MODELS = ("mlp", "cnn-bn", "cnn-gn", "gpt")  # reproduce.models.small
TORCHVISION_MODELS = ("resnet50", "vit-b16", "deit-b")  # the papers' architectures (reproduce.models.architectures)
TRANSFORMERS_MODELS = (
    "mae-vit-large-patch16", "gpt2-124m", "gpt3-small", "gpt2-medium", "gpt-char", "bert-base", "bert-large",
    "roberta-base", "llama-7b",
)
TORCH_MODELS = ("nanogpt",)  # written here in torch alone (reproduce.models.nanogpt)
MODELS = SMALL_MODELS + TORCHVISION_MODELS + SEGMENTATION_MODELS + TRANSFORMERS_MODELS + TORCH_MODELS
LOSSES = ("mae-masked-pixel-mse", "bert-mlm-nsp")
DATA = ("digits", "pysource", "pysource-pairs", "text-pairs")


def _module_found(spec: str) -> bool:
    """Whether the top-level module of `package.module:function` can be found (nothing is imported or run)."""
    top = spec.partition(":")[0].split(".")[0]
    try:
        return importlib.util.find_spec(top) is not None or (Path.cwd() / f"{top}.py").is_file()
    except (ImportError, ValueError):
        return False


def hf_model_folder(name: str) -> Path | None:
    """The folder holding `name`: a local folder, or its snapshot in the local hub cache (the one refs/main names,
    else the newest); None when it is in neither. Never looked up on the network."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    hub = Path(os.environ["HF_HUB_CACHE"]) if os.environ.get("HF_HUB_CACHE") else Path(home).expanduser() / "hub"
    repo = hub / f"models--{name.replace('/', '--')}"  # in the hub cache, as huggingface_hub finds it
    main = repo / "refs" / "main"
    if main.is_file() and (repo / "snapshots" / main.read_text().strip()).is_dir():
        return repo / "snapshots" / main.read_text().strip()
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda path: path.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def why_not_runnable(recipe: Recipe) -> str | None:
    """None when `reproduce run` can run the recipe here; otherwise the reason it is plan-only."""
    model, data = recipe.model, recipe.data
    if model.builtin is not None and model.builtin not in MODELS:
        return f"no built-in model {model.builtin}"
    if model.builtin in TORCHVISION_MODELS + SEGMENTATION_MODELS and not _module_found("torchvision:models"):
        return f"torchvision is not installed ({model.builtin})"
    if model.builtin in TRANSFORMERS_MODELS and not _module_found("transformers:AutoModel"):
        return f"transformers is not installed ({model.builtin})"
    if model.factory is not None and not _module_found(model.factory):
        return f"model factory {model.factory!r} not importable"
    hf = getattr(model, "hf", None)
    if hf is not None:
        if not _module_found("transformers:AutoModel"):
            return "transformers is not installed"
        if hf_model_folder(hf) is None:  # neither a local folder nor in the local hub cache
            return f"Hugging Face model {hf!r} is not on this machine"
    if getattr(model, "lora", None) is not None and not _module_found("peft:get_peft_model"):
        return "peft is not installed (model.lora)"
    if not data.available:
        if data.format is not None:
            named = f"{data.format} data {data.name}" if data.name else f"{data.format} data"
            return f"{named} not on this machine (reproduce run --data PATH)"
        return f"data {data.name} not available"
    for kind, builder, known in (("data", data if isinstance(data, NamedData) else None, DATA),
                                 ("loss", recipe.loss, LOSSES)):
        if builder is not None and builder.builtin is not None and builder.builtin not in known:
            return f"no built-in {kind} {builder.builtin}"
        if builder is not None and builder.factory is not None and not _module_found(builder.factory):
            return f"{kind} factory {builder.factory!r} not importable"
    return None


def check_builtin_model(recipe: Recipe) -> None:
    """`plan` refuses a model.builtin that is no built-in, as `run` does, with the nearest name (a typo is the usual
    cause: deeplabv3-resnet5). `papers` lists such a recipe as plan-only instead (why_not_runnable)."""
    import difflib

    name = recipe.model.builtin
    if name is None or name in MODELS:
        return
    close = difflib.get_close_matches(name, MODELS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"the built-ins: {', '.join(MODELS)}"
    raise UserError(f"model.builtin: no built-in {name!r} ({hint}); a model of your own is model.factory: "
                    "'package.module:function'")
