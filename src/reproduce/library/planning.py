"""The plan for a user's own loop, from a recipe (as `reproduce plan` makes it) or from plain arguments:
the `Plan` that `reproduce plan --json` describes, with `lr_at(plan, step)` for the schedule.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..plan.planner import Plan, lr_at, make_plan
from ..plan.recipe import Recipe, load_recipe, parse_recipe
from ..probe.runner import ProbeOptions

__all__ = ["lr_at", "plan_batch", "plan_recipe"]


def _recipe(recipe: Recipe | dict | str | Path) -> tuple[Recipe, str | None]:
    if isinstance(recipe, Recipe):
        return recipe, None
    if isinstance(recipe, dict):
        return parse_recipe(recipe), None
    from ..shipped import resolve_recipe

    path = resolve_recipe(recipe)
    return load_recipe(path), str(path)


def plan_recipe(recipe: Recipe | dict | str | Path, micro_batch_max: int | None = None, world_size: int = 1, *,
         policy: str = "exact", memory: str | None = None, gpu: str | None = None, meter: str = "auto",
         headroom: float = 0.1) -> Plan:
    """The plan `reproduce plan RECIPE` makes: `micro_batch_max` given, or probed (this GPU, or `memory`
    / `gpu` with the `meter`), the data's size counted as the command counts it."""
    from ..session import plan_and_probe, planned_data_size

    loaded, path = _recipe(recipe)
    data, size = planned_data_size(loaded)
    options = ProbeOptions(memory=memory, gpu=gpu, meter=meter, headroom=headroom)
    return plan_and_probe(loaded, path or "<recipe>", micro_batch_max, world_size, policy, size, probe=options,
                          data=data).plan


def plan_batch(effective_batch: int, micro_batch_max: int, *, lr: float, unit: str = "samples",
               sequence_length: int | None = None, world_size: int = 1, optimizer: str = "adamw",
               lr_rule: str = "auto", steps: int = 1, paper_devices: int | None = None,
               paper_per_device: int | None = None, policy: str = "exact") -> Plan:
    """The plan from plain arguments: the paper's `effective_batch` in `unit` (samples, or tokens with
    `sequence_length`), the largest `micro_batch_max` that fits one process, `world_size`, the paper's `lr` for its
    `optimizer` and the rule for an unmatched batch (`auto`: linear for SGD, square root for Adam; `linear`, `sqrt`,
    `none`), `steps` optimizer steps; the model and data are `your model` and `your data`."""
    if unit not in ("samples", "tokens"):
        raise UserError(f"expected samples or tokens (got {unit!r})", field="unit")
    given = {"sequence_length": sequence_length, "devices": paper_devices, "per_device": paper_per_device}
    recipe = parse_recipe({
        "batch": {"effective": effective_batch, "unit": unit, **{k: v for k, v in given.items() if v is not None}},
        "task": "language-modeling" if unit == "tokens" else "classification",
        "model": {"factory": "your_code:model"},
        "data": {"name": "your data", "available": False},
        "optimizer": {"name": optimizer, "lr": lr},
        "scaling_rule": lr_rule,
        "schedule": {"total": {"steps": steps}},
    })
    return make_plan(recipe, micro_batch_max, world_size, policy)  # type: ignore[arg-type]
