"""Telling a diverging run: one warning line, with the step, when the loss leaves its starting value behind.

A loss that is not finite diverged at once. A finite loss diverged when it stays above its first value (the
loss of optimizer step 1, before any update) times `FACTOR` for `STEPS` optimizer steps in a row: a spike that
comes back down within fewer steps is not counted. The run goes on unless `reproduce run --stop-on-divergence`.
No torch here: the watch sees each step's loss and keeps its state in the checkpoint, so a resumed run compares
with the first loss of the whole run.
"""

from __future__ import annotations

import math

FACTOR = 2.0  # the loss at twice its starting value ...
STEPS = 10  # ... for this many optimizer steps in a row


class DivergenceWatch:
    """Each step's loss in; a warning (once per run) out when the run diverges."""

    def __init__(self, factor: float = FACTOR, steps: int = STEPS):
        self.factor, self.steps = factor, steps
        self.first_loss: float | None = None
        self.above = 0  # steps in a row above factor x first_loss
        self.diverged: dict | None = None  # {"step", "reason"} once it has

    def update(self, step: int, loss: float) -> str | None:
        """`step`: 1-based optimizer step. The warning text the first time the run diverges, else None."""
        if self.diverged is not None:
            return None
        if not math.isfinite(loss):
            return self._diverge(step, f"the loss is not finite ({loss}) at optimizer step {step}")
        if self.first_loss is None:
            self.first_loss = loss
            return None
        self.above = self.above + 1 if loss > self.factor * self.first_loss else 0
        if self.above >= self.steps:
            return self._diverge(
                step, f"the loss has stayed above {self.factor:g}x its first value ({self.first_loss:.4g}) for "
                f"{self.steps} optimizer steps, up to {loss:.4g} at step {step}")
        return None

    def _diverge(self, step: int, reason: str) -> str:
        self.diverged = {"step": step, "reason": reason}
        return f"the run is diverging: {reason}"

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "above": self.above, "diverged": self.diverged}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss, self.above, self.diverged = state.get("first_loss"), state.get("above", 0), state.get(
            "diverged")

    @classmethod
    def from_records(cls, records: list[dict]) -> DivergenceWatch:
        """The watch as it stood after the steps in metrics.jsonl (for a checkpoint that holds no watch state)."""
        watch = cls()
        for record in records:
            if "loss" in record and "step" in record:
                watch.update(record["step"], record["loss"])
        return watch
