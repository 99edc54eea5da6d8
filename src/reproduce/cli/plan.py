"""`reproduce plan RECIPE`: the micro-batch, accumulation steps, LR rule and schedule for this hardware."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from ..export import FORMATS, check_format, export
from ..model_facts import parameter_counts
from ..plan.builtin_names import check_builtin_model
from ..plan.flatview import flat_fields
from ..plan.gates import planned_gates
from ..plan.launch import GPUS_PER_NODE
from ..plan.memory_options import memory_summary
from ..plan.overlay import changes_of
from ..plan.packing import packing_origin
from ..plan.planfile import check_writable, save_plan
from ..plan.planner import Plan, first_plateau_step, lr_at, lr_points
from ..plan.segments import batch_phases
from ..session import plan_and_probe, planned_data_size, recipe_for_plan
from ..shipped import described
from ..throughput.budget import check_price, forecast_cells
from ..throughput.budget import forecast as budget_forecast
from ..throughput.cost import cost_lines, costs_json, plan_costs
from ..throughput.predicted_time import DEFAULT_MFU, check_mfu, predict
from . import options
from .app import app
from .common import parameters_line, print_lines, recipe_argument, show_note, stderr, stdout, token_budget_text
from .throughput import FREE_BATCHNORM_HELP, MFU_HELP, render_prediction, render_throughput

PLAN_DATA_HELP = ("Plan on this data (a folder or file in the recipe's data.format), instead of the recipe's "
                  "data.path: its size gives the epochs' optimizer steps, as `run` counts them.")

PRICE_HELP = ("The price of one GPU-hour (yours: none is shipped), for the forecast's money and a recipe's "
              "budget.money; the recipe's budget.price otherwise.")

GPUS_PER_NODE_HELP = ("GPUs per machine, for the nodes of a plan of several processes (--emit slurm's script, the "
                      "GPU-hours line): full nodes of up to this many.")


@app.command("plan")
def plan_command(
    context: typer.Context,
    recipe_path: Path = typer.Argument(
        ..., metavar="RECIPE", help="The paper's recipe: a file, or a shipped recipe's name (goyal2017-resnet50)."
    ),
    micro_batch_max: options.MicroBatchMaxOption = None,
    world_size: options.WorldSizeOption = 1,
    policy: options.PolicyOption = options.Policy.exact,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    out: Path | None = typer.Option(None, "--out", help="Write the plan to this YAML file (what `run` reads)."),
    memory: options.MemoryOption = None,
    gpu: options.GpuOption = None,
    meter: options.MeterOption = options.MeterName.auto,
    headroom: options.HeadroomOption = 0.1,
    no_cache: options.NoCacheOption = False,
    sharding: options.ShardingOption = None,
    emit_format: str | None = typer.Option(
        None, "--emit", metavar="FORMAT", help=f"Print the plan as {', '.join(FORMATS)} settings, not the table."
    ),
    gpus_per_node: int = typer.Option(GPUS_PER_NODE, "--gpus-per-node", min=1, help=GPUS_PER_NODE_HELP),
    assumed_mfu: float = typer.Option(DEFAULT_MFU, "--mfu", help=MFU_HELP),
    price: float | None = typer.Option(None, "--price", metavar="PRICE", help=PRICE_HELP),
    free_batchnorm: bool = typer.Option(False, "--free-batchnorm", help=FREE_BATCHNORM_HELP),
    activation_checkpointing: options.CheckpointingOption = False,
    sharded_gradients: options.ShardedGradientsOption = False,
    offload: options.OffloadOption = None,
    data_path: str | None = typer.Option(None, "--data", metavar="PATH", help=PLAN_DATA_HELP),
    weights: options.WeightsOption = None,
    backbone_weights: options.BackboneWeightsOption = None,
    quantize: options.QuantizeOption = None,
    batchnorm: options.BatchNormOption = None,
    packing: options.PackingOption = None,
    token_budget: options.TokenBudgetOption = None,
    overrides: options.SetOption = None,
) -> None:
    """Plan a paper's recipe: micro-batch x accumulation x world size, the LR rule, and steps.

    Without --micro-batch-max the largest micro-batch is probed: on this GPU, or for --memory / --gpu.
    Exit code 3 when not even micro-batch 1 fits (what the step needs and what would make it fit are printed).
    """
    quiet = as_json or emit_format is not None  # the table's first line says which file it read
    recipe_path = recipe_argument(recipe_path, say=quiet)
    if out is not None:
        check_writable(out, "--out", protect=(recipe_path,))
    if emit_format is not None:
        check_format(emit_format)
    check_mfu(assumed_mfu)
    check_price(price)
    recipe = recipe_for_plan(recipe_path, [*changes_of(overrides or []), *options.alias_changes(context)], world_size)
    check_builtin_model(recipe)  # a typo: one line with the nearest name, as run says
    probing = options.probe_options(memory, gpu, meter, headroom, no_cache)
    data, size = planned_data_size(recipe, given=data_path is not None)
    planned = plan_and_probe(
        recipe, str(recipe_path), micro_batch_max, world_size, policy.value, size, probe=probing, data=data,
        keep_batchnorm=not free_batchnorm, on_note=None if quiet else show_note,
    )
    plan, result = planned.plan, planned.probe
    prediction: dict = {}
    forecast = None
    if emit_format is None or plan.recipe.budget is not None:  # a budget the forecast exceeds: refused, nothing written
        prediction = predict(plan, result, gpu, assumed_mfu)
        forecast = budget_forecast(plan, result, prediction, price)
    if out is not None:
        save_plan(plan, out)
    if emit_format is not None:
        print(export(plan, emit_format, gpus_per_node).text, end="")
        return
    grouping = None
    if data is not None:  # (torch: only with data, which imported it)
        from ..train.windows import packing_table

        grouping = packing_table(plan.recipe, plan, data)  # (the plan's recipe: data.packing's default taken)
    origin = packing_origin(recipe, plan.recipe)
    if as_json:
        print(json.dumps(plan_json(plan, result, prediction, grouping, origin, forecast), indent=2))
        return
    show_plan(plan, result, recipe, recipe_path, forecast, grouping, origin, prediction, gpus_per_node, out)


def show_plan(plan: Plan, result, recipe, recipe_path: Path, forecast: dict | None, grouping: dict | None,
              origin: str | None, prediction: dict, gpus_per_node: int, out: Path | None) -> None:
    """`plan`'s table and the lines after it: gates, parameters, packing, throughput, costs, predicted time."""
    stdout.print(f"recipe: {described(recipe_path, recipe_path)}", markup=False, soft_wrap=True)
    render_plan(plan, forecast)
    print_lines(gate.line() for gate in planned_gates(plan))  # each gate at its optimizer step (plan/gates.py)
    counts = parameter_counts(recipe, build=result is not None)  # counted on the meta device when the plan probed
    if counts is not None:  # (or by `papers` or an earlier probe: the probe's cache keeps it) and no torch otherwise
        stdout.print(parameters_line(counts), markup=False)
    if grouping is not None or origin is not None:  # the grouping, where it came from, the token budget
        probed = token_budget_text(result) if recipe.data.token_budget is None else None
        way, table = plan.recipe.data.packing or "none", grouping
        line = f"packing: {way} ({origin or 'the default for this data; data.packing or --packing to choose'})"
        if table is None:
            lines = [line + (f"; token budget {probed}" if probed else "")]
        else:  # with the data's lengths: each way's micro-batches per window and padding
            ways = ", ".join(f"{way} {table[way]['micro_batches']:g} ({table[way]['padding_fraction']:.0%} padding)"
                             for way in ("none", "sorted", "packed"))
            budget = probed or f"{table['token_budget']:,}" + (
                " (data.token_budget, --token-budget)" if table["given"] else
                f" = micro-batch x the longest example's {table['longest']} tokens per micro-batch (sorted, packed)")
            lines = [f"{line}; token budget {budget}", "  micro-batches per window and rank, over the first "
                     f"{table['windows']} windows of this data: {ways}"]
        print_lines(lines)
    render_throughput(plan)
    if result is not None:
        print_lines(options.as_typed(line, options.typed_args) for line in cost_lines(plan, result))
    render_prediction(prediction, plan.world_size, gpus_per_node)
    if out is not None:
        stdout.print(f"plan written to {out}")


def plan_json(plan: Plan, result, prediction: dict, grouping: dict | None, origin: str | None,
              forecast: dict | None = None) -> dict:
    """`plan --json`: the plan, its grouping, the probe behind it and its cost, the predicted time."""
    summary = plan_summary(plan)
    if grouping is not None or origin is not None:
        summary["packing"] = {"way": plan.recipe.data.packing or "none", **(grouping or {}),
                              "origin": origin or "the default for this data"}
    if result is not None:
        summary["probe"] = result.model_dump(mode="json")
        summary["cost"] = costs_json(plan_costs(plan, result))
    summary.update(predicted_seconds=prediction.get("predicted_seconds"),
                   paper_predicted_seconds=prediction.get("paper_predicted_seconds"),
                   gpu_hours=prediction.get("gpu_hours"), prediction=prediction)
    if forecast is not None:
        summary["forecast"] = forecast
    return summary


def plan_summary(plan: Plan) -> dict:
    """The plan as JSON: its flat view, the batch arithmetic and `lr_points` ([optimizer step (1-based), lr] where
    the schedule changes shape; with plateau decay up to the first step a decrease could change)."""
    summary = flat_fields(plan)  # reproduce-plan/1's flat fields, which pipelines read (plan/flatview.py)
    summary["arithmetic"] = plan.arithmetic
    summary["memory_options"] = memory_summary(plan.recipe)  # the recipe's own: quantised base, optimizer, ...
    summary["lr_points"] = lr_points(plan)
    first = first_plateau_step(plan)
    if first is not None:
        summary["lr_points_note"] = (f"plateau decay: the decreases depend on the run's evaluations; the points stop "
                                     f"at step {first + 1}, the first whose LR a decrease could change")
    return summary


def render_plan(p: Plan, forecast: dict | None = None) -> None:
    r = p.recipe
    unit = p.unit
    title = r.paper.title if r.paper else (p.recipe_path or "recipe")
    table = Table(title=f"{title}" + (f" ({r.paper.year})" if r.paper and r.paper.year else ""), title_justify="left")
    for column in ("", "paper", "this plan"):
        table.add_column(column)
    paper_split = ""
    if r.batch.devices and r.batch.per_device:
        paper_split = f"{r.batch.per_device} x {r.batch.accumulation or 1} x {r.batch.devices} = "
    tokens = f" ({r.batch.effective} tokens)" if r.batch.unit == "tokens" else ""
    table.add_row(
        "effective batch\n(micro x accum x world)",
        f"{paper_split}{r.batch.sequences} {unit}{tokens}",
        f"{p.arithmetic} {'' if p.effective_tokens else unit}".rstrip() + ("  exact" if p.exact else "  NOT exact"),
    )
    hardware = f"{r.batch.devices or '?'} x {r.batch.device}" if r.batch.device else f"{r.batch.devices or '?'} devices"
    sharded = ", fsdp (sharded)" if r.batch.sharding == "fsdp" and p.world_size > 1 else ""
    table.add_row("hardware", hardware, f"{p.world_size} process(es){sharded}")
    table.add_row(
        "learning rate",
        f"{r.optimizer.name} lr {r.optimizer.lr:g}",
        f"{p.lr:.6g} ({p.lr_scaling.rule}{'' if p.exact else f', x{p.split.lr_factor:.4g}'})",
    )
    table.add_row("LR rule", "", p.lr_scaling.source)
    if p.lr_scaling.adam_option:
        table.add_row(
            "option (Adam)", f"betas {list(r.optimizer.betas)} eps {r.optimizer.eps:g}",
            f"betas {[round(b, 6) for b in p.lr_scaling.adam_option.betas]} eps {p.lr_scaling.adam_option.eps:.3g}",
        )
    table.add_row("schedule total", r.schedule.total.label(), f"unknown ({UNKNOWN_SIZE})"
                  if p.optimizer_steps is None else f"{p.optimizer_steps} optimizer steps")
    if r.schedule.warmup is not None:
        warm = r.schedule.warmup
        shown = f"ratio {warm.ratio:g}" if warm.ratio is not None else warm.label()
        unknown = warm.unit == "epochs" if warm.ratio is None else p.optimizer_steps is None
        table.add_row("warm-up", shown, f"unknown ({UNKNOWN_SIZE})" if unknown and p.steps_per_epoch is None else
                      f"{p.warmup_steps} steps from lr {p.schedule.warmup_start_lr:g}")
    table.add_row("decay", *decay_cells(p))
    if p.steps_per_epoch is not None:
        table.add_row("epoch", f"{p.dataset_size} {unit}", f"{p.steps_per_epoch} optimizer steps")
    table.add_row("precision / clip", f"{r.precision} / {r.clip_grad_norm or 'none'}", "same")
    knobs = memory_summary(r)
    if knobs:
        table.add_row("memory", "", "; ".join(knobs))
    if p.batchnorm is not None:
        table.add_row("BatchNorm", *batchnorm_cells(p))
    if forecast is not None:
        cells = forecast_cells(forecast)
        table.add_row("cost (forecast)", *(options.as_typed(cell, options.typed_args) for cell in cells))
    stdout.print(table)
    if p.weights is not None:
        stdout.print(p.weights.line(r.model.builtin or r.model.factory), markup=False, soft_wrap=True)
    print_lines(p.memory_notes)
    render_phases(p)
    if p.alternative is not None:
        alt = p.alternative
        stdout.print(
            f"[bold]alternative[/] --policy {alt.policy}: {alt.arithmetic} {unit}"
            + ("" if alt.exact else f" (x{alt.batch_factor:.4g} the paper's batch, lr {alt.lr:.6g})")
        )
    if p.batchnorm is not None:
        stdout.print(p.batchnorm.lines[0], markup=False, soft_wrap=True)
        print_lines(f"  BatchNorm option: {option}" for option in p.batchnorm.options)
    for warning in p.warnings:
        stderr.print(f"[yellow]warning:[/] {warning}")


def decay_cells(p: Plan) -> tuple[str, str]:
    """The decay row: the paper's decay and this plan's, in optimizer steps (plateau: when the first could come)."""
    decay = p.recipe.schedule.decay
    if decay.kind == "plateau":
        every, first = p.recipe.evaluation.every_steps, first_plateau_step(p)
        return (f"plateau: x{decay.factor:g} after {decay.patience} evaluations without improvement of {decay.metric}",
                f"at evaluations (every {every} steps): the decreases depend on the run; the first possible from "
                f"step {first + 1}")
    paper, plan = decay.kind, decay.kind
    if decay.milestones is not None:
        paper += f" at {decay.milestones.unit} {list(decay.milestones.value)} x{decay.factor:g}"
    if p.schedule.decay_milestones:
        plan += f" at steps {p.schedule.decay_milestones}"
    elif decay.kind != "constant":
        end = p.schedule.decay_end_step
        plan += f" to lr {p.schedule.min_lr:.3g} at " + (
            f"step {end}" if end is not None else f"the end ({UNKNOWN_SIZE})")
    elif decay.milestones is not None and p.steps_per_epoch is None and decay.milestones.unit == "epochs":
        plan += f" at steps unknown ({UNKNOWN_SIZE})"
    return paper, plan


def batchnorm_cells(p: Plan) -> tuple[str, str]:
    """The BatchNorm row: the paper's choice and BN batch, and the run's (per device and synced)."""
    norm = p.batchnorm
    batch = p.recipe.batch
    paper = {"frozen": "frozen BN, no BN batch", "group": "GroupNorm, no BN batch"}.get(norm.paper_mode) or (
        f"BN batch {norm.paper_batch}" + (f" (SyncBN: {batch.per_device} x {batch.devices})"
                                          if norm.paper_mode == "sync" else " per device")
        if norm.paper_batch else "BN batch not stated")
    if norm.mode == "sync":
        run = f"sync, BN batch {norm.micro_batch} x {norm.processes} = {norm.run_batch}"
    elif norm.mode == "keep":
        run = f"keep, BN batch {norm.run_batch} per device (not synced)"
    else:
        run = f"{norm.mode}, no BN batch"
    layers = f"{norm.layers} BatchNorm layers" if norm.layers is not None else "BatchNorm (label)"
    return paper, f"{run}; {layers}"


UNKNOWN_SIZE = "the dataset size is needed: set data.train_size"
PHASE_ROWS = 16  # a longer ramp shows its first and last batches


def render_phases(p: Plan) -> None:
    """The batch of each stretch of optimizer steps (`batch.phases`, or each distinct batch of `batch.ramp`)."""
    phases = batch_phases(p.segments)
    if not phases:
        return
    tokens = p.recipe.batch.sequence_length is not None
    table = Table(title="batch phases: reproduce run switches N (and the sequence length) at each first step",
                  title_justify="left")
    for column in ("steps", "paper", "this plan (micro x accum x world)", "tokens per step" if tokens else None,
                   "lr: first - last step"):
        if column:
            table.add_column(column, justify="right" if column.startswith(("steps", "tokens")) else "left")
    rows = list(enumerate(phases))
    if len(rows) > PHASE_ROWS:
        rows = [*rows[: PHASE_ROWS // 2], None, *rows[-PHASE_ROWS // 2 :]]
    for row in rows:
        if row is None:
            table.add_row("...", f"{len(phases) - PHASE_ROWS} more ramp batches", "", *([""] if tokens else []), "")
            continue
        index, phase = row
        last = phase.end_step if phase.end_step is not None else p.optimizer_steps
        steps = f"{phase.start_step + 1} - {last if last is not None else 'end'}"
        length = f" x {phase.sequence_length} tokens" if phase.sequence_length else ""
        if phase.kind == "ramp":
            start = p.recipe.batch.ramp.start
            paper = "ramp" + ((f" from {start:,} tokens" if p.recipe.batch.unit == "tokens" else
                               f" from {start} {p.unit}") if index == 0 else "")
            mark = ""
        else:
            paper = f"{phase.paper_effective_batch} {'sequences' if length else p.unit}{length}"
            mark = "  exact" if phase.exact else f"  NOT exact (lr x{phase.lr_factor:.4g})"
        cells = [steps, paper, phase.arithmetic(p.world_size) + mark]
        if phase.schedule is not None:  # the phase's own schedule, as the recipe gives it
            spec = p.recipe.batch.phases[index]
            parts = [f"lr {spec.lr if spec.lr is not None else p.recipe.optimizer.lr:g}"]
            if spec.warmup is not None:
                parts.append(f"warm-up {f'ratio {spec.warmup.ratio:g}' if spec.warmup.ratio else spec.warmup.label()}")
            parts.append((spec.decay or p.recipe.schedule.decay).kind + ("" if spec.decay else " (as schedule.decay)"))
            cells[1] += "\nown schedule: " + ", ".join(parts)
        if tokens:
            cells.append(f"{phase.effective_batch * phase.sequence_length:,}")
        first = f"{lr_at(p, phase.start_step):.4g}"  # the LR of its first and last steps, as the run has them
        cells.append(first if last is None or last <= phase.start_step else f"{first} - {lr_at(p, last - 1):.4g}")
        table.add_row(*cells)
    stdout.print(table)
