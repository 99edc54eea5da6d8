"""One optimizer step over a window of N micro-batches, exactly the paper's large-batch update: the run's
use of the library's exact window (`reproduce.Accumulator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..accumulate import Accumulator
from ..data.batches import LazyMicroBatch
from ..observe.noise import NoiseScale
from .losses import PixelLoss, SampleLoss, TokenLoss
from .setup import Setup


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


def optimizer_step(setup: Setup, micro_batches: list, noise: NoiseScale | None = None) -> StepResult:
    """One optimizer step over a window of micro-batches ((inputs, targets) on the device, or
    LazyMicroBatch); `noise` measures the gradient noise scale on the way."""
    model, loss_fn = setup.model, setup.loss
    # 1. the window's loss-bearing items, over every rank, before any backward; a lazy window's without fetching it
    # where the dataset knows them (a sample each, or counted from an index or a mask: data/segmentation.py)
    lazy = all(isinstance(m, LazyMicroBatch) for m in micro_batches)
    counts = None
    if lazy and isinstance(loss_fn, SampleLoss):
        counts = [len(m.indices) for m in micro_batches]
    elif lazy and isinstance(loss_fn, (TokenLoss, PixelLoss)):
        counts = [m.known_count() for m in micro_batches]
        counts = None if None in counts else counts
    if counts is None:
        targets = [m.targets() if isinstance(m, LazyMicroBatch) else m[1] for m in micro_batches]
        counts = [loss_fn.count(t) for t in targets]
    samples = sum(len(m.indices) for m in micro_batches) if lazy else sum(len(t) for t in targets)
    last = len(micro_batches) - 1
    loaded = None  # the micro-batch in use, kept until the next is loaded (the last: through step 3), as in one loop
    # the ranks' gradients summed (DDP: SyncCounter's SUM hook; FSDP2: a SUM)
    recipe = setup.plan.recipe
    accumulator = Accumulator(
        model, setup.optimizer, setup.scheduler, recipe.clip_grad_norm, scaler=setup.scaler,
        normalization="window" if recipe.loss is None or recipe.loss.normalization == "window-tokens" else
        "micro-batch-mean", sync_every_micro_batch=setup.sharded and recipe.batch.sharded_gradients,
        gradient_reduction="sum", device=setup.device)
    with accumulator.window(counts, samples=samples, observer=noise) as window:
        if getattr(loss_fn, "window", None) is not None:  # a loss of several terms, each over its own window count
            loss_fn.window(window.count, window.samples)

        # 2. each micro-batch's summed loss / the window's count, backward; gradients reduced on the last one only
        def backward(index: int) -> torch.Tensor:
            nonlocal loaded
            loaded = micro_batches[index]
            loaded = loaded.load() if isinstance(loaded, LazyMicroBatch) else loaded
            inputs, target = loaded
            with setup.autocast():
                loss = loss_fn(model(inputs), target)
            return window.backward(loss)

        # Under DDP the micro-batches before the last run under `no_sync` with no collective (unless DDP broadcasts
        # buffers, as for BatchNorm): a rank out of memory there skips to a vote before the last one, and all ranks
        # change the micro-batch together. Not under FSDP (its collectives in every forward would wait for it), and
        # not in the last micro-batch (DDP is reducing by then): there the run stops.
        if (setup.world.distributed and not setup.sharded and last > 0
                and not setup.model.will_sync_module_buffers()):
            window.backward_voting(backward, range(last))
        else:
            for index in range(last):
                backward(index)
        backward(last)
    # 3. leaving the window: unscale, clip, step, schedule, zero
    tokens = window.count if setup.plan.recipe.task == "language-modeling" else 0
    syncs = setup.sync_counter.take() if setup.sync_counter else None
    return StepResult(window.loss, window.grad_norm, window.count, window.samples, tokens, window.finite, syncs,
                      window.observed)
