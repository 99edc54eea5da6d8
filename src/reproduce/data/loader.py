"""Micro-batches from a `torch.utils.data.DataLoader` (workers, pinned memory, prefetching), still exact: the
sampler yields one key per micro-batch in the order `train.windows.window` gives this rank's, and `MicroBatches`
fetches each in a worker. An item's random draws (augmentation) are seeded by (run seed, optimizer step, sample
index) alone: the same whatever the workers, micro-batch or world size, and after a resume.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..errors import UserError
from .batches import collate, fetch

PREFETCH_PER_WORKER = 2  # micro-batches each worker keeps ready ahead of the loop (DataLoader's prefetch_factor)
MAX_DEFAULT_WORKERS = 8
EVAL_STEP = -1  # the step number of evaluation keys (their items are drawn with this in the seed)


# a micro-batch: the optimizer step it belongs to, and its sample indices (a tuple: cheap to pickle)
Key = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class Failure:
    """A user error raised in a worker, carried back whole (DataLoader would add its traceback)."""

    lines: tuple[str, ...]


@contextmanager
def seeded_samples() -> Iterator[Callable[[int, int, int], None]]:
    """`seed_sample(seed, step, index)` seeds torch, random and numpy; the process's generators are restored."""

    def seed_sample(seed: int, step: int, index: int) -> None:
        value = (seed * 1_000_003 + (step + 2) * 998_244_353 + index * 2_654_435_761) % (2**63 - 1)
        torch.default_generator.manual_seed(value)
        random.seed(value)
        np.random.seed(value % 2**32)

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield seed_sample
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class MicroBatches(Dataset):
    """The training set one micro-batch at a time: item `key` is the collated (inputs, targets) of its indices."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed
        self.per_item = not (isinstance(dataset, TensorDataset) or hasattr(dataset, "batch"))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> tuple[Key, Any]:
        return key, self.get(key[0], torch.tensor(key[1], dtype=torch.long))

    def get(self, step: int, indices: torch.Tensor) -> Any:
        try:
            if not self.per_item:
                return fetch(self.dataset, indices)
            items = []
            with seeded_samples() as seed_sample:
                for index in indices.tolist():
                    seed_sample(self.seed, step, index)
                    items.append(self.dataset[index])
            return collate(items)
        except UserError as error:
            return Failure(tuple(error.lines))


def fetch_seeded(dataset: Any, indices: torch.Tensor, seed: int, step: int = 0) -> tuple[Any, Any]:
    """The micro-batch of `indices` with the draws the run's loader makes at `step` (verify)."""
    _, batch = MicroBatches(dataset, seed)[step, tuple(indices.tolist())]
    if isinstance(batch, Failure):
        raise UserError(*batch.lines)
    return batch


def window_keys(windows: Callable[[int], list[torch.Tensor]], first_step: int, end_step: int
                ) -> Iterator[Key]:
    """The loader's sampler: this rank's micro-batch keys for steps `first_step` .. `end_step - 1`, in order."""
    for step in range(first_step, end_step):
        for indices in windows(step):
            yield step, tuple(indices.tolist())


def _as_is(item: Any) -> Any:
    return item


def _ignore_stop_signals(worker_id: int) -> None:
    """Workers leave SIGINT / SIGTERM to the run, which finishes its step, checkpoints and stops them itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(dataset: Any, keys: Iterable[Key], seed: int, workers: int, pin_memory: bool) -> DataLoader:
    return DataLoader(
        MicroBatches(dataset, seed), batch_size=None, sampler=keys, num_workers=workers, collate_fn=_as_is,
        pin_memory=pin_memory, prefetch_factor=PREFETCH_PER_WORKER if workers else None,
        worker_init_fn=_ignore_stop_signals if workers else None,
        # its own generator: creating an iterator then draws nothing from the global one (dropout's)
        generator=torch.Generator().manual_seed(seed),
    )


class MicroBatchStream:
    """This rank's micro-batches from `first_step` on, fetched by `workers` processes (0: in this process)."""

    def __init__(self, dataset: Any, windows: Callable[[int], list[torch.Tensor]], first_step: int, end_step: int,
                 *, seed: int, workers: int, pin_memory: bool):
        self.closed = False
        self.iterator: Iterator | None = None
        # no workers, nothing to pin: called directly (a DataLoader adds 0.1 ms, 15% of the digits MLP's step)
        self.direct = MicroBatches(dataset, seed) if workers == 0 and not pin_memory else None
        if self.direct is None:
            keys = window_keys(windows, first_step, end_step)
            self.iterator = iter(make_loader(dataset, keys, seed, workers, pin_memory))

    def take(self, step: int, indices: torch.Tensor) -> tuple[Any, Any]:
        if self.closed:
            raise RuntimeError("the micro-batch stream is closed")
        if self.direct is not None:
            batch = self.direct.get(step, indices)
        else:
            (delivered, keyed), batch = next(self.iterator)
            if delivered != step or keyed != tuple(indices.tolist()):
                raise RuntimeError(
                    f"the loader delivered step {delivered}'s micro-batch where step {step}'s was expected")
        if isinstance(batch, Failure):
            raise UserError(*batch.lines)
        return batch

    def close(self) -> None:
        self.closed, self.iterator = True, None  # the multiprocessing iterator shuts its workers down when released


def eval_batches(dataset: Any, batch: int, *, workers: int, pin_memory: bool, seed: int = 0) -> Iterator:
    size = len(dataset)
    keys = [(EVAL_STEP, tuple(range(start, min(start + batch, size)))) for start in range(0, size, batch)]
    for _, value in make_loader(dataset, keys, seed, workers, pin_memory):
        if isinstance(value, Failure):
            raise UserError(*value.lines)
        yield value


def cpu_share() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def default_workers(dataset: Any) -> int:
    """Loader processes by default: none for items that are slices of memory, else one per CPU core this process
    has (its share under torchrun) less one, at most 8."""
    if isinstance(dataset, (TensorDataset, list, tuple)) or getattr(dataset, "in_memory", False):
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, cpu_share() - 1))


class LoaderWatch:
    """Warns once when the steps after the first wait for data more than `threshold` of their time."""

    def __init__(self, workers: int, threshold: float = 0.10, minimum_steps: int = 3):
        self.workers, self.threshold, self.minimum_steps = workers, threshold, minimum_steps
        self.steps, self.waited, self.elapsed, self.warned, self.first = 0, 0.0, 0.0, False, None

    def update(self, step: int, data_seconds: float, seconds: float) -> str | None:
        if self.first is None:
            self.first = step
            return None
        self.steps += 1
        self.waited += data_seconds
        self.elapsed += seconds
        share = self.waited / self.elapsed if self.elapsed > 0 else 0.0
        if self.warned or self.steps < self.minimum_steps or share <= self.threshold:
            return None
        self.warned = True
        return (
            f"warning: the loader is the bottleneck: steps {self.first + 1}-{step} waited for data {share:.0%} of "
            f"their time ({self.waited:.2f} s of {self.elapsed:.2f} s; data_seconds in metrics.jsonl) with "
            f"`workers` {self.workers}; more workers, or faster storage or decoding, would keep the device busy"
        )
