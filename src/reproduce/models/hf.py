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
# (and `rows_kept_from`, each sample's first position whose logit is kept, data/packing.py `kept_from`)
BOUNDS = ("sample_sizes", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "rows_kept_from")
HF_KIND_FOR_TASK = {"language-modeling": "causal-lm", "classification": "sequence-classification"}


class HFLogits(nn.Module):
    """A Hugging Face model whose forward returns only its logits, so the usual losses apply to it.

    causal-lm and masked-lm: (B, T, V). No labels go to the model and nothing is shifted: the targets are already
    aligned (target[t] is the token after input[t], or the masked token; -100 where no loss is taken, right padding
    included). sequence-classification: (B, C), each row's last token found by pad_token_id. A dict input is passed
    as keyword arguments.
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
        if "sample_sizes" in kwargs and not any(p.kind is p.VAR_KEYWORD for p in self._forward_parameters.values()):
            for name in BOUNDS:  # a forward that hands nothing down: the varlen attention reads the samples'
                kwargs.pop(name, None)  # bounds from the position ids (models/varlen.py)
        keep = kwargs.get("logits_to_keep")
        if keep is None:  # every logit is taken: the last layer computes every row
            kwargs.pop("rows_kept_from", None)
        if keep is not None and "logits_to_keep" not in self._forward_parameters:  # every logit, then those kept
            del kwargs["logits_to_keep"]
            return self.model(**kwargs).logits[:, keep]
        return self.model(**kwargs).logits

    @functools.cached_property
    def _forward_parameters(self) -> Any:
        return inspect.signature(self.model.forward).parameters


def hf_logits(model: nn.Module) -> HFLogits | None:
    """The HFLogits in `model` (itself, or under peft's LoRA wrapper), or None."""
    return next((module for module in model.modules() if isinstance(module, HFLogits)), None)


def confines_packed(model: nn.Module, device: torch.device) -> bool:
    """Whether the model keeps packed samples apart: the second of two has the same logits whatever the first's tokens
    (the same dropout; attention, a convolution or a state-space layer that leaks moves them), and its positions
    restart: under VARLEN every attention call cut the row (in the model's own mode: bitsandbytes' CPU 4-bit layers
    repack in eval mode, into a kernel without a backward); else it has its logits alone (eval mode, restored after)."""
    inner = hf_logits(model)
    if inner is None or inner.kind != "causal-lm":
        return False
    from .varlen import CALLS, VARLEN, attention_of

    vocab = int(getattr(inner.model.config, "vocab_size", 2) or 2)
    second = (torch.arange(4, device=device) * 7 + 1) % vocab

    def after(first: list[int]) -> torch.Tensor:  # the second sample's logits, packed after `first`
        row = {"input_ids": torch.cat([torch.tensor(first, device=device) % vocab, second])[None],
               "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)}
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return model(row)[0, 3:]

    if attention_of(model) == VARLEN:
        calls, packed = dict(CALLS), after([0, 1, 2])
        return CALLS["cut"] > calls["cut"] and CALLS["whole"] == calls["whole"] and close(after([11, 16, 21]), packed)
    training = model.training
    model.eval()
    try:
        packed, moved = after([0, 1, 2]), after([11, 16, 21])
        with torch.no_grad():
            alone = model(second[None])[0]
    finally:
        model.train(training)
    return close(packed, alone, 1e-3) and close(moved, packed)


def close(logits: torch.Tensor, reference: torch.Tensor, share: float = 1e-6) -> bool:
    """Whether `logits` are `reference`'s to `share` of their scale (a millionth: the same shapes, no leak)."""
    return float((logits - reference).abs().max()) <= share * (float(reference.abs().max()) or 1.0)


def check_packed(model: nn.Module, device: torch.device) -> None:
    """`data.packing: packed` needs attention confined to each sample (`confines_packed`): one line otherwise."""
    if not confines_packed(model, device):
        inner = hf_logits(model)  # its attention: transformers' config._attn_implementation, else its class
        name = getattr(getattr(inner.model, "config", None), "_attn_implementation", None) if inner else None
        attention = f"{name} ({type(inner.model).__name__})" if name else f"{type(model).__name__}'s own"
        raise UserError(f"data.packing: packed: this model's attention ({attention}) or another of its layers (a "
                        "convolution, a state-space layer) does not confine packed samples (a token would see across "
                        "a sample boundary); use data.packing: sorted (`packing` sorted), exact with any attention")
