"""Hugging Face models named by `model: {hf: NAME_OR_LOCAL_PATH}`: local files only, never the network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..builtin_names import hf_model_folder
from ..errors import UserError
from ..recipe import Recipe

HF_KIND_FOR_TASK = {"language-modeling": "causal-lm", "classification": "sequence-classification"}


class HFLogits(nn.Module):
    """A Hugging Face model whose forward returns only its logits, so the usual losses apply to it.

    causal-lm: (B, T, V) for input ids (B, T). No labels go to the model and nothing is shifted here: by the
    data contract the targets are already aligned with the inputs (target[t] is the token after input[t],
    -100 where no loss is taken), and TokenLoss sums over them and divides by the window's target tokens,
    exactly as for the built-in GPT. Right padding (collate pads inputs with 0) is harmless under causal
    attention, and padded positions carry target -100.
    masked-lm (BERT, RoBERTa): (B, T, V) likewise; the targets are the masked tokens, -100 elsewhere.
    sequence-classification: (B, C), for SampleLoss; the model finds each row's last token by pad_token_id.
    A dict input (input_ids, attention_mask, ...) is passed to the model as keyword arguments.
    """

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, inputs: Any) -> torch.Tensor:
        kwargs = dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
        if self.kind == "causal-lm":
            kwargs.setdefault("use_cache", False)
        return self.model(**kwargs).logits


def load_hf_model(recipe: Recipe, data_info: dict | None) -> nn.Module:
    """`model: {hf: NAME_OR_PATH}`: from a local folder or the local Hugging Face cache, never the network."""
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
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"model.hf: loading {spec.hf!r} needs transformers, which is not installed (pip install transformers)"
        ) from None
    auto = transformers.AutoModelForCausalLM if kind == "causal-lm" else transformers.AutoModelForSequenceClassification
    folder = Path(spec.hf).expanduser()
    if spec.hf.startswith(("/", ".", "~")) and not folder.is_dir():
        raise UserError(f"model.hf: no such folder {spec.hf!r}")
    # A cached name is loaded from its snapshot folder: given a name, transformers 5.24 still asks the hub for an
    # adapter_config.json despite local_files_only (23 s of retries offline, a request online).
    local = hf_model_folder(spec.hf)
    try:
        if local is None:
            raise OSError(spec.hf)
        model = auto.from_pretrained(str(local), local_files_only=True, **spec.kwargs)
    except OSError:  # not in the folder nor in the local cache: nothing was fetched
        raise UserError(
            f"model.hf: {spec.hf!r} is not on this machine (a local folder, or the local Hugging Face cache); "
            f"reproduce never downloads at run time: fetch it first (huggingface-cli download {spec.hf})"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"model.hf: cannot load {spec.hf!r} as {kind}: {type(exc).__name__}: {exc}") from None
    config = model.config
    vocab = (data_info or {}).get("vocab_size")
    if kind == "causal-lm" and vocab is not None and vocab > config.vocab_size:
        raise UserError(f"model.hf: the data has {vocab} token ids but {spec.hf!r} has a vocabulary of "
                        f"{config.vocab_size}")
    if kind == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        raise UserError(
            f"model.kwargs: {spec.hf!r} has no pad_token_id, which sequence classification needs to find each "
            "row's last token; inputs are padded with 0, so add kwargs: {pad_token_id: 0} if 0 is the padding id"
        )
    return HFLogits(model, kind)
