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
    """Whether the model keeps each packed sample to itself: the second of two packed samples has the same logits
    whatever the first's tokens (the same dropout: a leak through attention, a convolution or a state-space layer moves
    them), and its positions restart: under VARLEN every attention call of the forward cut the row at its samples (in
    the model's own mode: bitsandbytes' 4-bit layers on a CPU repack in eval mode, into a kernel without a backward);
    else the second's logits are its logits alone (eval mode, restored after)."""
    inner = hf_logits(model)
    if inner is None or inner.kind != "causal-lm":
        return False
    from .varlen import CALLS, VARLEN

    vocab = int(getattr(inner.model.config, "vocab_size", 2) or 2)
    first, other = torch.arange(3, device=device) % vocab, (torch.arange(3, device=device) * 5 + 11) % vocab
    second = (torch.arange(4, device=device) * 7 + 1) % vocab
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)

    def after(before: torch.Tensor) -> torch.Tensor:  # the second sample's logits, packed after `before`
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return model({"input_ids": torch.cat([before, second])[None], "position_ids": positions})[0, 3:]

    if getattr(inner.model.config, "_attn_implementation", None) == VARLEN:  # positions read when every attention
        calls = dict(CALLS)  # call reads them (models/varlen.py)
        packed = after(first)
        cut = CALLS["cut"] > calls["cut"] and CALLS["whole"] == calls["whole"]
        return cut and unmoved(packed, after(other))
    training = model.training
    model.eval()
    try:
        packed, moved = after(first), after(other)
        with torch.no_grad():
            alone = model(second[None])[0]
    finally:
        model.train(training)
    scale = float(alone.abs().max()) or 1.0
    return float((packed - alone).abs().max()) <= 1e-3 * scale and unmoved(packed, moved)


def unmoved(logits: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two forwards of the same shapes gave the same logits (to a millionth of their scale: no leak)."""
    return float((logits - other).abs().max()) <= 1e-6 * (float(logits.abs().max()) or 1.0)


def check_packed(model: nn.Module, device: torch.device) -> None:
    """`data.packing: packed` needs attention confined to each sample (`confines_packed`): one line otherwise."""
    if not confines_packed(model, device):
        inner = hf_logits(model)  # its attention: transformers' config._attn_implementation, else its class
        name = getattr(getattr(inner.model, "config", None), "_attn_implementation", None) if inner else None
        attention = f"{name} ({type(inner.model).__name__})" if name else f"{type(model).__name__}'s own"
        raise UserError(f"data.packing: packed: this model's attention ({attention}) or another of its layers (a "
                        "convolution, a state-space layer) does not confine packed samples (a token would see across "
                        "a sample boundary); use data.packing: sorted "
                        "(`packing` sorted), exact with any attention")
