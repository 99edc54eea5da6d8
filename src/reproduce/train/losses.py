"""The losses, summed over a micro-batch; the training loop divides them by the window's item count.
A loss factory (task `custom`): `fn(**kwargs) -> callable(output, target) -> summed loss`, with an optional
`count(target) -> int` (default: `len(target)`).

The language-model loss over chunks of tokens (`model.loss_chunks: C`, ChunkedTokenLoss) is exact: the chunks'
sums add up to the micro-batch's. Each chunk applies the output head and the cross-entropy inside non-reentrant
`torch.utils.checkpoint`, so backward recomputes one chunk's logits at a time: the logits and their fp32 copy are
one chunk's, for one more head matmul per chunk (torchtune's CEWithChunkedOutputLoss and LitGPT chunk without
recomputing, keeping every chunk's logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data.batches import IGNORE_INDEX
from ..errors import UserError
from ..plan.factory import call_builder
from ..plan.recipe import Recipe, SegmentationData
from .pretraining_loss import MaskedLMNextSentenceLoss, upcast


def _upcast(output: torch.Tensor) -> torch.Tensor:
    """Half-precision logits upcast for the loss (`upcast`); anything but a tensor of logits is one line."""
    if not isinstance(output, torch.Tensor):
        raise UserError(
            f"model: its forward returns {type(output).__name__}, not a tensor of logits; return output.logits from "
            "it, or have the factory return the transformers model itself (reproduce takes its logits)")
    return upcast(output)


class SampleLoss:
    """Classification: summed cross-entropy; every sample bears loss."""

    def count(self, target: torch.Tensor) -> int:
        return int(target.shape[0])

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_upcast(output), target, reduction="sum")


class TokenLoss:
    """Language modelling: summed cross-entropy over target tokens that are not IGNORE_INDEX."""

    def count(self, target: torch.Tensor) -> int:
        return int((target != IGNORE_INDEX).sum())

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            _upcast(output).flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )


class ChunkedTokenLoss:
    """TokenLoss (the same count, the same summed cross-entropy in fp32), chunk by chunk."""

    def __init__(self, head: nn.Linear, chunks: int):
        self.head, self.chunks = head, chunks

    count = TokenLoss.count

    def _chunk(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.head.weight, self.head.bias)
        return F.cross_entropy(_upcast(logits), target, ignore_index=IGNORE_INDEX, reduction="sum")

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from ..models.checkpointing import contexts

        pieces = zip(hidden.flatten(0, -2).chunk(self.chunks), target.flatten().chunk(self.chunks), strict=True)
        losses = [checkpoint(self._chunk, part, part_target, use_reentrant=False, context_fn=contexts)
                  for part, part_target in pieces]
        return torch.stack(losses).sum()


class PixelLoss:
    """Segmentation: summed cross-entropy over the pixels not at `ignore_index`, of the main head (`"out"`)
    plus `aux_weight` x the auxiliary head's; divided by the window's valid pixels over every rank, the large batch's
    mean (docs/segmentation.md), the auxiliary term over the same count (MMSegmentation's `loss_weight`)."""

    def __init__(self, ignore_index: int, aux_weight: float | None = None, all_pixels: bool = False):
        self.ignore_index, self.aux_weight, self.all_pixels = ignore_index, aux_weight, all_pixels

    def count(self, target: torch.Tensor) -> int:
        """The pixels the window's sum is divided by: the valid ones, or every one (data.loss_pixels: all)."""
        return target.numel() if self.all_pixels else int((target != self.ignore_index).sum())

    def pixels(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_upcast(logits), target, ignore_index=self.ignore_index, reduction="sum")

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, dict):
            return self.pixels(output, target)
        loss = self.pixels(output["out"], target)
        if self.aux_weight and "aux" in output:
            loss = loss + self.aux_weight * self.pixels(output["aux"], target)
        return loss


class CustomLoss:
    def __init__(self, function: Callable):
        self.function = function
        self.counter = getattr(function, "count", None)
        # a loss of terms normalised over different counts (BERT's masked tokens and sequences) is told the
        # window's totals before its first forward: window(count, samples) (train/pretraining_loss.py)
        self.window = getattr(function, "window", None)

    def count(self, target: Any) -> int:
        return int(self.counter(target)) if self.counter else len(target)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.function(output, target)


def build_loss(recipe: Recipe, model: Any = None) -> SampleLoss | TokenLoss | ChunkedTokenLoss | PixelLoss | CustomLoss:
    """The recipe's loss; `model`, built, is where a chunked loss finds the head it applies (model.loss_chunks)."""
    if recipe.task == "classification":
        return SampleLoss()
    if recipe.task == "segmentation":
        every = isinstance(recipe.data, SegmentationData) and recipe.data.loss_pixels == "all"
        return PixelLoss(recipe.ignore_index, recipe.model.aux_weight, every)
    if recipe.task == "language-modeling":
        own = pretraining_loss(recipe)
        if own is None and recipe.model.loss_chunks:
            from ..models.checkpointing import deferred_head

            return ChunkedTokenLoss(deferred_head(model), recipe.model.loss_chunks)
        return own if own is not None else TokenLoss()
    from ..models import LOSSES  # the losses that belong to a built-in architecture (MAE's masked-pixel loss)

    function = call_builder(recipe.loss, "loss", LOSSES)
    if not callable(function):
        raise UserError(f"loss: the factory must return a callable (got {type(function).__name__})")
    return CustomLoss(function)


def pretraining_loss(recipe: Recipe) -> CustomLoss | None:
    """A built-in architecture's own pre-training loss (BERT's `bert-mlm-nsp`) in place of the
    next-token loss; else None."""
    from ..models import model_inputs

    if recipe.model.builtin is None or model_inputs(recipe).get("targets") != "mlm-nsp":
        return None
    return CustomLoss(MaskedLMNextSentenceLoss())
