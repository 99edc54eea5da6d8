"""`reproduce plan RECIPE`: the micro-batch, accumulation steps, LR rule and schedule for this hardware."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from ..errors import UserError
from ..planfile import check_writable, save_plan
from ..planner import Plan, plan
from ..recipe import Recipe, load_recipe
from .app import app
from .common import stderr, stdout


class Policy(str, Enum):
    exact = "exact"
    fast = "fast"


MICRO_BATCH_MAX_HELP = "Largest micro-batch known to fit on one device (skips the memory probe)."
WORLD_SIZE_HELP = "Number of data-parallel processes (GPUs) the run will use."
POLICY_HELP = "exact: keep the paper's effective batch exactly; fast: the nearest batch with a larger micro-batch."


def make_plan(
    recipe: Recipe,
    recipe_path: str,
    micro_batch_max: int | None,
    world_size: int,
    policy: Policy,
    dataset_size: int | None = None,
) -> Plan:
    """Plan `recipe`; the one place that decides where the micro-batch maximum comes from."""
    if micro_batch_max is None:
        raise UserError(
            "--micro-batch-max: required: give the largest micro-batch that fits one device "
            "(for example --micro-batch-max 32)"
        )
    return plan(recipe, micro_batch_max, world_size, policy.value, dataset_size=dataset_size, recipe_path=recipe_path)


@app.command("plan")
def plan_command(
    recipe_path: Path = typer.Argument(
        ..., metavar="RECIPE", help="The paper's recipe, e.g. papers/goyal2017-resnet50.yaml."
    ),
    micro_batch_max: int | None = typer.Option(None, "--micro-batch-max", min=1, help=MICRO_BATCH_MAX_HELP),
    world_size: int = typer.Option(1, "--world-size", min=1, help=WORLD_SIZE_HELP),
    policy: Policy = typer.Option(Policy.exact, "--policy", help=POLICY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    out: Path | None = typer.Option(None, "--out", help="Write the plan to this YAML file (what `run` reads)."),
) -> None:
    """Plan a paper's recipe: micro-batch x accumulation x world size, the LR rule, and steps."""
    if out is not None:
        check_writable(out, "--out", protect=(recipe_path,))
    recipe = load_recipe(recipe_path)
    the_plan = make_plan(recipe, str(recipe_path), micro_batch_max, world_size, policy)
    if out is not None:
        save_plan(the_plan, out)
    if as_json:
        print(json.dumps(plan_summary(the_plan), indent=2))
        return
    render_plan(the_plan)
    if out is not None:
        stdout.print(f"plan written to {out}")


def plan_summary(the_plan: Plan) -> dict:
    """The plan as JSON: every field but the embedded recipe, plus the batch arithmetic."""
    summary = the_plan.model_dump(mode="json", exclude={"recipe"})
    summary["arithmetic"] = the_plan.arithmetic
    return summary


def render_plan(p: Plan) -> None:
    r = p.recipe
    unit = p.unit
    title = r.paper.title if r.paper else (p.recipe_path or "recipe")
    table = Table(title=f"{title}" + (f" ({r.paper.year})" if r.paper and r.paper.year else ""), title_justify="left")
    table.add_column("")
    table.add_column("paper")
    table.add_column("this plan")
    paper_split = ""
    if r.batch.devices and r.batch.per_device:
        paper_split = f"{r.batch.per_device} x {r.batch.accumulation or 1} x {r.batch.devices} = "
    tokens = f" ({r.batch.effective} tokens)" if r.batch.unit == "tokens" else ""
    table.add_row(
        "effective batch\n(micro x accum x world)",
        f"{paper_split}{r.batch.sequences} {unit}{tokens}",
        f"{p.arithmetic} {'' if p.effective_tokens else unit}".rstrip() + ("  exact" if p.exact else "  NOT exact"),
    )
    table.add_row("hardware", f"{r.batch.devices or '?'} x {r.batch.device or 'device'}", f"{p.world_size} process(es)")
    table.add_row(
        "learning rate",
        f"{r.optimizer.name} lr {r.optimizer.lr:g}",
        f"{p.lr:.6g} ({p.lr_rule}{'' if p.exact else f', x{p.lr_factor:.4g}'})",
    )
    table.add_row("LR rule", "", p.lr_rule_source)
    if p.adam_option:
        table.add_row(
            "option (Adam)", f"betas {list(r.optimizer.betas)} eps {r.optimizer.eps:g}",
            f"betas {[round(b, 6) for b in p.adam_option.betas]} eps {p.adam_option.eps:.3g}",
        )
    table.add_row("schedule total", _length(r.schedule.total), _steps(p.optimizer_steps))
    if r.schedule.warmup is not None:
        warm = r.schedule.warmup
        shown = f"ratio {warm.ratio:g}" if warm.ratio is not None else _length(warm)
        table.add_row("warm-up", shown, f"{p.warmup_steps} steps from lr {p.warmup_start_lr:g}")
    decay = r.schedule.decay
    decay_paper = decay.kind
    if decay.milestones is not None:
        decay_paper += f" at {decay.milestones.unit} {list(decay.milestones.value)} x{decay.factor:g}"
    decay_plan = decay.kind
    if p.decay_milestones:
        decay_plan += f" at steps {p.decay_milestones}"
    elif decay.kind != "constant":
        decay_plan += f" to lr {p.min_lr:.3g} at step {p.decay_end_step}"
    table.add_row("decay", decay_paper, decay_plan)
    if p.steps_per_epoch is not None:
        table.add_row("epoch", f"{p.dataset_size} {unit}", f"{p.steps_per_epoch} optimizer steps")
    table.add_row("precision / clip", f"{r.precision} / {r.clip_grad_norm or 'none'}", "same")
    stdout.print(table)
    if p.alternative is not None:
        alt = p.alternative
        stdout.print(
            f"[bold]alternative[/] --policy {alt.policy}: {alt.arithmetic} {unit}"
            + ("" if alt.exact else f" (x{alt.batch_factor:.4g} the paper's batch, lr {alt.lr:.6g})")
        )
    for warning in p.warnings:
        stderr.print(f"[yellow]warning:[/] {warning}")


def _length(length) -> str:
    return f"{length.value:g} {length.unit}" if length is not None else "-"


def _steps(steps: int | None) -> str:
    return f"{steps} optimizer steps" if steps is not None else "unknown (dataset size needed)"
