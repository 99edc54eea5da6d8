"""The language-model loss over chunks of tokens (`model.loss_chunks: C`), exact: the chunks' sums add up to
the micro-batch's. Each chunk applies the output head and the cross-entropy inside non-reentrant
`torch.utils.checkpoint`, so backward recomputes one chunk's logits at a time: the logits and their fp32 copy are
one chunk's, for one more head matmul per chunk (torchtune's CEWithChunkedOutputLoss and LitGPT chunk without
recomputing, keeping every chunk's logits).
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
