"""One optimizer step over a window of N micro-batches, exactly the paper's large-batch update.

  1. count the window's loss-bearing items (samples, or target tokens != -100) before any backward;
  2. for each micro-batch: summed loss / window count, backward (gradients reduced over the ranks on the last
     only: DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)` on the others); with
     `loss.normalization: micro-batch-mean`, summed loss / (its own count x micro-batches x ranks) instead: the
     Hugging Face Trainer's arithmetic before transformers v4.46.0, not the large batch's mean (`divisors`);
  3. once per window: unscale (fp16), clip, optimizer step, scheduler step, zero_grad(set_to_none=True).
The gradient is then exactly that of the mean loss over the whole effective batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..data.batches import LazyMicroBatch
from ..observe.noise import NoiseScale
from .distributed import processes as distributed
from .losses import PixelLoss, SampleLoss, TokenLoss
from .setup import Setup


def _targets(micro_batch: Any) -> Any:
    return micro_batch.targets() if isinstance(micro_batch, LazyMicroBatch) else micro_batch[1]


def _load(micro_batch: Any) -> tuple[Any, Any]:
    return micro_batch.load() if isinstance(micro_batch, LazyMicroBatch) else micro_batch


def _count_without_fetching(loss_fn: Any, micro_batches: list) -> tuple[list[int], int] | None:
    """(loss-bearing items of each micro-batch, samples) of a lazy window known without fetching it: every sample
    bears loss (classification), or the dataset counts each sample's target tokens from an index built once, or its
    valid pixels from its mask alone, cut as the loader cuts it (data/segmentation.py)."""
    if not all(isinstance(m, LazyMicroBatch) for m in micro_batches):
        return None
    samples = sum(len(m.indices) for m in micro_batches)
    if isinstance(loss_fn, SampleLoss):
        return [len(m.indices) for m in micro_batches], samples
    if isinstance(loss_fn, (TokenLoss, PixelLoss)):
        counts = [m.known_count() for m in micro_batches]
        if None not in counts:
            return counts, samples
    return None


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    count: int
    samples: int
    tokens: int
    finite: bool
    grad_syncs: int | None = None
    noise: dict | None = None  # the noise scale's fields for the metrics record (observe/noise.py)


def global_counts(setup: Setup, count: int, samples: int) -> tuple[int, int]:
    """The window's loss-bearing items and samples summed over every rank, before the first backward."""
    if not setup.distributed:
        return count, samples
    totals = torch.tensor([count, samples], dtype=torch.int64, device=setup.device)
    torch.distributed.all_reduce(totals)
    return int(totals[0]), int(totals[1])


def window_counts(loss_fn: Any, micro_batches: list) -> tuple[list[int], int]:
    """(loss-bearing items of each micro-batch, samples) of this rank's window, fetching it only when needed."""
    counted = _count_without_fetching(loss_fn, micro_batches)
    if counted is not None:
        return counted
    targets = [_targets(micro_batch) for micro_batch in micro_batches]
    lazy = all(isinstance(m, LazyMicroBatch) for m in micro_batches)  # its samples: a packed row holds several
    samples = sum(len(m.indices) for m in micro_batches) if lazy else sum(len(t) for t in targets)
    return [loss_fn.count(t) for t in targets], samples


def optimizer_step(setup: Setup, micro_batches: list, noise: NoiseScale | None = None) -> StepResult:
    """One optimizer step over a window of micro-batches: (inputs, targets) on the device, or LazyMicroBatch.

    `noise`, when given, measures the gradient noise scale on the way; it only reads the gradients.
    """
    model, loss_fn = setup.model, setup.loss
    # 1. the window's loss-bearing items, over every rank, before any backward
    counts, samples = window_counts(loss_fn, micro_batches)
    count, samples = global_counts(setup, sum(counts), samples)
    if getattr(loss_fn, "window", None) is not None:  # a loss of several terms, each over its own window count
        loss_fn.window(count, samples)
    if noise is not None:
        noise.start_window(counts, count, samples)

    # 2. each micro-batch's summed loss / the window's count, backward; gradients reduced on the last one only
    divide = divisors(setup, counts, count)
    last = len(micro_batches) - 1
    loaded = None  # the micro-batch in use, kept until the next is loaded (the last: through step 3), as in one loop

    def backward(index: int) -> torch.Tensor:
        nonlocal loaded
        loaded = _load(micro_batches[index])
        inputs, target = loaded
        with setup.gradient_sync(index == last):
            with setup.autocast():
                loss = loss_fn(model(inputs), target) / divide[index]
            (setup.scaler.scale(loss) if setup.scaler else loss).backward()
        if noise is not None:
            noise.after_backward(index)
        return loss.detach()

    if agrees_on_memory(setup, len(micro_batches)):  # DDP: an out-of-memory error before the last is voted on
        losses = backward_with_memory_vote(setup, backward, last)
    else:
        losses = [backward(index) for index in range(last)]
    losses.append(backward(last))
    window_loss = torch.stack(losses).sum()
    if setup.distributed:  # the logged loss is the mean over the global window
        torch.distributed.all_reduce(window_loss)

    # 3. once per window: unscale, clip, step, schedule, zero
    try:
        return _apply_window(setup, window_loss, count, samples, noise)
    except torch.OutOfMemoryError as error:
        raise OptimizerStepOutOfMemory(str(error)) from None


def divisors(setup: Setup, counts: list[int], count: int) -> list[int]:
    """What each micro-batch's summed loss is divided by. window-tokens: the window's count over every rank, so the
    gradient is the large batch's mean. micro-batch-mean: the micro-batch's own count (its mean, as a model's loss
    is) times the window's micro-batches and ranks: the Trainer's `loss / gradient_accumulation_steps` averaged by
    DDP over the ranks (transformers before v4.46.0, PR #34191). An empty micro-batch's loss is 0 either way."""
    loss = setup.plan.recipe.loss
    if loss is None or loss.normalization == "window-tokens":
        return [max(count, 1)] * len(counts)
    return [max(own, 1) * len(counts) * setup.world.size for own in counts]


def agrees_on_memory(setup: Setup, micro_batches: int) -> bool:
    """Whether the ranks can agree on an out-of-memory error before the window's gradients are reduced.

    Under DDP, the micro-batches before the last run under `no_sync` with no collective (unless DDP broadcasts
    buffers in each forward, as for BatchNorm): a rank that runs out of memory there can skip to a vote taken just
    before the last micro-batch, the others reach it, and all change the micro-batch together. Not under FSDP (each
    forward and backward all-gathers parameters: the other ranks wait in those collectives for this one) and not in
    the last micro-batch (DDP has prepared its gradient reduction by then): there the run stops instead.
    """
    if not setup.distributed or setup.sharded or micro_batches < 2:
        return False
    return not setup.model.will_sync_module_buffers()


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """Some rank ran out of memory before the window's last micro-batch; raised on every rank, after a vote."""


def backward_with_memory_vote(setup: Setup, backward: Callable[[int], torch.Tensor], last: int) -> list:
    """The losses of `backward` over the micro-batches before the `last`, then the vote (`agrees_on_memory`): a
    rank out of memory skips its remaining ones, and every rank raises AgreedOutOfMemory if any rank was."""
    losses, error = [], None  # the message only: the error's traceback would keep the window's tensors
    for index in range(last):
        try:
            losses.append(backward(index))
        except torch.OutOfMemoryError as out_of_memory:
            error = str(out_of_memory)
            break
    if distributed.any_rank(setup.world, error is not None, setup.device):
        raise AgreedOutOfMemory(error or "out of memory on another rank")
    return losses


class OptimizerStepOutOfMemory(torch.OutOfMemoryError):
    """Out of memory after the window's gradients were accumulated (unscale, clip or the optimizer's step).

    Still an out-of-memory error to the probe; the run cannot redo such a window (the scaler has unscaled,
    or some parameters have stepped), so it stops instead of lowering the micro-batch.
    """


def _apply_window(setup: Setup, window_loss: torch.Tensor, count: int, samples: int,
                  noise: NoiseScale | None = None) -> StepResult:
    """Unscale, clip, step, schedule and zero the accumulated gradients of one window."""
    model = setup.model
    if setup.scaler:
        setup.scaler.unscale_(setup.optimizer)
    clip = setup.plan.recipe.clip_grad_norm
    if clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    else:  # the norm for the metrics, without clip_grad_norm_'s rescaling pass
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    loss_value, norm_value = float(window_loss), float(grad_norm)
    finite = math.isfinite(loss_value) and math.isfinite(norm_value)
    noise_fields = None
    if noise is not None:  # the window's norm, unscaled and before clipping; the scale its backward passes used
        noise_fields = noise.end_window(norm_value, finite, setup.scaler.get_scale() if setup.scaler else 1.0)
    if setup.scaler:
        setup.scaler.step(setup.optimizer)  # skips the update itself when fp16 gradients overflowed
        setup.scaler.update()
        finite = math.isfinite(loss_value)
    elif finite:  # a non-finite step never touches the weights (the run stops, or skips it)
        setup.optimizer.step()
    setup.scheduler.step()
    setup.optimizer.zero_grad(set_to_none=True)
    tokens = count if setup.plan.recipe.task == "language-modeling" else 0
    syncs = setup.sync_counter.take() if setup.sync_counter else None
    return StepResult(loss_value, norm_value, count, samples, tokens, finite, syncs, noise_fields)
