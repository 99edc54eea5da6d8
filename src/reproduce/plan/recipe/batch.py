"""The recipe's `batch:` section: the paper's effective batch, its phases or ramp, and the hardware it ran on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import Length, Strict
from .schedule import Decay, Warmup


class BatchPhase(Length):
    """One phase of a batch that changes during training: its length (none for the last phase, which runs to the
    end of schedule.total), its effective batch and its sequence length (default: the batch's own)."""

    effective: int = Field(gt=0, description="effective batch per optimizer step in this phase, in batch.unit")
    sequence_length: int | None = Field(default=None, gt=0, description="tokens per sequence in this phase")
    # A schedule of its own (docs/schedules.md): the LR restarts at the phase's first step, lengths in its own units
    lr: float | None = Field(default=None, gt=0, description="this phase's peak LR (default: optimizer.lr)")
    warmup: Warmup | None = None
    decay: Decay | None = None

    def _allows_none(self) -> bool:
        return True  # the last phase has no length; Batch checks which phases need one

    @property
    def has_schedule(self) -> bool:
        """Whether the phase starts a schedule of its own (lr, warmup or decay given)."""
        return self.lr is not None or self.warmup is not None or self.decay is not None


class BatchRamp(Strict):
    """A batch-size warm-up (Brown et al. 2020, sec. 2.3): the effective batch grows linearly, with the data read,
    from `start` to batch.effective over `length`; each step's batch is rounded down to whole micro-batches."""

    start: int = Field(gt=0, description="the first step's effective batch, in batch.unit")
    length: Length
    granularity: int | None = Field(
        default=None, gt=0, description="each step's batch is a multiple of this, in batch.unit (default: one "
        "sequence per process); fixed by the recipe, so the ramp does not depend on the micro-batch")


class Batch(Strict):
    """The paper's effective batch and the hardware it was computed on.

    `phases` or `ramp` make the batch change during training; `effective` and `sequence_length` are then the
    paper's main batch (one of the phases, or the ramp's target), which `devices` and `per_device` describe.
    """

    effective: int = Field(gt=0, description="effective batch per optimizer step, in `unit`")
    unit: Literal["samples", "tokens"] = "samples"
    sequence_length: int | None = Field(default=None, gt=0, description="tokens per sequence")
    devices: int | None = Field(default=None, gt=0, description="data-parallel workers in the paper")
    per_device: int | None = Field(default=None, gt=0, description="per-device batch (also the BN batch)")
    accumulation: int | None = Field(default=None, gt=0, description="accumulation steps the paper used")
    device: str | None = None
    sharding: Literal["none", "fsdp"] = Field(
        default="none", description="fsdp: parameters, gradients and optimizer state sharded over the devices"
    )
    sharded_gradients: bool = Field(
        default=False, description="fsdp: reduce-scatter the gradients after every micro-batch, so they stay sharded "
        "through the accumulation window (one reduce-scatter per micro-batch instead of per window)",
    )
    offload: Literal["none", "cpu"] = Field(
        default="none", description="fsdp: cpu keeps parameters, gradients and optimizer state in CPU memory "
        "(FSDP2's CPUOffloadPolicy)",
    )
    phases: list[BatchPhase] | None = Field(default=None, description="the batch in phases (BERT's 128 then 512)")
    ramp: BatchRamp | None = Field(default=None, description="a linear batch-size warm-up (GPT-3)")

    @model_validator(mode="after")
    def _consistent(self) -> Batch:
        if self.unit == "tokens" and self.effective % self.token_length:  # (token_length refuses a missing length)
            raise ValueError(
                f"effective: {self.effective} tokens is not a whole number of sequences of "
                f"sequence_length {self.sequence_length}"
            )
        if self.devices is not None and self.per_device is not None:
            product = self.devices * self.per_device * (self.accumulation or 1)
            if product != self.sequences:
                shown = f"{self.devices} x {self.per_device}" + (
                    f" x {self.accumulation}" if self.accumulation else ""
                )
                raise ValueError(
                    f"devices x per_device{' x accumulation' if self.accumulation else ''} = {shown} = "
                    f"{product}, but effective is {self.sequences} {self.count_unit}; state the paper's "
                    "accumulation steps or correct the numbers"
                )
        if self.sharding != "fsdp" and self.offload != "none":
            raise ValueError(f"offload: {self.offload} offloads FSDP2's sharded parameters, gradients and optimizer "
                             "state, and this batch does not shard (sharding none); set sharding: fsdp (with 2 or "
                             "more processes), or leave offload out")
        if self.sharding != "fsdp" and self.sharded_gradients:
            raise ValueError("sharded_gradients: keeps FSDP2's gradients sharded through the accumulation window, and "
                             "this batch does not shard (sharding none); set sharding: fsdp, or leave "
                             "sharded_gradients out")
        if self.phases is not None:
            self._check_phases(self.phases)
        if self.ramp is not None:
            self._check_ramp(self.ramp)
        return self

    def _check_phases(self, phases: list[BatchPhase]) -> None:
        if self.ramp is not None:
            raise ValueError("phases: give phases or ramp, not both")
        if len(phases) < 2:
            raise ValueError("phases: give two phases or more (one phase is batch.effective alone)")
        for index, phase in enumerate(phases):
            where = f"phases.{index}"
            last = index == len(phases) - 1
            given = phase.units_given
            if last and given:
                raise ValueError(f"{where}.{given[0]}: the last phase runs to the end of schedule.total; give it no "
                                 "length")
            if not last and len(given) != 1:
                raise ValueError(f"{where}: give its length: exactly one of steps, epochs, samples, tokens (got "
                                 f"{', '.join(given) or 'none'})")
            if phase.sequence_length is not None and self.sequence_length is None:
                raise ValueError(f"{where}.sequence_length: needs batch.sequence_length (the length of the other "
                                 "phases and of the main batch)")
            length = phase.sequence_length or self.sequence_length
            if self.unit == "tokens" and phase.effective % (phase.sequence_length or self.token_length):
                raise ValueError(f"{where}.effective: {phase.effective} tokens is not a whole number of sequences "
                                 f"of {length}")
            self.check_token_lengths({f"{where}.tokens": phase})
            self._check_phase_schedule(phase, where, index)
        if not any((p.effective, p.sequence_length or self.sequence_length) == (self.effective, self.sequence_length)
                   for p in phases):
            shown = ", ".join(f"{p.effective}" + (f" at {p.sequence_length or self.sequence_length} tokens"
                                                  if self.sequence_length else "") for p in phases)
            raise ValueError(
                f"effective: {self.effective}" + (f" at sequence_length {self.sequence_length}" if self.sequence_length
                                                  else "")
                + f" is none of the phases' batches ({shown}); batch.effective states the paper's main batch, one of "
                "its phases"
            )

    def _check_phase_schedule(self, phase: BatchPhase, where: str, index: int) -> None:
        """A phase's own schedule (lr, warmup, decay): from the second phase on, lengths it can count."""
        if not phase.has_schedule:
            return
        if index == 0:
            given = next(name for name in ("lr", "warmup", "decay") if getattr(phase, name) is not None)
            raise ValueError(f"{where}.{given}: the first phase's schedule is optimizer.lr and schedule.warmup / "
                             "decay; give a phase its own from the second phase on")
        decay = phase.decay
        if decay is not None and decay.kind == "plateau":
            raise ValueError(f"{where}.decay.kind: plateau applies to the whole run (schedule.decay), not to a phase")
        self.check_token_lengths({f"{where}.warmup.tokens": phase.warmup,
                                  f"{where}.decay.until.tokens": decay.until if decay else None,
                                  f"{where}.decay.milestones.tokens": decay.milestones if decay else None})

    def _check_ramp(self, ramp: BatchRamp) -> None:
        if ramp.start >= self.effective:
            raise ValueError(f"ramp.start: {ramp.start} must be below the batch it ramps up to, effective "
                             f"{self.effective}")
        if self.unit == "tokens" and ramp.start % self.token_length:
            raise ValueError(f"ramp.start: {ramp.start} tokens is not a whole number of sequences of "
                             f"{self.sequence_length}")
        self.check_token_lengths({"ramp.length.tokens": ramp.length})
        if ramp.granularity is not None and self.unit == "tokens" and ramp.granularity % self.token_length:
            raise ValueError(f"ramp.granularity: {ramp.granularity} tokens is not a whole number of sequences of "
                             f"{self.sequence_length}")
        if ramp.granularity is not None and ramp.granularity >= self.effective:
            raise ValueError(f"ramp.granularity: {ramp.granularity} must be below the batch it ramps up to, "
                             f"effective {self.effective}")

    def check_token_lengths(self, lengths: dict[str, Length | None]) -> None:
        """A length counted in tokens needs batch.sequence_length: without one, the first such of `lengths` (by the
        name its message gives) is refused."""
        for name, length in lengths.items():
            if self.sequence_length is None and length is not None and length.tokens is not None:
                raise ValueError(f"{name}: counted in tokens, which needs batch.sequence_length")

    @property
    def sequences(self) -> int:
        """The effective batch in samples (sequences for token batches)."""
        return self.effective // self.token_length if self.unit == "tokens" else self.effective

    def phase_sequences(self, phase: BatchPhase) -> int:
        """A phase's effective batch in samples (sequences for token batches)."""
        return phase.effective // (phase.sequence_length or self.token_length) if self.unit == "tokens" else \
            phase.effective

    @property
    def token_length(self) -> int:
        """The sequence length a batch in tokens is counted in (`_consistent` asks it first, so a batch in tokens
        without one is refused with this message)."""
        if self.sequence_length is None:
            raise ValueError("sequence_length: required when unit is tokens (the batch is counted in tokens)")
        return self.sequence_length

    @property
    def sequence_lengths(self) -> list[int | None]:
        """The distinct sequence lengths the batch takes during training, shortest first (the main one alone
        without phases)."""
        lengths = {self.sequence_length} | {p.sequence_length or self.sequence_length for p in self.phases or []}
        return sorted(lengths, key=lambda length: length or 0)

    @property
    def count_unit(self) -> Literal["samples", "sequences"]:
        return "sequences" if self.unit == "tokens" else "samples"
