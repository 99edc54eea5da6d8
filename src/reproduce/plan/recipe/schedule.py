"""The recipe's `schedule:` section: the total length, the warm-up and the decay."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import Length, Strict


class Warmup(Length):
    """Linear warm-up from `start_lr` (or `start_factor` x lr; default 0) to the peak LR, over one of steps,
    epochs, samples, tokens, or `ratio` of the total."""

    ratio: float | None = Field(default=None, gt=0, lt=1)
    start_lr: float | None = Field(default=None, ge=0)
    start_factor: float | None = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _one_length(self) -> Warmup:
        given = self.units_given
        if self.ratio is not None and given:
            raise ValueError(f"give ratio or one of steps, epochs, samples, tokens, not both (got ratio, {given[0]})")
        if self.start_lr is not None and self.start_factor is not None:
            raise ValueError("give start_lr or start_factor, not both")
        return self

    def _allows_none(self) -> bool:
        return self.ratio is not None


class Milestones(Length):
    steps: list[int] | None = None  # type: ignore[assignment]
    epochs: list[float] | None = None  # type: ignore[assignment]
    samples: list[int] | None = None  # type: ignore[assignment]
    tokens: list[int] | None = None  # type: ignore[assignment]

    @property
    def values(self) -> list[float]:
        return list(getattr(self, self.unit))

    @model_validator(mode="after")
    def _increasing(self) -> Milestones:
        values = self.values
        if any(v < 0 for v in values) or values != sorted(set(values)):
            raise ValueError(f"{self.unit}: milestones must be increasing and >= 0 (got {values})")
        return self


DecayKind = Literal["constant", "step", "cosine", "linear", "polynomial", "plateau"]  # schedules.StepSchedule's too
PLATEAU_FIELDS = ("patience", "metric", "mode", "threshold", "threshold_mode", "cooldown")


class Decay(Strict):
    kind: DecayKind = "constant"
    milestones: Milestones | None = None
    factor: float = Field(default=0.1, gt=0, le=1, description="step decay: multiply the LR by this at each milestone")
    min_lr: float | None = Field(default=None, ge=0, description="cosine/linear/polynomial: the final LR")
    min_ratio: float | None = Field(default=None, ge=0, le=1, description="the final LR as a fraction of the peak")
    power: float = Field(default=1.0, gt=0, description="polynomial decay power")
    until: Length | None = None
    # kind plateau: torch.optim.lr_scheduler.ReduceLROnPlateau at each evaluation (docs/schedules.md)
    patience: int | None = Field(default=None, gt=0, description="plateau: evaluations without improvement before "
                                 "the LR is multiplied by factor")
    metric: str | None = Field(default=None, description="plateau: the evaluation metric watched (eval_loss, ...)")
    mode: Literal["min", "max"] | None = Field(default=None, description="plateau: min or max is better (default: "
                                               "from the metric)")
    threshold: float | None = Field(default=None, ge=0, description="plateau: the least change that counts as an "
                                    "improvement (default 1e-4)")
    threshold_mode: Literal["rel", "abs"] | None = None
    cooldown: int | None = Field(default=None, ge=0, description="plateau: evaluations to wait after a decrease")

    @model_validator(mode="after")
    def _fields_for_kind(self) -> Decay:
        plateau_given = [name for name in PLATEAU_FIELDS if getattr(self, name) is not None]
        if self.kind != "plateau" and plateau_given:
            raise ValueError(f"{plateau_given[0]}: only used by kind plateau (kind is {self.kind})")
        if self.kind == "plateau":
            for name in ("patience", "metric"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}: required for kind plateau (the paper's or your choice: evaluations "
                                     "without improvement, and the metric watched)" if name == "patience" else
                                     f"{name}: required for kind plateau (eval_loss, eval_accuracy or eval_error)")
            if self.factor >= 1:
                raise ValueError(f"factor: must be < 1 for kind plateau (got {self.factor})")
            if self.until is not None:
                raise ValueError("until: not used by kind plateau (its decreases happen at evaluations)")
        if self.kind == "step" and self.milestones is None:
            raise ValueError("milestones: required for kind step")
        if self.kind != "step" and self.milestones is not None:
            raise ValueError(f"milestones: only used by kind step (kind is {self.kind})")
        if self.min_lr is not None and self.min_ratio is not None:
            raise ValueError("give min_lr or min_ratio, not both")
        return self


class Schedule(Strict):
    warmup: Warmup | None = None
    decay: Decay = Decay()
    total: Length
