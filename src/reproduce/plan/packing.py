"""The grouping a plan keeps: `data.packing` and `data.token_budget` as the planner, the probe and a resume fix them
(pure Python, no torch). The ways live in data/packing.py; the default's rule is `recipe.default_packing`."""

from __future__ import annotations

from .overlay import Change, overlay
from .recipe import Recipe, default_packing

DEFAULT_WHY = ("the default for instruction and chat data: the fastest exact way, timed here when the probe ran, "
               "else the fastest measured for this model (packed through the varlen attention for transformers' GPT-2 "
               "and LLaMA, else sorted); data.packing or --packing to choose")


def kept_grouping(saved: Recipe) -> Recipe:
    """A saved plan's recipe, re-planned (resume_rules.replan) with the grouping it ran with: a plan written before
    instruction data defaulted to `sorted` left data.packing unset and ran `none`, which it keeps."""
    if saved.data.packing is None and default_packing(saved) is not None:
        return overlay(saved, [Change("data.packing", "none")], "the saved plan's recipe")
    return saved


def packing_origin(given: Recipe, planned: Recipe) -> str | None:
    """Where the plan's data.packing came from: the recipe or --packing, the data's default (`default_packing`),
    or None when neither gave one (the plan groups as `none`, as for any data without lengths)."""
    if given.data.packing is not None:
        return "data.packing, --packing"
    return DEFAULT_WHY if planned.data.packing is not None else None


def with_probed_budget(recipe: Recipe, token_budget: int | None) -> Recipe:
    """`recipe` with the token budget the probe measured for `sorted` (probe/tokens.py) as data.token_budget, and
    the way it was measured for (the default's `sorted`, written out); unchanged without one or with its own."""
    if token_budget is None or recipe.data.token_budget is not None:
        return recipe
    way = recipe.data.packing or default_packing(recipe)
    return overlay(recipe, [Change("data.packing", way), Change("data.token_budget", token_budget)], "the probe")
