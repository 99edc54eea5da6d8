"""`reproduce papers`: the shipped recipes, and whether each can run here; `reproduce papers show NAME` prints one.

No torch: whether a recipe is runnable is decided from the built-in names (`reproduce.builtin_names`), the
data's availability, and whether factories and Hugging Face models are on this machine.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import typer
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from ..builtin_names import why_not_runnable
from ..errors import UserError
from ..recipe import Recipe, load_recipe
from .app import app
from .common import stdout

DIR_HELP = "Folder of recipes (default: ./papers if present, else the papers/ shipped with reproduce)."

papers_app = typer.Typer(
    help="The shipped paper recipes: list them, or `show NAME` for one.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(papers_app, name="papers")


def shipped_dir() -> Path:
    """The papers/ folder of this checkout (src/reproduce/cli/papers.py -> the repository root)."""
    return Path(__file__).resolve().parents[3] / "papers"


def papers_dir(given: Path | None) -> Path:
    if given is not None:
        if not given.is_dir():
            raise UserError(f"--dir: {given} is not a folder")
        return given
    for folder in (Path.cwd() / "papers", shipped_dir()):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    raise UserError("--dir: no papers/ folder here or beside reproduce's source; give --dir FOLDER")


def recipe_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))


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


def batch_text(recipe: Recipe, short: bool = False) -> str:
    batch = recipe.batch
    if batch.unit == "tokens":
        return f"{batch.effective:,} tokens" + ("" if short else f" ({batch.sequences} x {batch.sequence_length})")
    return f"{batch.effective:,} samples"


def paper_text(recipe: Recipe) -> str:
    if recipe.paper is None:
        return "-"
    return recipe.paper.title + (f" ({recipe.paper.year})" if recipe.paper.year else "")


def optimizer_text(recipe: Recipe) -> str:
    return f"{recipe.optimizer.name} {recipe.optimizer.lr:g}"


def status_text(recipe: Recipe) -> tuple[str, str]:
    """("runnable", "") or ("plan-only", why)."""
    reason = why_not_runnable(recipe)
    return ("plan-only", reason) if reason else ("runnable", "")


@papers_app.callback()
def papers_command(
    ctx: typer.Context,
    folder: Path | None = typer.Option(None, "--dir", help=DIR_HELP),
) -> None:
    """List the shipped recipes: paper, effective batch, optimizer, and whether `reproduce run` can run it here."""
    ctx.obj = folder
    if ctx.invoked_subcommand is not None:
        return
    directory = papers_dir(folder)
    files = recipe_files(directory)
    table = Table(title=f"recipes in {directory}", title_justify="left")
    table.add_column("recipe", no_wrap=True, min_width=max((len(p.stem) for p in files), default=6))
    table.add_column("year", no_wrap=True)
    table.add_column("paper", no_wrap=True, overflow="ellipsis", max_width=24)
    table.add_column("effective batch", justify="right", no_wrap=True)
    table.add_column("optimizer, lr", no_wrap=True)
    table.add_column("here")
    counts = {"runnable": 0, "plan-only": 0, "invalid": 0}
    for path in files:
        try:
            recipe = load_recipe(path)
        except UserError as error:
            counts["invalid"] += 1
            problem = f"[red]{escape(error.lines[0])}[/]"
            table.add_row(escape(path.stem), "", "[red]invalid recipe[/]", "-", "-", problem)
            continue
        status, why = status_text(recipe)
        counts[status] += 1
        here = "[green]runnable[/]" if status == "runnable" else f"[yellow]plan-only[/] ({escape(why)})"
        year = str(recipe.paper.year) if recipe.paper and recipe.paper.year else ""
        title = recipe.paper.title if recipe.paper else "-"
        batch = batch_text(recipe, short=True)
        table.add_row(escape(path.stem), year, escape(title), batch, optimizer_text(recipe), here)
    stdout.print(table)
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
    path = find_recipe(name, papers_dir(ctx.obj))
    text = path.read_text(encoding="utf-8")
    stdout.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    recipe = load_recipe(path)
    status, why = status_text(recipe)
    stdout.print(f"[bold]{escape(path.stem)}[/]: {escape(paper_text(recipe))}")
    batch = recipe.batch
    paper_split = ""
    if batch.devices and batch.per_device:
        paper_split = (f" (paper: {batch.per_device} per device x {batch.accumulation or 1} accumulation x "
                       f"{batch.devices} devices)")
    stdout.print(f"  effective batch {batch_text(recipe)}{paper_split}", markup=False)
    spec = recipe.optimizer
    stdout.print(f"  {spec.name} lr {spec.lr:g}, task {recipe.task}, precision {recipe.precision}", markup=False)
    here = "[green]runnable[/]" if status == "runnable" else f"[yellow]plan-only[/] ({escape(why)})"
    stdout.print(f"  here: {here}")
    shown = path if not path.is_absolute() else _relative(path)
    found = re.search(r"--micro-batch-max (\d+)", text)  # the recipe's own header suggests one
    micro = found.group(1) if found else "32"
    stdout.print(f"  plan it: reproduce plan {shown} --micro-batch-max {micro}", markup=False)
    if status == "runnable":
        stdout.print(f"  run it:  reproduce run {shown} --micro-batch-max {micro} --out runs/{path.stem}", markup=False)


def _relative(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
