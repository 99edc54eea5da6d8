"""BERT's pre-training loss (`loss: {builtin: bert-mlm-nsp}`): masked LM + next-sentence prediction, exact over a
window of micro-batches.

BERT's loss is the sum of two means (google-research/bert run_pretraining.py): the masked-LM cross-entropy over the
masked tokens and the next-sentence cross-entropy over the sequences. Over a window of micro-batches (the paper's
batch, accumulated) each mean is over the *window's* count: masked tokens C_m for the first, sequences C_s for the
second. The training loop divides every micro-batch's summed loss by one count, the window's `count(target)` total
(C_m here); so each micro-batch returns

    sum of masked-LM terms + sum of next-sentence terms x C_m / C_s

and the loop's division leaves  MLM sum / C_m + NSP sum / C_s  over the window, whatever the split into
micro-batches. The loop tells the loss C_m and C_s (over every rank) before the window's first forward:
`window(count, samples)`.

Targets are one tensor (B, T + 1): the masked-LM labels of the T positions (-100 where no token was masked) and,
in the last column, the next-sentence label (0: B follows A; 1: B is a random sentence), as `data.pairs` builds
them. Outputs are the model's (masked-LM logits (B, T, V), next-sentence logits (B, 2)).

Evaluation (`reproduce run --eval-data`, no window): the same sum, the next-sentence term weighted by the last
training window's C_m / C_s (or, before any, the batch's own), divided by the masked tokens evaluated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..data.batches import IGNORE_INDEX


def _upcast(output: torch.Tensor) -> torch.Tensor:
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
        mlm = F.cross_entropy(_upcast(mlm_logits).flatten(0, -2), target[:, :-1].flatten(), ignore_index=IGNORE_INDEX,
                              reduction="sum")
        nsp = F.cross_entropy(_upcast(nsp_logits), target[:, -1], reduction="sum")
        return mlm, nsp

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        mlm, nsp = self.terms(output, target)
        ratio = self.ratio if self.ratio is not None else max(self.count(target), 1) / max(len(target), 1)
        return mlm + nsp * ratio
