"""`reproduce papers --devices [--markdown]`: the hardware each shipped paper ran on, from its recipe alone.

One row per recipe: the devices and the device the paper names, its per-device batch and accumulation, the
effective batch, sharding, and what the estimate meter can do with that device (`--gpu` reads the same names:
probe/catalog.py). docs/papers.md holds the Markdown of this table; a test keeps the two equal, so the table lists
every recipe and cannot go stale. No torch: only the recipes and the GPU catalog are read.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import UserError
from ..probe.catalog import lookup
from ..recipe import Recipe, load_recipe
from .common import is_terminal, stdout

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
        return [path.stem, "invalid recipe", "-", "-", "-", "-", error.lines[0]]
    batch = recipe.batch
    return [
        path.stem, hardware(recipe),
        str(batch.per_device) if batch.per_device is not None else "-",
        str(batch.accumulation) if batch.accumulation is not None else "-",
        effective_text(recipe), batch.sharding if batch.sharding != "none" else "-", estimate_text(recipe),
    ]


def markdown_table(files: list[Path]) -> str:
    """The table as Markdown, one row per recipe (what docs/papers.md pastes)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if name in ("per device", "accumulation")
                                                          else "---" for name in COLUMNS) + "|"]
    for path in files:
        cells = [cell.replace("|", "\\|") for cell in device_row(path)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def print_devices(files: list[Path], markdown: bool) -> None:
    if markdown:
        print(markdown_table(files), end="")
        return
    table = Table(title="the papers' hardware (reproduce papers --devices --markdown: as Markdown)",
                  title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="right" if name in ("per device", "accumulation") else "left",
                         no_wrap=name == "recipe")
    for path in files:
        table.add_row(*(escape(cell) for cell in device_row(path)))
    (stdout if is_terminal() else Console(highlight=False, width=WIDTH)).print(table)
