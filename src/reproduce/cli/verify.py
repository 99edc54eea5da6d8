"""`reproduce verify RECIPE_OR_PLAN`: is the plan's accumulation the large batch, for this model and data?"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from ..errors import UserError
from ..plan.overlay import changes_of
from ..session import plan_and_probe, recipe_for_run
from . import options
from .app import app
from .common import recipe_argument, show_note, stdout

SAMPLES_HELP = "Check on the first K samples instead of one effective batch (for big models)."
TOLERANCE_HELP = "Largest relative error that counts as equivalent (default per dtype: float64 1e-10, float32 1e-5)."
DTYPE_HELP = "float64 or float32 parameters, or bf16/fp16 autocast as the trainer runs it."
SEED_HELP = "Seed for the weights and the samples (default: the recipe's)."
DATA_HELP = "Check on this data (in the recipe's data.format) instead of the recipe's data.path."
SHOWN = 25  # parameter rows shown in the table; the worst ones when there are more
Dtype = Enum("Dtype", {"float64": "float64", "float32": "float32", "bf16": "bf16", "fp16": "fp16"}, type=str)


@app.command("verify")
def verify_command(
    context: typer.Context,
    source: Path = typer.Argument(
        ..., metavar="RECIPE_OR_PLAN", help="A recipe (a file or a shipped recipe's name), or a plan from `plan --out`."
    ),
    micro_batch_max: options.MicroBatchMaxOption = None,
    world_size: options.WorldSizeOption = 1,
    policy: options.PolicyOption = options.Policy.exact,
    samples: int | None = typer.Option(None, "--samples", min=1, help=SAMPLES_HELP),
    tolerance: float | None = typer.Option(None, "--tolerance", help=TOLERANCE_HELP),
    dtype: Dtype = typer.Option(Dtype.float64, "--dtype", help=DTYPE_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    seed: int | None = typer.Option(None, "--seed", help=SEED_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    data_path: str | None = typer.Option(None, "--data", metavar="PATH", help=DATA_HELP),
    weights: options.WeightsOption = None,
    backbone_weights: options.BackboneWeightsOption = None,
    activation_checkpointing: options.CheckpointingOption = False,
    quantize: options.QuantizeOption = None,
    batchnorm: options.BatchNormOption = None,
    packing: options.PackingOption = None,
    token_budget: options.TokenBudgetOption = None,
    overrides: options.SetOption = None,
) -> None:
    """Compare the plan's accumulated gradient with the one-pass gradient: exit 0 equivalent, 1 not."""
    from ..data import build_data, training_sizes  # torch is imported only by the commands that need it
    from ..verify.accumulation import verify

    if tolerance is not None and not tolerance > 0:
        raise UserError(f"--tolerance: must be > 0 (got {tolerance})")
    source = recipe_argument(source, "recipe or plan")
    recipe, plan = recipe_for_run(source, changes_of(overrides or []), options.alias_changes(context))
    data = build_data(recipe)
    if plan is None:
        plan = plan_and_probe(recipe, str(source), micro_batch_max, world_size, policy.value,
                             dataset_size=training_sizes(recipe, data.train), on_note=show_note).plan
    result = verify(
        plan, samples=samples, tolerance=tolerance, dtype=dtype.value, device=device, seed=seed, data=data
    )
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        render(result)
    raise typer.Exit(0 if result.within_tolerance else 1)


def render(result) -> None:
    rows = result.parameters
    if len(rows) > SHOWN:
        rows = sorted(rows, key=lambda r: -r.relative_error if not math.isnan(r.relative_error) else -math.inf)[:SHOWN]
    title = f"gradient check: {result.recipe}, {result.samples} samples, {result.dtype} on {result.device}"
    table = Table(title=title, title_justify="left")
    for column in ("parameter", "shape", "|g one pass|", "|g plan - g one pass|", "relative error"):
        table.add_column(column, justify="left" if column in ("parameter", "shape") else "right")
    for row in rows:
        bad = not row.relative_error <= result.tolerance and not row.negligible
        error = f"{row.relative_error:.3g}" + (" (~0 gradient)" if row.negligible else "")
        table.add_row(
            row.name, "x".join(map(str, row.shape)) or "scalar", f"{row.reference_norm:.4g}",
            f"{row.difference_norm:.3g}", f"[red]{error}[/]" if bad else error,
        )
    stdout.print(table)
    if len(result.parameters) > SHOWN:
        stdout.print(f"({SHOWN} of {len(result.parameters)} parameters shown: those with the largest error)")
    stdout.print(
        f"plan: {result.arithmetic}; checked on {result.samples} samples = {result.micro_batches} micro-batch(es) "
        f"of up to {result.micro_batch}; reference in {result.reference_chunks} pass(es)"
    )
    if any(row.negligible for row in result.parameters):
        stdout.print("(~0 gradient: the one-pass gradient is rounding noise; judged only within the global error)")
    if result.dropout_disabled:
        stdout.print(f"dropout disabled for the check: {', '.join(result.dropout_disabled)}")
    for note in result.notes:
        stdout.print(f"note: {note}", markup=False)
    colour = "green" if result.within_tolerance else "red"
    stdout.print(
        f"[bold {colour}]{result.verdict}[/]: global relative error {result.global_relative_error:.3g} "
        f"(worst parameter {result.worst_parameter}: {result.worst_relative_error:.3g}), "
        f"tolerance {result.tolerance:g}"
    )
    stdout.print(result.explanation, markup=False)
