"""Whole optimizer steps of any exact split, timed as `run` executes them, for the throughput policy.

One model, optimizer and precision, built once by `train.setup.build`, serves every split (weight values do not
change a step's time). A step of m x N is train/step.py's `optimizer_step` over N `LazyMicroBatch`es of m, with the
noise scale measured and CPU denormals flushed, as in the run; every split's k-th step takes the same samples,
grouped as `data.packing` groups them. The clock runs from the window's making to the update's end (CUDA
synchronised). A split out of memory is `NotTimed`, its memory freed.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from ..accumulate import free_memory
from ..data.batches import LazyMicroBatch
from ..data.packing import Grouped, group, grouping_of
from ..models.varlen import runs_varlen
from ..observe.noise import NoiseScale
from ..plan.recipe import default_packing
from ..probe.workload import Workload
from ..train.setup import build
from ..train.step import optimizer_step
from .splits import NotTimed


class SplitSteps:
    """`steps(micro_batch, count) -> seconds`: `count` whole optimizer steps of that split, timed. Close when done."""

    def __init__(self, workload: Workload, device: torch.device, per_rank_batch: int, noise_scale: bool = True):
        workload.prepare()
        self.device, self.per_rank = device, per_rank_batch
        self.flushed = device.type == "cpu" and torch.set_flush_denormal(True)
        self.setup = build(workload.plan, device, data=workload.data)
        self.setup.model.train()
        self.noise = NoiseScale(self.setup) if noise_scale else None
        self.dataset = workload.data.train
        recipe = workload.plan.recipe  # data.packing sorted / packed: the windows grouped as the run groups them
        self.grouping = grouping_of(recipe, self.dataset, workload.plan.micro_batch, runs_varlen(self.setup.model),
                                    way=recipe.data.packing or default_packing(recipe))
        if self.grouping is not None:
            self.dataset = Grouped(self.dataset, self.grouping)
        self.order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(0))
        self.taken: dict[int, int] = defaultdict(int)  # windows each split has run (set back: ways.py)

    def samples(self, k: int) -> torch.Tensor:
        """The sample indices of the k-th window (every split's k-th window takes the same samples)."""
        return self.order[(k * self.per_rank + torch.arange(self.per_rank)) % len(self.order)]

    def window(self, micro_batch: int) -> list[LazyMicroBatch]:
        k = self.taken[micro_batch]
        self.taken[micro_batch] += 1
        indices = self.samples(k)
        groups = (group(indices, self.grouping, self.grouping.budget_at(micro_batch)) if self.grouping else
                  torch.split(indices, micro_batch))
        return [LazyMicroBatch(self.dataset, i, self.device, self.setup.dtype) for i in groups]

    def __call__(self, micro_batch: int, count: int) -> float:
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.synchronize(self.device)
            tick = time.perf_counter()
            for _ in range(count):
                optimizer_step(self.setup, self.window(micro_batch), self.noise)
            if cuda:
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - tick
        except torch.OutOfMemoryError:
            pass  # the error's frames (activations) go with the except block, before the memory is freed
        free_memory(self.setup.optimizer, self.device)
        raise NotTimed(f"out of memory on {self.device} while timing {micro_batch} x {self.per_rank // micro_batch}")

    def close(self) -> None:
        if self.noise is not None:
            self.noise.close()
        if self.flushed:
            torch.set_flush_denormal(False)
        self.setup = self.noise = None
        free_memory(None, self.device)
