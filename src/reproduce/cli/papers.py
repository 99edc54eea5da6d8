"""`reproduce papers`: the shipped recipes, their models, and whether each can run here; `papers show NAME` prints one.

Runnable is decided without torch; built-in models' parameters are counted on torch's meta device (torch imported
when the command runs, not when the CLI starts); a factory's code is never run to list it. `papers --devices
[--markdown] [--estimate]`: the hardware each paper ran on, from its recipe alone, and with `--estimate` what the
estimate meter measures on that device (docs/papers.md holds both tables; a test keeps them equal to this output).
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import UserError
from ..hardware.catalog import lookup
from ..model_facts import parameter_counts
from ..plan.builtin_names import why_not_runnable
from ..plan.recipe import Recipe, load_recipe
from ..plan.units import format_count
from ..shipped import described, is_shipped, papers_folder, recipe_files
from .app import app
from .common import print_lines, stdout
from .options import as_typed

NANOGPT_DEFAULTS = {"block_size": 1024, "n_embd": 768}  # models.nanogpt.GPTConfig's (read here without torch)
LIST_WIDTH = 165  # off a terminal (CI logs, pipes): room for every column of a list on one line
DIR_HELP = "Folder of recipes (default: ./papers if present, else the recipes shipped with reproduce)."

papers_app = typer.Typer(
    help="The shipped paper recipes: list them, or `show NAME` for one.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(papers_app, name="papers")


def papers_dir(given: Path | None) -> Path:
    if given is not None:
        if not given.is_dir():
            raise UserError(f"--dir: {given} is not a folder")
        return given
    here = Path("papers")
    if here.is_dir() and recipe_files(here):
        return here
    folder = papers_folder()
    if folder is None:
        raise UserError("--dir: no papers/ folder here, and no recipes shipped with this installation of reproduce; "
                        "give --dir FOLDER")
    return folder


def find_recipe(name: str, folder: Path) -> Path:
    """NAME as a file stem (`goyal2017-resnet50`), a file name, or a path."""
    as_path = Path(name)
    if as_path.is_file():
        return as_path
    files = recipe_files(folder)
    stems = {p.stem: p for p in files}
    key = as_path.name.removesuffix(".yaml").removesuffix(".yml")
    if key in stems:
        return stems[key]
    close = difflib.get_close_matches(key, list(stems), n=3, cutoff=0.5)
    starts = [s for s in stems if s.startswith(key)] if key else []
    suggestions = starts or close
    hint = f" (did you mean {', '.join(suggestions)}?)" if suggestions else f" (known: {', '.join(stems)})"
    raise UserError(f"papers show: no recipe {name!r} in {folder}{hint}")


def wide_print(table: Table) -> None:
    """A table off a terminal (CI logs, pipes) with room for every column on one line."""
    (stdout if sys.stdout.isatty() else Console(highlight=False, width=LIST_WIDTH)).print(table)


def batch_text(recipe: Recipe, short: bool = False) -> str:
    batch = recipe.batch
    if batch.unit == "tokens":
        return f"{batch.effective:,} tokens" + ("" if short else f" ({batch.sequences} x {batch.sequence_length})")
    return f"{batch.effective:,} samples"


def model_text(recipe: Recipe, counts: tuple[int, int] | None) -> str:
    """`resnet50 25.6M`, `llama-7b 6.74B (4.19M trainable)`, `factory pkg.mod:fn`."""
    spec = recipe.model
    name = spec.builtin or (f"factory {spec.factory}" if spec.factory else f"hf {spec.hf}")
    if counts is None:
        return name
    total, trainable = counts
    return f"{name} {format_count(total)}" + (f" ({format_count(trainable)} trainable)" if trainable != total else "")


@papers_app.callback()
def papers_command(
    ctx: typer.Context,
    folder: Path | None = typer.Option(None, "--dir", help=DIR_HELP),
    devices: bool = typer.Option(False, "--devices", help="The hardware each paper ran on, and whether the "
                                 "estimate meter models its device (--gpu), instead of the list."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the table as Markdown (docs/papers.md's)."),
    estimate: bool = typer.Option(False, "--estimate", help="With --devices: the estimate meter's largest "
                                  "micro-batch on each paper's own device, against the paper's (minutes)."),
) -> None:
    """List the shipped recipes: paper, effective batch, optimizer, model and parameters, and whether `reproduce run`
    can run it here (and why not, below the table)."""
    ctx.obj = folder
    if ctx.invoked_subcommand is not None:
        return
    directory = papers_dir(folder)
    files = recipe_files(directory)
    for given, option in ((markdown, "--markdown"), (estimate, "--estimate")):
        if given and not devices:
            raise UserError(f"{option}: only with --devices (reproduce papers --devices {option})")
    if devices:
        print_devices(files, markdown, estimate)
        return
    table = Table(title=f"recipes in {directory}", title_justify="left")
    table.add_column("recipe", no_wrap=True, min_width=max((len(p.stem) for p in files), default=6))
    table.add_column("year", no_wrap=True)
    table.add_column("paper", no_wrap=True, overflow="ellipsis", max_width=24)
    table.add_column("effective batch", justify="right", no_wrap=True)
    table.add_column("optimizer, lr", no_wrap=True)
    table.add_column("model, parameters")
    table.add_column("here", no_wrap=True)
    counts = {"runnable": 0, "plan-only": 0, "invalid": 0}
    reasons = []
    for path in files:
        try:
            recipe = load_recipe(path)
        except UserError as error:
            counts["invalid"] += 1
            table.add_row(escape(path.stem), "", "[red]invalid recipe[/]", "-", "-", "-", "[red]invalid[/]")
            reasons.append(f"  {path.stem}: {as_typed(error.lines[0], ())}")
            continue
        why = why_not_runnable(recipe)
        counts["plan-only" if why else "runnable"] += 1
        here = "[yellow]plan-only[/]" if why else "[green]runnable[/]"
        if why:
            reasons.append(f"  {path.stem}: {why}")
        year = str(recipe.paper.year) if recipe.paper and recipe.paper.year else ""
        title = recipe.paper.title if recipe.paper else "-"
        batch = batch_text(recipe, short=True)
        model = escape(model_text(recipe, parameter_counts(recipe)))
        table.add_row(escape(path.stem), year, escape(title), batch,
                      f"{recipe.optimizer.name} {recipe.optimizer.lr:g}", model, here)
    wide_print(table)
    if reasons:
        stdout.print("not runnable here (each can still be planned and probed):", markup=False)
        print_lines(reasons)
    line = f"{counts['runnable']} runnable here, {counts['plan-only']} plan-only"
    if counts["invalid"]:
        line += f", {counts['invalid']} invalid"
    stdout.print(line + ". Show one: reproduce papers show NAME", markup=False)


@papers_app.command("show")
def show_command(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", help="A recipe's file name without .yaml: goyal2017-resnet50."),
) -> None:
    """Print one recipe with syntax highlighting, and a short summary."""
    from rich.syntax import Syntax  # (pygments: only this command's colouring needs it)

    path = find_recipe(name, papers_dir(ctx.obj))
    text = path.read_text(encoding="utf-8")
    stdout.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    recipe = load_recipe(path)
    why = why_not_runnable(recipe)
    paper = "-" if recipe.paper is None else recipe.paper.title + (f" ({recipe.paper.year})" if recipe.paper.year
                                                                   else "")
    stdout.print(f"[bold]{escape(path.stem)}[/]: {escape(paper)}")
    batch = recipe.batch
    paper_split = ""
    if batch.devices and batch.per_device:
        paper_split = (f" (paper: {batch.per_device} per device x {batch.accumulation or 1} accumulation x "
                       f"{batch.devices} devices)")
    stdout.print(f"  effective batch {batch_text(recipe)}{paper_split}", markup=False)
    spec = recipe.optimizer
    stdout.print(f"  {spec.name} lr {spec.lr:g}, task {recipe.task}, precision {recipe.precision}", markup=False)
    stdout.print(f"  model: {model_line(recipe, parameter_counts(recipe))}", markup=False, soft_wrap=True)
    for deviation in recipe.deviations:
        stdout.print(f"  [yellow]deviation from the paper:[/] {escape(deviation.strip())}", soft_wrap=True)
    here = f"[yellow]plan-only[/] ({escape(why)})" if why else "[green]runnable[/]"
    stdout.print(f"  here: {here}")
    stdout.print(f"  file: {escape(described(path, name))}", soft_wrap=True)
    # the name works from any folder when it is the shipped file; a file of the user's is shown by its path
    shown = path.stem if is_shipped(path) and not Path(name).exists() else (
        path.relative_to(Path.cwd()) if path.is_absolute() and path.is_relative_to(Path.cwd()) else path)
    found = re.search(r"--micro-batch-max (\d+)", text)  # the recipe's own header suggests one
    micro = found.group(1) if found else "32"
    stdout.print(f"  plan it: reproduce plan {shown} --micro-batch-max {micro}", markup=False)
    if not why:
        stdout.print(f"  run it:  reproduce run {shown} --micro-batch-max {micro} --out runs/{path.stem}", markup=False)


def model_line(recipe: Recipe, counts: tuple[int, int] | None) -> str:
    """The model in one line: name, parameters (and what trains), weight dtype, LoRA."""
    spec = recipe.model
    text = model_text(recipe, None)
    if counts is not None:
        total, trainable = counts
        text += f", {total:,} parameters" + (f" ({trainable:,} trainable)" if trainable != total else "")
        if spec.builtin == "nanogpt":  # nanoGPT's own count leaves the position embeddings out
            positions = spec.kwargs.get("block_size", NANOGPT_DEFAULTS["block_size"]) * spec.kwargs.get(
                "n_embd", NANOGPT_DEFAULTS["n_embd"])
            text += f" (nanoGPT prints {(total - positions) / 1e6:.2f}M: without the position embeddings)"
    if spec.dtype != "fp32":
        text += f", weights in {spec.dtype}"
    if spec.quantize is not None:
        text += f", frozen base in {spec.quantize}"
    if spec.lora is not None:
        lora = spec.lora
        text += (f", LoRA r {lora.r} alpha {lora.lora_alpha:g} dropout {lora.dropout:g} on "
                 f"{', '.join(lora.target_modules)}")
    return text


COLUMNS = ("recipe", "paper's hardware", "per device", "accumulation", "effective batch", "sharding",
           "estimate meter (--gpu)")


def device_row(path: Path) -> list[str]:
    """The recipe's hardware, batch and sharding, and whether the estimate meter models its device (as which card)."""
    try:
        recipe = load_recipe(path)
    except UserError as error:
        return [path.stem, "invalid recipe", "-", "-", "-", "-", as_typed(error.lines[0], ())]
    batch, device = recipe.batch, recipe.batch.device
    if device is None and batch.devices is None:
        hardware = "not stated"
    elif device is None:
        hardware = f"{batch.devices} device{'s' if batch.devices != 1 else ''}, model not stated"
    else:
        hardware = f"{batch.devices if batch.devices is not None else '?'} x {device}"
    effective = batch_text(recipe, short=True)
    if batch.phases:
        effective += f" (of {len(batch.phases)} phases)"
    elif batch.ramp:
        effective += " (after a ramp)"
    if device is None:
        estimate = "runs here (data on this machine)" if recipe.data.available else "no device stated"
    else:
        try:
            gpu = lookup(device)
            estimate = f"{gpu.name} ({gpu.memory_gb:g} GiB)"
        except UserError as error:
            estimate = "a TPU: not modelled" if "TPU" in error.lines[0] else "not in the GPU catalog"
    return [
        path.stem, hardware,
        str(batch.per_device) if batch.per_device is not None else "-",
        str(batch.accumulation) if batch.accumulation is not None else "-",
        effective, batch.sharding if batch.sharding != "none" else "-", estimate,
    ]


ESTIMATE_COLUMNS = ("estimate's largest", "ratio")
RIGHT = ("per device", "accumulation", *ESTIMATE_COLUMNS)


def estimate_cells(path: Path) -> list[str]:
    """The estimate meter's largest micro-batch on the paper's own device, no headroom, and its ratio to the paper's
    per-device batch (evidence the estimate accepts what the paper ran); "-" where the device is no catalog GPU."""
    try:
        recipe = load_recipe(path)
        lookup(recipe.batch.device or "")
    except UserError:
        return ["-", "-"]
    from ..probe.runner import ProbeOptions, run_probe

    batch = recipe.batch
    world = batch.devices if batch.sharding == "fsdp" and batch.devices else 1
    options = ProbeOptions(gpu=batch.device, meter="estimate", headroom=0.0, time_steps=False)
    result = run_probe(recipe, str(path), options, world_size=world)
    if result.micro_batch_max is None:
        return ["none fits", "-"]
    largest = f">= {result.micro_batch_max}" if result.capped else str(result.micro_batch_max)
    ratio = f"{result.micro_batch_max / batch.per_device:.2f}" if batch.per_device else "-"
    return [largest, ratio]


def print_devices(files: list[Path], markdown: bool, estimate: bool = False) -> None:
    columns = COLUMNS + (ESTIMATE_COLUMNS if estimate else ())
    rows = [device_row(path) + (estimate_cells(path) if estimate else []) for path in files]
    if markdown:  # what docs/papers.md pastes
        lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if name in RIGHT else "---"
                                                                 for name in columns) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in rows]
        print("\n".join(lines) + "\n", end="")
        return
    table = Table(title="the papers' hardware (reproduce papers --devices --markdown: as Markdown)",
                  title_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in RIGHT else "left", no_wrap=name == "recipe")
    for cells in rows:
        table.add_row(*(escape(cell) for cell in cells))
    wide_print(table)
