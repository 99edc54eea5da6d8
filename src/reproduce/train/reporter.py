"""What a run tells as it goes (the CLI's renderers, the trackers): the interface, the silent one, the run's start
as data (`RunStart`: the trainer composes its lines from the plan, a reporter only shows them), and `Reporters`,
which hands the same data to several consumers side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..plan.gates import outcome_line
from ..plan.memory_options import memory_summary
from ..plan.phases import phase_lines
from ..plan.planner import Plan


@dataclass(frozen=True)
class RunStart:
    """A run's start, as lines to show: the batch's split, why --policy throughput chose it, the batch phases, what
    the model is set up with (sharding, pretrained weights, its parameters, the memory knobs), then the steps to
    train."""

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
        throughput = [f"--policy throughput: {plan.throughput.reason}", *([cost] if cost else [])]
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


class Reporter(Protocol):
    def start(self, start: RunStart) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


class SilentReporter:
    def start(self, start: RunStart) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


class Reporters:
    """The run's start, records, gates and end handed to each consumer in turn (the trackers, then the CLI's
    renderer: observe/trackers.Trackers, cli/run.py), none calling another. The lines a consumer returns (a tracker
    that failed, where its run lies) are handed to every consumer as messages."""

    def __init__(self, *consumers: Any):
        self.consumers = consumers

    def _each(self, method: str, value: Any) -> None:
        for consumer in self.consumers:
            for line in getattr(consumer, method)(value) or ():
                self.message(line)

    def start(self, start: RunStart) -> None:
        self._each("start", start)

    def step(self, record: dict) -> None:
        self._each("step", record)

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

    def finish(self, summary: dict) -> None:
        self._each("finish", summary)
