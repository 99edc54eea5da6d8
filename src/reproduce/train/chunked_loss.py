"""The language-model loss over chunks of tokens (`model.loss_chunks: C`), exact: the sum of the chunks' summed
cross-entropies is the whole micro-batch's, and the step divides it by the window's token count as always.

Each chunk applies the output head (models/checkpointing.py) and the cross-entropy inside `torch.utils.checkpoint`
(non-reentrant, the GPU rules of the estimate re-entered): forward keeps only the chunk's hidden states, which the
model holds anyway, and backward recomputes one chunk's logits at a time. So the logits, their fp32 copy and the
saved log-softmax are one chunk's instead of the micro-batch's, for one more head matmul per chunk. torchtune's
CEWithChunkedOutputLoss chunks the same way (8 chunks) and LitGPT's chunked head likewise; neither recomputes, so
each keeps every chunk's logits until backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data.batches import IGNORE_INDEX
from ..models.checkpointing import contexts


class ChunkedTokenLoss:
    """train/losses.py's TokenLoss (the same count, the same summed cross-entropy in fp32), chunk by chunk."""

    def __init__(self, head: nn.Linear, chunks: int):
        self.head, self.chunks = head, chunks

    def count(self, target: torch.Tensor) -> int:
        return int((target != IGNORE_INDEX).sum())

    def _chunk(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.head.weight, self.head.bias)
        if logits.dtype in (torch.float16, torch.bfloat16):  # autocast's half logits, upcast as TokenLoss does
            logits = logits.float()
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pieces = zip(hidden.flatten(0, -2).chunk(self.chunks), target.flatten().chunk(self.chunks), strict=True)
        losses = [checkpoint(self._chunk, part, part_target, use_reentrant=False, context_fn=contexts)
                  for part, part_target in pieces]
        return torch.stack(losses).sum()
