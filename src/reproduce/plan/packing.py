"""`--packing` / `--token-budget`: how a window's samples group into micro-batches (pure Python, no torch).

The ways themselves live in data/packing.py; here the options become `data.packing` / `data.token_budget`, checked
as the recipe's fields are (`recipe.packing_problem`), so that a plan, a run and verify read them alike.
"""

from __future__ import annotations

from ..errors import UserError
from .planner import Plan
from .recipe import Recipe, default_packing, packing_problem

DEFAULT_WHY = ("the default for instruction and chat data: the fastest exact way with the dense attention runs "
               "here use (sdpa, eager); data.packing or --packing to choose")


def with_packing(recipe: Recipe, packing: str | None, token_budget: int | None = None) -> Recipe:
    """`recipe` with `--packing` / `--token-budget` as data.packing / data.token_budget (the options override the
    fields; model_copy skips the recipe's validators, so the fields' own check runs here)."""
    if packing is None and token_budget is None:
        return recipe
    update: dict[str, object] = {"packing": packing or recipe.data.packing}
    if token_budget is not None:
        update["token_budget"] = token_budget
    changed = recipe.model_copy(update={"data": recipe.data.model_copy(update=update)})
    problem = packing_problem(changed)
    if problem:
        raise UserError(problem.replace("data.packing:", "--packing:", 1)
                        .replace("data.token_budget:", "--token-budget:", 1))
    return changed


def packing_for_run(recipe: Recipe, plan: Plan | None, resume: bool, packing: str | None,
                    token_budget: int | None) -> tuple[Recipe, Plan | None]:
    """The run's recipe and plan with --packing / --token-budget. A resumed run keeps the grouping it was started
    with: the same options again (as --auto-resume repeats the command) are its own, others are refused."""
    if packing is None and token_budget is None:
        return recipe, plan
    if resume:
        kept = plan.recipe.data if plan is not None else recipe.data
        if (packing or kept.packing) == kept.packing and token_budget in (None, kept.token_budget):
            return recipe, plan
        raise UserError("--packing / --token-budget: a resumed run keeps the grouping it was started with (its "
                        f"plan.yaml's data.packing: {kept.packing}); leave them out with --resume")
    recipe = with_packing(recipe, packing, token_budget)
    return recipe, plan.model_copy(update={"recipe": recipe}) if plan is not None else None


def with_grouping_of(recipe: Recipe, other: Recipe) -> Recipe:
    """`recipe` with `other`'s data.packing and data.token_budget: a resumed run keeps the grouping it started with
    (`--packing` may have set it; the windows' samples are the same either way)."""
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={
        "packing": other.data.packing, "token_budget": other.data.token_budget})})


def kept_grouping(saved: Recipe) -> Recipe:
    """A saved plan's recipe, re-planned (resume_rules.replan) with the grouping it ran with: a plan written before
    instruction data defaulted to `sorted` left data.packing unset and ran `none`, which it keeps."""
    if saved.data.packing is None and default_packing(saved) is not None:
        return saved.model_copy(update={"data": saved.data.model_copy(update={"packing": "none"})})
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
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"packing": way,
                                                                            "token_budget": token_budget})})
