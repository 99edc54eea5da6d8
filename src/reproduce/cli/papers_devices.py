"""`reproduce papers --devices [--markdown] [--estimate]`: the hardware each shipped paper ran on, from its recipe
alone (no torch), and with `--estimate` what the estimate meter measures on that device. docs/papers.md holds both
tables; a test keeps them equal to this output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import UserError
from ..hardware.catalog import lookup
from ..plan.recipe import load_recipe
from .common import stdout
from .flags import as_typed

COLUMNS = ("recipe", "paper's hardware", "per device", "accumulation", "effective batch", "sharding",
           "estimate meter (--gpu)")
WIDTH = 165


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
    effective = f"{batch.effective:,} tokens" if batch.unit == "tokens" else f"{batch.effective:,} samples"
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
    (stdout if sys.stdout.isatty() else Console(highlight=False, width=WIDTH)).print(table)
