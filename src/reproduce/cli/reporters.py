"""How `reproduce run` shows a run: periodic lines for logs (PlainReporter), a progress bar on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..plan.gates import outcome_line
from .common import loss_text, parameters_line, print_lines, stderr, stdout
from .options import as_typed, typed_args

if TYPE_CHECKING:
    from ..train.reporter import RunEnd, RunStart, StepRecord


class PlainReporter:
    """Periodic log lines, for CI logs and other non-terminals; nothing before `start`, so bad input
    gets its one error line. The fields a start line or a message names in backticks print as their flags."""

    def __init__(self, warnings: list[str], lines: int = 20):
        self.warnings, self.lines, self.every, self.total, self.started = warnings, lines, 1, 0, 0.0

    def start(self, start: RunStart) -> None:
        """The start's lines as the trainer composed them (train/reporter.run_start), the warnings before them."""
        for warning in self.warnings:
            stderr.print(f"[yellow]warning:[/] {warning}")
        stdout.print(start.batch)
        print_lines(as_typed(line, typed_args) for line in start.throughput)
        for line in start.phases:
            stdout.print(line, markup=False)
        parameters = [parameters_line(start.parameters)] if start.parameters is not None else []
        for line in [*filter(None, [start.sharding, start.weights]), *parameters, *start.memory]:
            print(line, flush=True)
        self.total, self.every = start.total_steps, max(1, start.total_steps // self.lines)
        self.started = time.perf_counter()
        print(start.training, flush=True)

    def step(self, record: StepRecord) -> None:
        step, evaluation, rates = record.step, record.evaluation, record.rates
        if step % self.every and step != self.total and step != 1:
            return
        line = f"step {step}/{self.total} loss {loss_text(record.loss)} lr {record.lr:.4g}"
        for key in ("eval_loss", "eval_accuracy", "eval_miou"):  # a loss in loss_text's digits, a share in 4
            if key in evaluation:
                line += f" {key} " + (loss_text(evaluation[key]) if key == "eval_loss" else f"{evaluation[key]:.4f}")
        rate = ""
        if rates.get("useful_tokens_per_second"):  # variable-length text: tokens that are not padding
            rate = f" {rates['useful_tokens_per_second']:,.0f} useful tokens/s"
        elif rates.get("tokens_per_second") or rates.get("samples_per_second"):  # this step's (observe/rates.py)
            rate = (f" {rates['tokens_per_second']:,.0f} tokens/s" if rates.get("tokens_per_second")
                    else f" {rates['samples_per_second']:,.0f} samples/s")
        print(line + rate + f" ({time.perf_counter() - self.started:.1f}s)", flush=True)

    def message(self, text: str) -> None:
        print(as_typed(text, typed_args), file=sys.stderr, flush=True)

    def gate(self, event: dict) -> None:
        """A gate passed, warned or accepted: one line (plan/gates.py); a pause's line is the run's last."""
        if event["status"] != "paused":
            print(outcome_line(event), flush=True)

    def finish(self, end: RunEnd) -> None:
        """The end's lines as the trainer composed them (train/reporter.run_end)."""
        stdout.print(end.done)
        print_lines([*end.reported, *filter(None, [end.reference, end.noise])])
        stdout.print(end.outputs)
        if end.plot:
            stdout.print(end.plot, markup=False)


class RichReporter(PlainReporter):
    """A progress bar: optimizer step of total, loss, samples/s, ETA."""

    def start(self, start: RunStart) -> None:
        super().start(start)
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("micro x{task.fields[micro]}  loss {task.fields[loss]}  {task.fields[rate]} "
                       + start.rate_unit),
            TimeRemainingColumn(), console=stdout,
        )
        self.task = self.progress.add_task(
            "train", total=start.total_steps, completed=start.first_step, loss="-", rate="-",
            micro=start.accumulation_steps
        )
        self.progress.start()

    def step(self, record: StepRecord) -> None:
        rates = record.rates  # this step's (observe/rates.py)
        rate = (rates.get("tokens_per_second") or rates.get("useful_tokens_per_second")
                or rates.get("samples_per_second") or 0)
        self.progress.update(self.task, advance=1, loss=loss_text(record.loss), rate=f"{rate:,.0f}")

    def message(self, text: str) -> None:
        stderr.print(as_typed(text, typed_args))

    def gate(self, event: dict) -> None:
        if event["status"] != "paused":
            self.progress.console.print(outcome_line(event), markup=False, soft_wrap=True)

    def finish(self, end: RunEnd) -> None:
        self.progress.stop()
        super().finish(end)
