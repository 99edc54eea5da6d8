"""Hugging Face models as the loop takes them: their logits (HFLogits). They are loaded in models/pretrained.py
(`model: {hf: NAME_OR_LOCAL_PATH}`, a weights folder: local files only, never the network)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..errors import UserError

# a packed row's samples' bounds (data/packing.py `varlen_bounds`), keyword arguments of the model's forward
BOUNDS = ("sample_sizes", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
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
        if "position_ids" in kwargs and "attention_mask" not in kwargs:
            # packed samples (data/packing.py): transformers confines attention to each run of positions only without
            # a cache; a model whose config says use_cache (the saved default) would attend across samples silently
            kwargs["use_cache"] = False
        elif self.kind == "causal-lm":
            kwargs.setdefault("use_cache", False)
        if "sample_sizes" in kwargs and not self._passes_kwargs:  # a forward that hands nothing down: the varlen
            for name in BOUNDS:  # attention reads the samples' bounds from the position ids (models/varlen.py)
                kwargs.pop(name, None)
        keep = kwargs.get("logits_to_keep")
        if keep is not None and not self._keeps_logits:  # a model without it: every logit, then those kept
            del kwargs["logits_to_keep"]
            return self.model(**kwargs).logits[:, keep]
        return self.model(**kwargs).logits

    @functools.cached_property
    def _passes_kwargs(self) -> bool:
        """Whether the model's forward takes extra keyword arguments (transformers' hand them to the attention: a
        packed row's bounds, data/packing.py `varlen_bounds`)."""
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(self.model.forward).parameters
                   .values())

    @functools.cached_property
    def _keeps_logits(self) -> bool:
        """Whether the model's forward takes `logits_to_keep` (a packed row's target positions, data/packing.py):
        read once, not at every micro-batch's forward."""
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters


def hf_logits(model: nn.Module) -> HFLogits | None:
    """The HFLogits in `model` (itself, or under peft's LoRA wrapper), or None."""
    return next((module for module in model.modules() if isinstance(module, HFLogits)), None)


def attention_name(model: nn.Module) -> str:
    """The attention implementation a model runs: transformers' config._attn_implementation, else its class."""
    inner = hf_logits(model)
    name = getattr(getattr(inner.model, "config", None), "_attn_implementation", None) if inner else None
    return f"{name} ({type(inner.model).__name__})" if name else f"{type(model).__name__}'s own"


def confines_packed(model: nn.Module, device: torch.device) -> bool:
    """Whether the model attends within each packed sample: the logits of two samples packed in one row with position
    ids restarting at the second equal those of the second alone (eval mode, no gradient; the mode is restored);
    under the varlen attention, every attention call cut the row at its samples (in the model's own mode)."""
    inner = hf_logits(model)
    if inner is None or inner.kind != "causal-lm":
        return False
    from .varlen import VARLEN, varlen_confines

    if getattr(inner.model.config, "_attn_implementation", None) == VARLEN:  # confined by construction when every
        return varlen_confines(model, device)  # attention call reads the position ids (models/varlen.py)
    vocab = int(getattr(inner.model.config, "vocab_size", 2) or 2)
    first = torch.arange(3, device=device) % vocab
    second = (torch.arange(4, device=device) * 7 + 1) % vocab
    row = {"input_ids": torch.cat([first, second])[None], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]],
                                                                                          device=device)}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed, alone = model(row)[0, 3:], model(second[None])[0]
    finally:
        model.train(training)
    scale = float(alone.abs().max()) or 1.0
    return float((packed - alone).abs().max()) <= 1e-3 * scale



def check_packed(model: nn.Module, device: torch.device) -> None:
    """`data.packing: packed` needs attention confined to each sample (`confines_packed`): one line otherwise."""
    if not confines_packed(model, device):
        raise UserError(f"data.packing: packed: this model's attention ({attention_name(model)}) does not confine "
                        "packed samples (a token would attend across a sample boundary); use data.packing: sorted "
                        "(`packing` sorted), exact with any attention")
