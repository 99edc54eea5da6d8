"""Hugging Face models as the loop takes them: their logits (HFLogits). They are loaded in models/pretrained.py
(`model: {hf: NAME_OR_LOCAL_PATH}`, a weights folder: local files only, never the network)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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

