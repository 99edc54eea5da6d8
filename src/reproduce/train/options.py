"""What a run is asked to do beyond its plan: `train(plan, out, RunOptions(...))`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .reporter import Reporter

if TYPE_CHECKING:
    from ..data import Datasets


@dataclass(frozen=True)
class RunOptions:
    """The options of one `train` call; every one has the default `reproduce run` gives it."""

    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    max_steps: int | None = None  # stop after this optimizer step (counted from the start of the run)
    resume: bool = False  # continue the run in `out` from its checkpoint
    force: bool = False  # replace another run's outputs in `out`
    seed: int | None = None  # None: the recipe's (on resume: the run's own)
    checkpoint_every: int | None = None  # optimizer steps; None: every CHECKPOINT_SECONDS of wall time
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is not finite instead of stopping
    dtype: torch.dtype = torch.float32
    reporter: Reporter | None = None  # None: silent
    data: Datasets | None = None  # the datasets (`data.build_data`); None: built from the recipe
    workers: int | None = None  # DataLoader processes; None: `data.loader.default_workers`, 0: this process
    noise_scale: bool = True  # measure the gradient noise scale (observe/noise.py); it never changes the weights
    continue_with: str | None = None  # the command an interrupted run prints to continue
    stop_on_divergence: bool = False  # stop at the divergence warning instead of going on
    merged: bool = False  # also write merged/: the LoRA adapters merged into the base, a Hugging Face folder
    accept_gates: tuple[str, ...] = ()  # gates whose miss goes on (train/gates.py)
    resume_from: str | None = None  # with resume: the gate whose kept checkpoint the run starts from; None: last.pt
    reference: tuple[str, ...] = ()  # earlier runs of the recipe, whose curve this one follows (observe/reference.py)

    def replace(self, **changes: Any) -> RunOptions:
        """These options with `changes` (a frozen dataclass: `dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
