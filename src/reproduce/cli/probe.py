"""`reproduce probe RECIPE`: the largest micro-batch whose training step fits, measured, every trial shown."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from ..plan.overlay import changes_of
from ..plan.planner import Plan, make_plan
from ..plan.units import format_size
from ..probe.runner import ProbeResult, ProbeTrial, does_not_fit, run_probe
from ..probe.search import Measurement
from ..session import recipe_for_plan
from ..throughput.cost import cost_lines, costs_json, plan_costs
from . import options
from .app import app
from .common import print_lines, recipe_argument, stderr, stdout, token_budget_text

PROBE_DATA_HELP = "Probe on this data (in the recipe's data.format) instead of the recipe's data.path."
WORLD_SIZE_HELP = "Number of data-parallel processes: the probe needs no micro-batch above batch / processes."


@app.command("probe")
def probe_command(
    context: typer.Context,
    recipe_path: Path = typer.Argument(
        ..., metavar="RECIPE", help="The paper's recipe: a file, or a shipped recipe's name (digits-mlp)."
    ),
    memory: options.MemoryOption = None,
    gpu: options.GpuOption = None,
    meter: options.MeterOption = options.MeterName.auto,
    headroom: options.HeadroomOption = 0.1,
    world_size: int = typer.Option(1, "--world-size", min=1, help=WORLD_SIZE_HELP),
    sharding: options.ShardingOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    no_cache: options.NoCacheOption = False,
    data_path: str | None = typer.Option(None, "--data", metavar="PATH", help=PROBE_DATA_HELP),
    weights: options.WeightsOption = None,
    activation_checkpointing: options.CheckpointingOption = False,
    sharded_gradients: options.ShardedGradientsOption = False,
    offload: options.OffloadOption = None,
    quantize: options.QuantizeOption = None,
    batchnorm: options.BatchNormOption = None,
    overrides: options.SetOption = None,
) -> None:
    """Measure the largest micro-batch whose full training step fits one device's memory.

    Exit code 0 with an answer, 2 for bad input, 3 when not even micro-batch 1 fits (what the step needs
    and what would make it fit are printed).
    """
    recipe_path = recipe_argument(recipe_path)
    recipe = recipe_for_plan(recipe_path, [*changes_of(overrides or []), *options.alias_changes(context)], world_size)
    probing = options.probe_options(memory, gpu, meter, headroom, no_cache)
    result = run_probe(recipe, str(recipe_path), probing, world_size, on_trial=None if as_json else show_trial)
    plan = make_plan(recipe, result.micro_batch_max, world_size) if result.micro_batch_max else None
    if as_json:
        summary = result.model_dump(mode="json")
        if plan is not None:
            summary["plan"] = {"arithmetic": plan.arithmetic, "cost": costs_json(plan_costs(plan, result))}
        print(json.dumps(summary, indent=2))
    else:
        render_probe(result, plan)
    if result.micro_batch_max is None:
        raise does_not_fit(result)


def verdict(trial: Measurement | ProbeTrial) -> str:
    return "fits" if trial.fits else ("out of memory" if trial.peak_bytes is None else "over the limit")


def show_trial(trial: Measurement) -> None:
    """One line per trial while the probe runs (trials on a GPU can take a while)."""
    peak = format_size(trial.peak_bytes) if trial.peak_bytes is not None else "-"
    stderr.print(f"  trial micro-batch {trial.micro_batch}: {verdict(trial)}, peak {peak} ({trial.seconds:.2f} s)")


def render_probe(result: ProbeResult, plan: Plan | None) -> None:
    source = "--gpu " + result.gpu if result.gpu else "budget"
    stdout.print(
        f"[bold]probe[/] {result.recipe_path}: {result.meter} meter, {result.device}; {result.data}\n"
        f"{source} {format_size(result.budget_bytes)} less {result.headroom:.0%} headroom: "
        f"limit {format_size(result.limit_bytes)}; sizes capped at {result.cap} (the batch per process)"
        + (f"; fsdp over {result.world_size} processes" if result.sharding == "fsdp" else "")
    )
    table = Table(title_justify="left")
    tokens = any(trial.tokens_per_second for trial in result.trials)
    for column in ("micro-batch", "peak", "tensors", "result", "step", "samples/s", "tokens/s" if tokens else "",
                   "trial"):
        if column:
            table.add_column(column, justify="left" if column == "result" else "right")
    for trial in result.trials:
        table.add_row(
            str(trial.micro_batch),
            format_size(trial.peak_bytes) if trial.peak_bytes is not None else "-",
            format_size(trial.tensor_bytes) if trial.tensor_bytes is not None else "-",
            verdict(trial),
            f"{trial.step_seconds:.3g} s" if trial.step_seconds else "-",
            f"{trial.samples_per_second:,.0f}" if trial.samples_per_second else "-",
            *([f"{trial.tokens_per_second:,.0f}" if trial.tokens_per_second else "-"] if tokens else []),
            f"{trial.seconds:.2f} s",
        )
    stdout.print(table)
    if result.line is not None:
        line = result.line
        stdout.print(
            f"fitted line: peak(b) = {format_size(line.intercept_bytes)} + {format_size(line.bytes_per_sample)} x b "
            f"(through b = {line.points[0]} and {line.points[1]})"
        )
    when = "from the cache (--no-cache to measure again)" if result.cached else f"in {result.seconds:.1f} s"
    if result.micro_batch_max is not None:
        share = result.peak_bytes / result.budget_bytes
        why = (
            "the cap: the paper's batch per process needs no more" if result.capped
            else f"{result.micro_batch_max + 1} does not fit"
        )
        stdout.print(
            f"[bold]largest micro-batch: {result.micro_batch_max}[/] (peak {format_size(result.peak_bytes)}, "
            f"{share:.0%} of the budget; {why}); {len(result.trials)} trials {when}"
        )
    budget = token_budget_text(result)
    if budget is not None:
        stdout.print(f"token budget: {budget}", markup=False, soft_wrap=True)
    print_lines(f"note: {note}" for note in result.notes)
    if plan is not None:
        render_batchnorm(plan, result)
        print_lines(options.as_typed(line, options.typed_args) for line in cost_lines(plan, result))


def render_batchnorm(plan: Plan, result: ProbeResult) -> None:
    """What micro-batch each BatchNorm choice needs: the paper's BN batch per device against what fits."""
    norm = plan.batchnorm
    if norm is None:
        return
    lines = [norm.summary]
    target, line = norm.paper_batch, result.line
    if target and target > (result.micro_batch_max or 0) and line is not None:
        peak = line.intercept_bytes + line.bytes_per_sample * target
        lines.append(f"BatchNorm: the paper's BN batch of {target} on one device would peak at about "
                     f"{format_size(peak)} (fitted line) against the limit of {format_size(result.limit_bytes)}")
    print_lines([*lines, *(f"  BatchNorm option: {option}" for option in norm.options)])


