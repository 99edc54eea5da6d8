"""BERT's pre-training loss (`bert-mlm-nsp`): masked LM + next-sentence prediction, exact over a window.

BERT's loss is the sum of two means (google-research/bert run_pretraining.py): over the window's masked tokens C_m
and its sequences C_s. The loop divides each micro-batch's sum by one count (C_m), so each returns
MLM sum + NSP sum x C_m / C_s, and the window's loss is MLM sum / C_m + NSP sum / C_s whatever the split; the loop
tells the loss C_m and C_s before the first forward (`window(count, samples)`). Targets (B, T + 1): the masked-LM
labels (-100: not masked), then the next-sentence label (`data.pairs`). Evaluation weighs the NSP term by the last
training window's C_m / C_s (before any, the batch's own) and divides by the masked tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..data.batches import IGNORE_INDEX


def upcast(output: torch.Tensor) -> torch.Tensor:
    return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output


class MaskedLMNextSentenceLoss:
    def __init__(self) -> None:
        self.ratio: float | None = None  # the window's masked tokens per sequence, C_m / C_s

    def window(self, count: int, samples: int) -> None:
        """The window's masked tokens and sequences, over every rank, before its first forward."""
        self.ratio = max(count, 1) / max(samples, 1)

    def count(self, target: torch.Tensor) -> int:
        return int((target[:, :-1] != IGNORE_INDEX).sum())

    def terms(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked-LM cross-entropy summed over the masked tokens, next-sentence cross-entropy summed over rows)."""
        mlm_logits, nsp_logits = output
        mlm = F.cross_entropy(upcast(mlm_logits).flatten(0, -2), target[:, :-1].flatten(), ignore_index=IGNORE_INDEX,
                              reduction="sum")
        nsp = F.cross_entropy(upcast(nsp_logits), target[:, -1], reduction="sum")
        return mlm, nsp

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        mlm, nsp = self.terms(output, target)
        ratio = self.ratio if self.ratio is not None else max(self.count(target), 1) / max(len(target), 1)
        return mlm + nsp * ratio
