"""Timing the training step at a given micro-batch, for the throughput policy: the probe's step, repeated.

The same step as the probe's cuda and cpu trials (probe/meters.py) and the run: the recipe's model, optimizer and
precision built by `train.setup.build`, a window of `ACCUMULATED` micro-batches (one when the micro-batch is the
whole per-process batch), warm-up steps until the optimizer has stepped, then `REPEATS` timed optimizer steps. A
micro-step's time is a window's over its micro-batches (the optimizer step shared among them), as the probe's
trials report it; the median of the repeats is kept, and their spread is the noise a difference must exceed.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from ..data.batches import to_device
from ..train.setup import build
from ..train.step import optimizer_step
from .meters import ACCUMULATED, warm_up
from .workload import Workload

REPEATS = 5


def time_micro_step(workload: Workload, device: torch.device, micro_batch: int, cap: int,
                    repeats: int = REPEATS) -> tuple[float, list[float]]:
    """(median seconds of one micro-step at `micro_batch`, every repeat's) on `device`."""
    workload.prepare()
    setup = build(workload.plan, device, data=workload.data)
    count = 1 if micro_batch >= cap else ACCUMULATED
    window = [to_device(workload.batch(micro_batch), device, setup.dtype) for _ in range(count)]
    warm_up(setup, window)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tick = time.perf_counter()
        optimizer_step(setup, window)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append((time.perf_counter() - tick) / count)
    setup = window = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(seconds), seconds
