"""One way out of "does not fit": a change to the recipe or the options, measured at micro-batch 1 on the meter that
refused it (probe/advice.py lists them; probe/memory_ways.py adds the memory knobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..plan.recipe import Recipe, parse_recipe


@dataclass(frozen=True)
class WayOut:
    change: str  # what to change, as the user would: an option or a recipe field
    fits: bool
    peak_bytes: int | None  # one device's peak at micro-batch 1 with the change, as the meter decides it
    detail: str
    changes: dict | None = None  # the recipe fields it sets ({"model": {"lora": ...}}), for a program to apply


def changed_recipe(recipe: Recipe, changes: dict) -> Recipe:
    """`recipe` with `changes` merged in ({"model": {"dtype": "bf16"}, "precision": "bf16"}), validated again."""
    data = recipe.model_dump(mode="json", exclude_none=True)
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    return parse_recipe(data, source="(probe: way out)")


def measure_change(meter: Any, gpu: Any, change: dict) -> Any:
    """The trial of micro-batch 1 of the recipe with `change`, on `meter`'s budget and configuration (a Measurement),
    or why it cannot be measured (a string)."""
    from .workload import Workload

    try:
        changed = changed_recipe(meter.workload.recipe, change)
    except UserError as error:
        return f"not measured: {error.lines[0]}"
    workload = Workload(changed, meter.workload.data)
    # on the user's own configuration: the sharding and world size the failed trial was counted with
    kwargs = {"gpu": gpu, "sharding": meter.sharding, "world_size": meter.world_size} if meter.name == "estimate" \
        else {"time_steps": False}
    other = type(meter)(workload, meter.budget_bytes, 1 - meter.limit_bytes / meter.budget_bytes, cap=meter.cap,
                        **kwargs)
    try:
        return other.measure(1)
    except UserError as error:  # (a model with no blocks to checkpoint)
        return f"not measured: {error.lines[0]}"
    finally:
        other.close()
