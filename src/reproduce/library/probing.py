"""The largest micro-batch of the user's own training step: the CLI probe's search and its `cpu` and `cuda`
meters around `step(micro_batch)`, one optimizer step of the user's model, loss and optimizer (docs/library.md).
Each trial runs the step once to warm up (the optimizer's state is made then), then measured; one that runs out of
memory does not fit, and its gradients are dropped. The `estimate` meter needs a recipe's model: not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..accumulate import free_memory
from ..errors import UserError
from ..plan.units import parse_size
from ..probe.meters import ACCUMULATED, CpuMeter, CudaMeter, Meter
from ..probe.runner import ProbeResult, probe_result
from ..probe.search import Measurement, search
from ..probe.tracker import MemoryTracker

__all__ = ["PROBE_WINDOW", "probe_step"]

PROBE_WINDOW = ACCUMULATED  # micro-batches in the window a trial measures, as `reproduce probe`'s


class _UserStep(Meter):
    """A meter's trial made the user's step: run once to warm up (the optimizer's state is made then), then
    measured; after one out of memory, the gradients it left dropped."""

    step: Callable[[int], Any]
    model: Any
    optimizer: Any

    def prepare(self) -> None:
        """Nothing to build: the step is the user's."""

    def trial(self, micro_batch: int, device: torch.device, tracker: MemoryTracker | None = None
              ) -> tuple[Callable[[], object], int]:
        if tracker is not None:  # the cpu meter's
            tracker.charge(self.held())
        self.step(micro_batch)
        return lambda: self.step(micro_batch), PROBE_WINDOW

    def held(self) -> Iterable[torch.Tensor]:
        """What exists before a trial and stays through it: the parameters, buffers, gradients, optimizer state."""
        tensors: list[torch.Tensor] = []
        if self.model is not None:
            tensors += [*self.model.parameters(), *self.model.buffers()]
            tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
        return tensors

    def release(self, device: torch.device, failed: bool) -> None:
        if failed:
            free_memory(self.optimizer if self.optimizer is not None else self.model, device)


class StepCpuMeter(_UserStep, CpuMeter):
    """The cpu meter around the user's step: tensors counted by `MemoryTracker`, the budget enforced by it."""


class StepCudaMeter(_UserStep, CudaMeter):
    """The cuda meter around the user's step: the caching allocator's own counters."""


def probe_step(step: Callable[[int], Any], *, cap: int, model: Any = None, optimizer: Any = None,
          memory: str | int | None = None, meter: str = "auto", headroom: float = 0.1,
          time_steps: bool = True, on_trial: Callable[[Measurement], None] | None = None) -> ProbeResult:
    """The largest micro-batch in [1, `cap`] at which `step(micro_batch)` fits `memory` (bytes or a size;
    cuda meter default: this GPU's free memory) less `headroom`. `model` and `optimizer`: counted by the cpu meter, and
    their gradients dropped after a trial out of memory. `meter`: cpu, cuda, or auto. Returns what
    `reproduce probe --json` prints."""
    if not 0 <= headroom < 1:
        raise UserError(f"expected a fraction in [0, 1), such as 0.1 (got {headroom:g})", field="headroom")
    if cap < 1:
        raise UserError(f"must be >= 1 (got {cap})", field="cap")
    if meter == "auto":
        meter = "cuda" if torch.cuda.is_available() else "cpu"
    if meter not in ("cpu", "cuda"):
        raise UserError(f"expected cpu, cuda or auto (got {meter!r}); the estimate meter needs a recipe's model: "
                        "use `reproduce.plan_recipe(recipe, memory=..., meter='estimate')`", field="meter")
    budget = parse_size(memory) if isinstance(memory, str) else memory
    if meter == "cpu" and budget is None:
        raise UserError("the cpu meter needs a budget: give `memory` SIZE", field="memory")
    kind = StepCpuMeter if meter == "cpu" else StepCudaMeter
    chosen = kind(None, budget, headroom, time_steps, cap)  # type: ignore[arg-type]
    chosen.step, chosen.model, chosen.optimizer = step, model, optimizer
    chosen.notes.append("the user's own step (reproduce.probe_step)")
    try:
        found = search(chosen.measure, chosen.limit_bytes, cap, on_trial)
    finally:
        chosen.close()
    return probe_result(found, chosen, headroom, None, recipe_path=None, gpu=None, data="the user's step",
                        world_size=1)
