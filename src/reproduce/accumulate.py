"""The exact accumulation window, for any PyTorch loop: `Accumulator` and its `Window` (docs/library.md).

One optimizer step over N micro-batches is the large batch's update when (1) the window's loss-bearing items are
counted over every rank before the first backward (one all_reduce); (2) each micro-batch's *summed* loss is divided
by that global count, with the ranks' gradient reduction skipped on all but the last micro-batch (DDP's `no_sync`,
FSDP2's `set_requires_gradient_sync(False)`); (3) once per window: unscale, clip, optimizer and scheduler step,
zero_grad. `reproduce run` takes every optimizer step through this class (train/step.py). This module imports
torch and nothing of `reproduce` but `errors` (it sits below `train/`).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import UserError

__all__ = ["Accumulator", "OptimizerStepOutOfMemory", "Window", "smaller_micro_batch", "split_items"]

NORMALIZATIONS = ("window", "micro-batch-mean")
REDUCTIONS = ("auto", "sum", "mean")


class OptimizerStepOutOfMemory(torch.OutOfMemoryError):
    """Out of memory after the window's gradients were accumulated (unscale, clip or the optimizer's step): the
    window cannot be redone (the scaler has unscaled, or some parameters have stepped), so a run stops."""


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """Some rank ran out of memory before the window's last micro-batch; raised on every rank, after a vote."""


class Accumulator:
    """Exact gradient accumulation around the user's model, optimizer and (optional) LR scheduler.

    - `clip_grad_norm`: applied once per window to the accumulated gradient (None or 0: not clipped; the norm is
      still computed, `Window.grad_norm`). `scaler`: a `torch.amp.GradScaler` (fp16): losses scaled for backward,
      unscaled before the clip; it steps the optimizer (skipping an overflowed step).
    - `normalization`: `window` (each summed loss / the window's global count: the large batch's mean) or
      `micro-batch-mean` (each micro-batch's mean / (micro-batches x ranks): the Hugging Face Trainer's arithmetic
      before transformers v4.46.0, for papers that trained so).
    - `sync_every_micro_batch`: reduce gradients after every micro-batch (FSDP2 with sharded gradients).
    - `gradient_reduction`: how the model's wrapper combines the ranks' gradients: `sum` (what `reproduce run`'s hook
      does) or `mean` (the window then divides by the count over the world size, so the result is the same);
      `auto`: DDP without a comm hook of the user's, and FSDP2, average; anything else sums.
    - `device`: where the count's all_reduce tensor lives (default: the model's first parameter's);
      `process_group`: the ranks the window spans (the default group).

    A window whose loss or gradient norm is not finite leaves the weights alone (the scheduler still steps) and
    says so (`Window.finite`); a scaler skips such steps itself.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 clip_grad_norm: float | None = None, *, scaler: Any = None, normalization: str = "window",
                 sync_every_micro_batch: bool = False, gradient_reduction: str = "auto",
                 device: torch.device | str | None = None, process_group: Any = None):
        if normalization not in NORMALIZATIONS:
            raise UserError(f"expected one of {', '.join(NORMALIZATIONS)} (got {normalization!r})",
                            field="normalization")
        if gradient_reduction not in REDUCTIONS:
            raise UserError(f"expected one of {', '.join(REDUCTIONS)} (got {gradient_reduction!r})",
                            field="gradient_reduction")
        if clip_grad_norm is not None and clip_grad_norm < 0:
            raise UserError(f"must be >= 0 (got {clip_grad_norm})", field="clip_grad_norm")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.normalization = normalization
        self.sync_every_micro_batch = sync_every_micro_batch
        self.gradient_reduction = gradient_reduction
        self.process_group = process_group
        self._device = torch.device(device) if device is not None else None
        self.micro_batch: int | None = None  # `step`'s current micro-batch (lowered after out of memory)

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return self._device
        parameter = next(self.model.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def window(self, counts: Sequence[int], *, samples: int | None = None, observer: Any = None) -> Window:
        """One optimizer step's window, a context manager (the optimizer steps when the block ends without an
        error): `counts` are the loss-bearing items of this rank's micro-batches, in the order of their
        `Window.backward` calls; `samples`: this rank's samples, summed over the ranks with the count. `observer`
        watches the gradients (observe/noise.py): `start_window(counts, count, samples)`, `after_backward(index)`,
        `end_window(norm, finite, scale)`, whose result is `Window.observed`."""
        return Window(self, [int(count) for count in counts], samples, observer)

    def step(self, items: Any, micro_batch: int, loss: Callable[[Any], torch.Tensor],
             count: Callable[[Any], int] | None = None, *, divides: int | None = None) -> Window:
        """One whole optimizer step over this rank's `items` (a tensor, a tuple or dict of tensors, or a list) cut
        into micro-batches of `micro_batch`; `loss(micro)` returns a micro-batch's summed loss, `count(micro)` its
        loss-bearing items (default: its length). After an out-of-memory error before the gradients are complete,
        the same items are split again at the largest micro-batch <= half (one dividing `divides`, when given): the
        same global count, so the same update. The ranks vote before the last micro-batch. The micro-batch in use
        stays in `self.micro_batch`."""
        self.micro_batch = min(self.micro_batch or micro_batch, micro_batch)
        count = count or _length
        while True:
            micro_batches = split_items(items, self.micro_batch)
            try:
                with self.window([count(micro) for micro in micro_batches]) as window:
                    last = len(micro_batches) - 1
                    window.backward_voting(lambda micro: window.backward(loss(micro)), micro_batches[:last])
                    window.backward(loss(micro_batches[last]))
                return window
            except OptimizerStepOutOfMemory:
                raise
            except torch.OutOfMemoryError:
                pass
            # the error and the failed window's frames are gone: free what is left, then split again
            del micro_batches
            free_memory(self.optimizer, self.device)
            smaller = (smaller_micro_batch(divides, self.micro_batch) if divides else
                       self.micro_batch // 2 or None)
            if smaller is None:
                raise torch.OutOfMemoryError(f"out of memory with micro-batch {self.micro_batch}, and no smaller "
                                             "micro-batch is left")
            self.micro_batch = smaller


class Window:
    """One optimizer step's accumulation (`Accumulator.window`): `count`, `samples` (over every rank) and
    `world_size` known once entered, `divisors` each micro-batch's; after the block, `loss` (the mean over the global
    window), `grad_norm` (before clipping, unscaled) and `finite`."""

    def __init__(self, accumulator: Accumulator, counts: list[int], samples: int | None, observer: Any):
        if not counts:
            raise UserError("a window needs at least one micro-batch (got no counts)", field="counts")
        if any(count < 0 for count in counts):
            raise UserError(f"item counts must be >= 0 (got {counts})", field="counts")
        self.accumulator = accumulator
        self.counts = counts
        self.count = sum(counts)
        self.samples = samples
        self.observer = observer
        self.world_size = 1
        self.divisors: list[float] = []
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.finite: bool | None = None
        self.observed: Any = None  # what the observer's end_window returned
        self._losses: list[torch.Tensor] = []
        self._paused_sync = contextlib.ExitStack()  # closing it resumes the ranks' gradient reduction

    def __enter__(self) -> Window:
        acc, model = self.accumulator, self.accumulator.model
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.world_size = int(torch.distributed.get_world_size(acc.process_group))
        distributed = self.world_size > 1
        if distributed:  # 1. the window's loss-bearing items, over every rank, before any backward
            totals = torch.tensor([self.count, self.samples or 0], dtype=torch.int64, device=acc.device)
            torch.distributed.all_reduce(totals, group=acc.process_group)
            self.count = int(totals[0])
            self.samples = int(totals[1]) if self.samples is not None else None
        self.divisors = self._divisors()
        if self.observer is not None:
            self.observer.start_window(self.counts, self.count, self.samples or 0)
        # 2. accumulate locally until the last micro-batch: set before its forward (DDP decides in the forward)
        if len(self.counts) > 1 and distributed and not acc.sync_every_micro_batch:
            if isinstance(model, DistributedDataParallel):
                self._paused_sync.enter_context(model.no_sync())
            elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(False)  # type: ignore[operator]
                self._paused_sync.callback(model.set_requires_gradient_sync, True)  # type: ignore[arg-type]
        return self

    def _divisors(self) -> list[float]:
        """What each micro-batch's summed loss is divided by (`normalization`; an empty micro-batch's loss is 0
        either way), by the world size less when the model's reduction averages (`gradient_reduction`)."""
        acc, model, ranks = self.accumulator, self.accumulator.model, self.world_size
        divisors: list[float]
        if acc.normalization == "window":
            divisors = [max(self.count, 1)] * len(self.counts)
        else:
            divisors = [max(own, 1) * len(self.counts) * ranks for own in self.counts]
        if acc.gradient_reduction == "auto" and ranks > 1:
            averages = (not model._comm_hooks if isinstance(model, DistributedDataParallel) else
                        hasattr(model, "set_requires_gradient_sync"))
        else:
            averages = acc.gradient_reduction == "mean" and ranks > 1
        return [divisor / ranks for divisor in divisors] if averages else divisors

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Back-propagate one micro-batch's summed loss / its divisor; returns it, detached (in `counts`' order)."""
        index = len(self._losses)
        if index >= len(self.counts):
            raise UserError(f"the window was given {len(self.counts)} counts, and this is backward call "
                            f"{index + 1}: give one count per micro-batch", field="counts")
        divided = loss / self.divisors[index]
        scaler = self.accumulator.scaler
        (scaler.scale(divided) if scaler else divided).backward()
        detached = divided.detach()
        self._losses.append(detached)
        if index + 1 == len(self.counts) - 1:  # the next micro-batch is the last: its backward reduces
            self._paused_sync.close()
        if self.observer is not None:
            self.observer.after_backward(index)
        return detached

    def backward_voting(self, backward: Callable[[Any], Any], micro_batches: Sequence[Any]) -> None:
        """`backward(micro)` over `micro_batches` (a rank out of memory skips the rest), then the ranks' vote: every
        rank raises AgreedOutOfMemory if any rank ran out."""
        error = None  # the message only: the error's traceback would keep the window's tensors
        for micro in micro_batches:
            try:
                backward(micro)
            except torch.OutOfMemoryError as out_of_memory:
                error = str(out_of_memory)
                break
        failed = error is not None
        if self.world_size > 1:  # any rank out of memory splits again on all
            acc = self.accumulator
            flag = torch.tensor([int(failed)], dtype=torch.int64, device=acc.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=acc.process_group)
            failed = bool(flag.item())
        if failed:
            raise AgreedOutOfMemory(error or "out of memory on another rank")

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        """Once per window: the logged loss over every rank, then unscale, clip, step, schedule and zero."""
        self._paused_sync.close()
        if kind is not None:  # the gradients of a failed window stay for the caller to drop (or redo)
            return
        if len(self._losses) != len(self.counts):
            raise UserError(f"the window was given {len(self.counts)} counts and {len(self._losses)} backward "
                            "calls: give one count per micro-batch", field="counts")
        acc = self.accumulator
        model, optimizer, scaler = acc.model, acc.optimizer, acc.scaler
        window_loss = torch.stack(self._losses).sum()
        if self.world_size > 1:  # the logged loss is the mean over the global window
            torch.distributed.all_reduce(window_loss, group=acc.process_group)
        try:
            if scaler:
                scaler.unscale_(optimizer)
            if acc.clip_grad_norm:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), acc.clip_grad_norm)
            else:  # the norm for the caller, without clip_grad_norm_'s rescaling pass
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            self.loss, self.grad_norm = float(window_loss), float(grad_norm)
            self.finite = math.isfinite(self.loss) and math.isfinite(self.grad_norm)
            if self.observer is not None:  # the window's norm, unscaled and before clipping; the scale backward used
                self.observed = self.observer.end_window(self.grad_norm, self.finite,
                                                         scaler.get_scale() if scaler else 1.0)
            if scaler:
                scaler.step(optimizer)  # skips the update itself when fp16 gradients overflowed
                scaler.update()
                self.finite = math.isfinite(self.loss)
            elif self.finite:  # a non-finite step never touches the weights
                optimizer.step()
            if acc.scheduler is not None:
                acc.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as error:
            raise OptimizerStepOutOfMemory(str(error)) from None


def _length(micro: Any) -> int:
    if isinstance(micro, dict):
        micro = next(iter(micro.values()))
    elif isinstance(micro, tuple):
        micro = micro[0]
    return len(micro)


def split_items(items: Any, micro_batch: int) -> list[Any]:
    """`items` (a tensor, a tuple or dict of tensors cut together along dim 0, or a list) in micro-batches of
    `micro_batch`, the last one shorter when it does not divide."""
    if micro_batch < 1:
        raise UserError(f"must be >= 1 (got {micro_batch})", field="micro_batch")
    if isinstance(items, torch.Tensor):
        return list(torch.split(items, micro_batch))
    if isinstance(items, tuple):
        return list(zip(*(torch.split(part, micro_batch) for part in items), strict=True))
    if isinstance(items, dict):
        keys = list(items)
        parts = zip(*(torch.split(items[key], micro_batch) for key in keys), strict=True)
        return [dict(zip(keys, values, strict=True)) for values in parts]
    return [items[start:start + micro_batch] for start in range(0, len(items), micro_batch)]


def free_memory(holder: Any, device: torch.device) -> None:
    """After an out-of-memory error, once its frames are gone (or a model let go): the gradients of `holder` (an
    optimizer or a model; None: none) dropped, the garbage collected and (CUDA) the cached blocks handed back."""
    if holder is not None:
        holder.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def smaller_micro_batch(per_rank_batch: int, micro_batch: int) -> int | None:
    """After an out-of-memory error: the largest micro-batch <= half the current one that still divides this
    rank's share of the effective batch (so the effective batch stays exact); None below 1."""
    for candidate in range(micro_batch // 2, 0, -1):
        if per_rank_batch % candidate == 0:
            return candidate
    return None
