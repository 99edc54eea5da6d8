"""What a run tells as it goes, as data the trainer composes and a reporter only shows (the CLI's renderers,
the trackers): the start, step records and end, the interface, and `Reporters`, several consumers side by side.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from ..plan.gates import outcome_line
from ..plan.memory_options import memory_summary
from ..plan.phases import phase_lines
from ..plan.planner import Plan
from ..plan.reported import reported_line


@dataclass(frozen=True)
class RunStart:
    """A run's start, as lines to show: the split, the throughput policy's reason, the batch phases, the
    model's setup (sharding, weights, parameters, memory knobs), then the steps to train."""

    plan: Plan  # for the trackers, which record it (observe/trackers.py); a reporter shows the lines below
    total_steps: int
    first_step: int
    batch: str
    throughput: list[str]
    phases: list[str]
    sharding: str | None
    weights: str | None
    parameters: tuple[int, int] | None  # (all, those that train), counted on the model that trains
    memory: list[str]
    training: str
    rate_unit: str  # what the progress bar counts per second
    accumulation_steps: int


def run_start(plan: Plan, total_steps: int, first_step: int, parameters: tuple[int, int] | None = None) -> RunStart:
    """The lines a run starts with, from its plan, the steps it trains and its model's parameters."""
    phases = phase_lines(plan.segments, plan.world_size, plan.unit)
    batch = (("main batch: " if phases else "")
             + f"micro {plan.micro_batch} x accumulation {plan.accumulation_steps} x world {plan.world_size} = "
             f"{plan.effective_batch} {plan.unit} per step"
             + (f" ({plan.effective_tokens} tokens)" if plan.effective_tokens else "")
             + ("" if plan.exact else f", not the paper's {plan.paper_effective_batch}: lr {plan.lr:.6g} "
                f"({plan.lr_scaling.rule})"))
    throughput: list[str] = []
    if plan.throughput:  # --policy throughput: why this split (throughput/policy.py)
        cost = plan.throughput.cost_line()
        throughput = [f"`policy` throughput: {plan.throughput.reason}", *([cost] if cost else [])]
    recipe = plan.recipe
    sharding = (f"sharding: fsdp (FSDP2: parameters, gradients and optimizer state split over {plan.world_size} "
                "processes)" if recipe.batch.sharding == "fsdp" else None)
    weights = plan.weights.line(recipe.model.builtin or recipe.model.factory) if plan.weights is not None else None
    where = f", resuming after step {first_step}" if first_step else ""
    text = recipe.data.text_columns or recipe.data.packing in ("sorted", "packed")
    return RunStart(
        plan=plan, total_steps=total_steps, first_step=first_step, batch=batch, throughput=throughput, phases=phases,
        sharding=sharding, weights=weights, parameters=parameters,
        memory=[*plan.memory_notes, *(f"memory: {knob}" for knob in memory_summary(recipe))],
        training=f"training {total_steps} optimizer steps{where}",
        rate_unit=("tokens/s" if recipe.batch.sequence_length else "useful tokens/s" if text else f"{plan.unit}/s"),
        accumulation_steps=plan.accumulation_steps)


@dataclass
class StepRecord:
    """Optimizer step `step`'s record (train/run_state.step_record); `line()` is its metrics.jsonl line."""

    step: int
    epoch: float
    lr: float
    loss: float
    grad_norm: float
    samples: int
    tokens: int
    items: int  # the window's loss-bearing items, over every rank
    micro_batch: int
    accumulation_steps: int
    micro_batches: int  # (= accumulation_steps: metrics.jsonl has both names)
    world_size: int
    partial: bool
    skipped: bool  # not finite
    seconds: float
    data_seconds: float
    peak_memory_bytes: int | None
    padding: dict = field(default_factory=dict)  # useful_tokens, padded_tokens: text whose lengths are known
    rates: dict = field(default_factory=dict)  # observe/rates.StepRates.fields
    grad_syncs: int | None = None
    phase: dict = field(default_factory=dict)  # phase, effective_batch, sequence_length: with batch phases
    noise: dict = field(default_factory=dict)  # the noise scale's fields (observe/noise.py)
    evaluation: dict = field(default_factory=dict)  # eval_* and plateau_lr, at an evaluation
    gates: dict | None = None  # gate name -> status, at a gate's step (train/gates.py)

    def line(self) -> dict:
        """The fields above in their order (those every record has: no default), a group only where it has values."""
        line = {f.name: getattr(self, f.name) for f in fields(self) if f.default is MISSING
                and f.default_factory is MISSING}
        line.update(self.padding)
        line.update(self.rates)
        if self.grad_syncs is not None:
            line["grad_syncs"] = self.grad_syncs
        line.update(self.phase)
        line.update(self.noise)
        line.update(self.evaluation)
        if self.gates is not None:
            line["gates"] = self.gates
        return line


def loss_text(value: float) -> str:
    """A loss with five significant digits: 1.7053, 0.15103, 2.1e-05 (fixed decimals would print 0.0000)."""
    return f"{value:.5g}"


@dataclass(frozen=True)
class RunEnd:
    """A finished run: summary.json (`summary`, as written) and the lines it ends with, to show."""

    summary: dict
    done: str  # its steps and time, the final loss and evaluation, the data's wait
    reported: list[str]  # the paper's values beside the run's
    reference: str | None  # the curve against the reference runs' (observe/reference.py)
    noise: str | None  # the noise scale's verdict (None: said at the start, or not measured)
    outputs: str  # where its outputs are
    plot: str | None  # the loss plot (observe/outputs.loss_svg)


def run_end(summary: dict, out: Path, skip_nonfinite: bool) -> RunEnd:
    """The lines a finished run ends with, from its summary."""
    reference, noise = summary.get("reference"), summary.get("noise_scale")
    folders = "".join(f", {name}/" for name in ("adapter", "merged") if summary.get(name))  # (models/weights.py)
    return RunEnd(
        summary=summary, done=done_line(summary, skip_nonfinite),
        reported=[reported_line(row) for row in summary.get("reported") or []],
        reference=reference_line(reference) if reference else None,
        noise=f"noise scale: {noise['sentence']}" if noise and not noise.get("noted") else None,
        outputs=f"outputs in {out}: plan.yaml, metrics.jsonl, model.pt, summary.json, checkpoints/last.pt{folders}",
        plot=summary.get("plot") or None)


def reference_line(reference: dict) -> str:
    """`reference: 30 steps compared with 3 runs (band: ...): all within, at most 0.38 of the band`."""
    runs = len(reference["runs"])
    line = (f"reference: {reference['metric']} at {reference['compared']} steps compared with {runs} "
            f"run{'s' if runs > 1 else ''} (band {reference['band']}): ")
    if reference["within"]:
        worst = reference.get("worst")
        return line + "all within" + (f", at most {worst:.2g} of the band" if worst is not None else "")
    return line + f"{reference['outside']} outside, the first at step {reference['first_outside']}"


def done_line(summary: dict, skip_nonfinite: bool) -> str:
    """The line a finished run prints: its steps and time, the final loss and evaluation, the data's wait."""
    final = summary["final"]
    line = f"done: {summary['steps']} steps in {summary['seconds']:.1f}s"
    this_call = summary.get("this_call") or {}
    if summary.get("resumed_from_step"):  # the whole run, then what this call added
        line += f" ({this_call['steps']} in this call, {this_call['seconds']:.1f}s)"
    line += f", final loss {loss_text(final['loss'])}"
    if skip_nonfinite:  # (counted in this call)
        skipped = summary.get("skipped_nonfinite", 0)
        line += f", skipped {skipped} non-finite step{'' if skipped == 1 else 's'}"
    if "eval_accuracy" in final:
        line += f", eval accuracy {final['eval_accuracy']:.4f}"
    if "eval_miou" in final:
        line += f", eval mIoU {final['eval_miou']:.4f}, pixel accuracy {final['eval_pixel_accuracy']:.4f}"
    if "eval_loss" in final:
        line += f", eval loss {loss_text(final['eval_loss'])}"
    if summary.get("data_share") is not None:
        workers = f"{summary['workers']} worker{'' if summary['workers'] == 1 else 's'}"
        line += f"; waited for data {summary['data_share']:.0%} of the time ({workers})"
    return line


class Reporter(Protocol):
    def start(self, start: RunStart) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, end: RunEnd) -> None: ...


class SilentReporter(Reporter):
    """Says nothing (the Protocol's methods, inherited, do nothing)."""


class Reporters:
    """Each consumer in turn (the trackers, then the CLI's renderer), none calling another; the lines a
    consumer returns are handed to every consumer as messages."""

    def __init__(self, *consumers: Any):
        self.consumers = consumers

    def _each(self, method: str, value: Any) -> None:
        for consumer in self.consumers:
            for line in getattr(consumer, method)(value) or ():
                self.message(line)

    start = functools.partialmethod(_each, "start")
    step = functools.partialmethod(_each, "step")
    finish = functools.partialmethod(_each, "finish")

    def message(self, text: str) -> None:
        for consumer in self.consumers:
            consumer.message(text)

    def gate(self, event: dict) -> None:
        """A gate's outcome: an event to a consumer that takes one, its line to the others."""
        for consumer in self.consumers:
            if hasattr(consumer, "gate"):
                for line in consumer.gate(event) or ():
                    self.message(line)
            else:
                consumer.message(outcome_line(event))
