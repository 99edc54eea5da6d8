"""`reproduce papers --devices [--markdown]`: the hardware each shipped paper ran on, from its recipe alone.

One row per recipe: the devices and the device the paper names, its per-device batch and accumulation, the
effective batch, sharding, and what the estimate meter can do with that device (`--gpu` reads the same names:
hardware/catalog.py). docs/papers.md holds the Markdown of this table; a test keeps the two equal, so the table lists
every recipe and cannot go stale. No torch: only the recipes and the GPU catalog are read.

`--estimate` adds what the estimate meter measures on each paper's own device (minutes: it probes every paper
whose device is a catalog GPU); docs/papers.md pastes that table too, and the test checks its rows' recipe
columns against the plain table.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import UserError
from ..hardware.catalog import lookup
from ..plan.recipe import Recipe, load_recipe
from .common import stdout
from .flags import as_typed

COLUMNS = ("recipe", "paper's hardware", "per device", "accumulation", "effective batch", "sharding",
           "estimate meter (--gpu)")
WIDTH = 165


def hardware(recipe: Recipe) -> str:
    batch = recipe.batch
    if batch.device is None and batch.devices is None:
        return "not stated"
    if batch.device is None:
        return f"{batch.devices} device{'s' if batch.devices != 1 else ''}, model not stated"
    return f"{batch.devices if batch.devices is not None else '?'} x {batch.device}"


def estimate_text(recipe: Recipe) -> str:
    """Whether the estimate meter models the paper's device, and as which catalog card."""
    device = recipe.batch.device
    if device is None:
        return "runs here (data on this machine)" if recipe.data.available else "no device stated"
    try:
        gpu = lookup(device)
    except UserError as error:
        return "a TPU: not modelled" if "TPU" in error.lines[0] else "not in the GPU catalog"
    return f"{gpu.name} ({gpu.memory_gb:g} GiB)"


def effective_text(recipe: Recipe) -> str:
    batch = recipe.batch
    text = f"{batch.effective:,} tokens" if batch.unit == "tokens" else f"{batch.effective:,} samples"
    if batch.phases:
        text += f" (of {len(batch.phases)} phases)"
    elif batch.ramp:
        text += " (after a ramp)"
    return text


def device_row(path: Path) -> list[str]:
    try:
        recipe = load_recipe(path)
    except UserError as error:
        return [path.stem, "invalid recipe", "-", "-", "-", "-", as_typed(error.lines[0], ())]
    batch = recipe.batch
    return [
        path.stem, hardware(recipe),
        str(batch.per_device) if batch.per_device is not None else "-",
        str(batch.accumulation) if batch.accumulation is not None else "-",
        effective_text(recipe), batch.sharding if batch.sharding != "none" else "-", estimate_text(recipe),
    ]


ESTIMATE_COLUMNS = ("estimate's largest", "ratio")
RIGHT = ("per device", "accumulation", *ESTIMATE_COLUMNS)


def estimate_cells(path: Path) -> list[str]:
    """The estimate meter's largest micro-batch on the paper's own device, with no headroom (sharded over the
    paper's devices with `batch.sharding: fsdp`), and its ratio to the paper's per-device batch: evidence that
    the estimate accepts what the paper ran. "-" where the paper names no catalog GPU. Minutes for the large
    models (the probe's cache keeps each result)."""
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


def rows(files: list[Path], estimate: bool) -> list[list[str]]:
    return [device_row(path) + (estimate_cells(path) if estimate else []) for path in files]


def markdown_table(files: list[Path], estimate: bool = False) -> str:
    """The table as Markdown, one row per recipe (what docs/papers.md pastes)."""
    columns = COLUMNS + (ESTIMATE_COLUMNS if estimate else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if name in RIGHT else "---"
                                                             for name in columns) + "|"]
    for cells in rows(files, estimate):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def print_devices(files: list[Path], markdown: bool, estimate: bool = False) -> None:
    if markdown:
        print(markdown_table(files, estimate), end="")
        return
    table = Table(title="the papers' hardware (reproduce papers --devices --markdown: as Markdown)",
                  title_justify="left")
    for name in COLUMNS + (ESTIMATE_COLUMNS if estimate else ()):
        table.add_column(name, justify="right" if name in RIGHT else "left", no_wrap=name == "recipe")
    for cells in rows(files, estimate):
        table.add_row(*(escape(cell) for cell in cells))
    (stdout if sys.stdout.isatty() else Console(highlight=False, width=WIDTH)).print(table)
