"""The output head left to the loss (`model.loss_chunks: C`): the model returns its last hidden states, and the
loss (train/chunked_loss.py) applies the head and the cross-entropy over C chunks of tokens, each recomputed in
backward, so the (tokens x vocabulary) logits, their fp32 copy and the log-softmax never exist whole.

The head stays where it is (same module, same parameters, same names: state dicts and checkpoints do not change);
only its forward is replaced on the instance by the identity, as checkpointing replaces a block's. The head is the
linear layer named `lm_head` or `head` (the built-in GPT's and nanoGPT's, every transformers causal LM's), tied to the
token embedding or not. Not under LoRA on the head (peft's layer adds its own terms) and not under FSDP (the head's
weight would be a shard outside its forward): one line for each.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..errors import UserError

HEAD_NAMES = ("lm_head", "head")


def _passes_through(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def defer_head(model: nn.Module, name: str) -> nn.Linear:
    """Make `model` return the head's input; the head, whose weight the loss then uses."""
    found = [(path, module) for path, module in model.named_modules() if path.rsplit(".", 1)[-1] in HEAD_NAMES]
    if not found:
        raise UserError(f"model.loss_chunks: {name} has no output head named {' or '.join(HEAD_NAMES)} (the linear "
                        "layer that makes the logits); leave loss_chunks out for this model")
    path, head = found[-1]
    if type(head) is not nn.Linear:
        raise UserError(f"model.loss_chunks: {name}'s {path} is a {type(head).__name__}, not a plain nn.Linear (LoRA "
                        "or a quantised layer on the head): leave loss_chunks out, or the head out of lora")
    head.forward = types.MethodType(_passes_through, head)
    head.deferred_to_loss = True
    return head


def deferred_head(model: nn.Module) -> nn.Linear | None:
    """The head `defer_head` left to the loss, or None."""
    return next((m for m in model.modules() if getattr(m, "deferred_to_loss", False)), None)
