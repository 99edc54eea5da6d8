"""What one `train` call holds while it runs: built once by `start.start_run`, updated by each step."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.batches import DataClock, LazyMicroBatch
from ..data.loader import LoaderWatch, MicroBatchStream, default_workers, fetch_seeded
from ..data.packing import Grouping
from ..observe.noise import NoiseScale
from ..observe.outputs import MetricsLog
from ..observe.rates import StepRates
from ..observe.reference import DivergenceWatch
from ..plan.planner import Plan
from .distributed.processes import World
from .options import RunRequest
from .reporter import Reporter
from .resume import Resumed
from .setup import Setup
from .windows import micro_batch_at, padding_over, window

COUNTERS = ("samples", "tokens", "partial_windows", "skipped_nonfinite", "out_of_memory")  # this call's, summed


@dataclass(kw_only=True)
class Run:
    """A run in progress; what it is made of. Its plan and world are its setup's."""

    out: Path
    request: RunRequest
    reporter: Reporter
    setup: Setup
    train_set: Any
    size: int  # the training set's samples
    total: int  # the optimizer step this call stops after
    resumed: Resumed
    noise: NoiseScale | None
    metrics: MetricsLog
    rates: StepRates
    noise_scale_skipped_because: str | None  # why the run cannot measure it; None: it can, or was told not to
    totals_before_resume: dict  # seconds, samples and tokens of the calls before this one (zeros for a fresh run)
    divergence: DivergenceWatch
    started: float = field(default_factory=time.perf_counter)  # at the first step
    last_checkpoint: float = field(default_factory=time.perf_counter)  # at the last checkpoint (or the start)
    waited: float = 0.0  # seconds the steps waited for data
    counters: dict = field(default_factory=functools.partial(dict.fromkeys, COUNTERS, 0))
    last_record: dict = field(default_factory=dict)
    stream: MicroBatchStream | None = None
    grouping: Grouping | None = None  # data.packing sorted / packed (data/packing.py)
    lengths: torch.Tensor | None = None  # each sample's input tokens, when the data has them (text)
    summary: dict | None = None  # summary.json as computed at the last step (kept in its checkpoint)
    gates: Any = None  # the recipe's gates as the run checks them (train/gates.py); None without gates
    reference: Any = None  # the reference runs' curve (observe/reference.py); None without
    continue_with: str = ""  # the command an interrupted run prints to go on (`train`'s)

    plan: Plan = field(init=False)  # the setup's
    world: World = field(init=False)  # the setup's
    seed: int = field(init=False)  # the resumed run's (data order and dropout)
    lowered: dict = field(init=False)  # sequence length -> the micro-batch an out-of-memory error lowered it to
    workers: int = field(init=False)  # DataLoader processes: as asked, or one per free core for data read from files

    def __post_init__(self) -> None:
        self.plan, self.world = self.setup.plan, self.setup.world
        self.seed, self.lowered = self.resumed.seed, self.resumed.lowered
        self.workers = default_workers(self.train_set) if self.request.workers is None else self.request.workers

    @functools.cached_property
    def watch(self) -> LoaderWatch:
        """The data loader's watch: a warning when the steps wait for data."""
        return LoaderWatch(self.workers)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoints" / "last.pt"

    def last_checkpoint_note(self, good: bool = False) -> str:
        """`the last (good) checkpoint is PATH`, or that there is none yet (a stop before the first checkpoint)."""
        if self.checkpoint_path.is_file():
            return f"the last {'good ' if good else ''}checkpoint is {self.checkpoint_path}"
        return "no checkpoint was written yet"

    def micro_batch(self, step: int) -> int:
        """Step `step`'s micro-batch: its batch phase's, or as lowered after running out of memory."""
        return micro_batch_at(self.plan, step, self.lowered)

    def windows(self, step: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's micro-batches of `step` and whether the window is partial (the loop's and the
        loader's)."""
        return window(self.plan, self.size, step, self.seed, self.world.rank, self.micro_batch(step), self.grouping)

    def window_tokens(self, step: int) -> tuple[int, int] | None:
        """(input tokens, tokens computed with padding) of step `step`'s window over every rank."""
        if self.lengths is None:
            return None
        _, useful, computed = padding_over(self.plan, range(step, step + 1), self.seed, self.lengths, self.grouping,
                                           self.micro_batch(step))
        return useful, computed

    def open_stream(self, step: int) -> MicroBatchStream:
        self.stream = MicroBatchStream(self.train_set, lambda at: self.windows(at)[0], step, self.total,
                                       seed=self.seed, workers=self.workers,
                                       pin_memory=self.setup.device.type == "cuda")
        return self.stream

    def micro_batches(self, step: int, indices: list, clock: DataClock) -> list[LazyMicroBatch]:
        """The window's micro-batches, fetched from the stream as the step loads them."""
        take = functools.partial(self.stream.take, step)
        drawn = functools.partial(self.drawn, step)
        return [LazyMicroBatch(self.train_set, i, self.setup.device, self.setup.dtype, take, clock, step, self.seed,
                               drawn) for i in indices]

    def drawn(self, step: int, indices: torch.Tensor) -> tuple:
        """The micro-batch of `indices` fetched here with the loader's draws at `step` (to count its targets)."""
        return fetch_seeded(self.train_set, indices, self.seed, step)
