"""The resume rules: what a run continued with `reproduce run --resume` keeps from the run it continues, and how a
plan is re-derived for another number of processes, a smaller micro-batch or the data's size. Values in, values
out; a request that would change the run raises UserError naming the option. Pure Python, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError
from .memory_options import with_knobs_of, with_quantized_base
from .overrides import overrides_of_recipe
from .packing import kept_grouping, with_grouping_of
from .planfile import load_plan, load_recipe_or_plan
from .planner import Plan
from .planner import plan as make
from .recipe import Recipe, parse_recipe, with_backbone_weights, with_data_paths, with_weights
from .sharding import with_sharding
from .weightfiles import data_fingerprint, fingerprint_of, inspect


def replan(saved: Plan, world_size: int, micro_batch: int | None, dataset_size: int | dict[int | None, int],
           source: Path | str) -> Plan:
    """The same effective batch and schedule on another number of processes, or with a smaller micro-batch (a
    resumed run that ran out of memory; None: keep the plan's), or with the dataset's size when the plan was made
    without it: N and the steps per epoch are re-derived. With batch phases each sequence
    length keeps its own micro-batch, lowered to `micro_batch` where that is smaller."""
    cap = micro_batch or saved.micro_batch
    per_length = {s.sequence_length: min(s.micro_batch, micro_batch or s.micro_batch) for s in saved.segments}
    micro = per_length if len(per_length) > 1 else cap  # one micro-batch per sequence length the plan reads
    again = make(kept_grouping(saved.recipe), micro, world_size, saved.policy, dataset_size=dataset_size,
                 recipe_path=saved.recipe_path).model_copy(update={"weights": saved.weights,
                                                                   "data_fingerprint": saved.data_fingerprint})
    same: tuple[str, ...] = ("effective_batch", "steps_per_epoch", "optimizer_steps", "warmup_steps",
                             "decay_milestones")
    if saved.dataset_size is None:  # made without the data: its steps were not known, only its batches
        same = ("effective_batch",)

    def steps(p: Plan) -> list[object]:
        if saved.dataset_size is None:
            return [segment.effective_batch for segment in p.segments]
        return [(segment.start_step, segment.steps, segment.effective_batch) for segment in p.segments]

    # what the saved plan could not know (made without the data: `reproduce plan --out`) comes from the data now
    changed = [field for field in same if getattr(saved, field) is not None and getattr(again, field) != getattr(
        saved, field)]
    if changed or steps(again) != steps(saved):
        raise UserError(
            f"{source}: world_size: the plan ({saved.arithmetic}{steps_text(saved)}) cannot be kept "
            f"on {world_size} processes with micro-batch {cap}; plan again for {world_size}"
        )
    return again


def steps_text(plan: Plan) -> str:
    """`, 300 steps`, or nothing for a plan whose schedule was never known (never `None steps`)."""
    return f", {plan.optimizer_steps} steps" if plan.optimizer_steps is not None else ""


def resumed_data_paths(recipe: Recipe, saved: Recipe, data_path: str | None, eval_data_path: str | None,
                       out: Path, source: str) -> Recipe:
    """Resuming reads the data the run read: its paths come from its plan.yaml; --data / --eval-data, when given,
    must name the same."""
    if recipe.data.format is None or saved.data.format is None:
        return recipe

    def same(a: str | None, b: str | None) -> bool:
        if a is None or b is None:
            return a is b
        return Path(a).expanduser().absolute() == Path(b).expanduser().absolute()

    for option, given, mine, ran in (("--data", data_path, recipe.data.path, saved.data.path),
                                     ("--eval-data", eval_data_path, recipe.data.eval_path, saved.data.eval_path)):
        if given is not None and not same(mine, ran):
            raise UserError(f"{option}: the run in {out} read {ran}; --resume continues it on the same data "
                            f"(got {mine})")
    data = recipe.model_dump(mode="json")
    data["data"].update(path=saved.data.path, eval_path=saved.data.eval_path, available=saved.data.available)
    return parse_recipe(data, source)


def check_resumed_weights(recipe: Recipe, saved: Plan, weights_path: str | None, out: Path) -> None:
    """A resumed run continues from the weights it started from: the same path (--weights, when given), and the same
    content as the fingerprint in its plan.yaml says."""
    ran, mine = saved.recipe.model.weights, recipe.model.weights
    if weights_path is not None and (ran is None or Path(ran) != Path(mine or "")):
        raise UserError(f"--weights: the run in {out} started from {ran or 'random weights'}; --resume continues it "
                        f"from the same (got {mine})")
    if saved.weights is None or ran is None:
        return
    if not Path(ran).exists():
        raise UserError(f"--resume: the run in {out} started from the weights {ran}, which are no longer there")
    now = fingerprint_of(inspect(ran))
    if now != saved.weights.fingerprint:
        raise UserError(f"--resume: the weights {ran} changed since the run in {out} started (fingerprint "
                        f"{saved.weights.fingerprint} in its plan.yaml, {now} now); resume it with the weights it "
                        "started from, or start a new run")


def check_resumed_data(saved: Plan, out: Path) -> None:
    """A resumed run reads the data files it started on, unchanged since (the fingerprint in its plan.yaml)."""
    if saved.data_fingerprint is None:
        return
    data = saved.recipe.data
    now = data_fingerprint([data.path, data.eval_path])
    if now != saved.data_fingerprint:
        raise UserError(f"--resume: the data {data.path} changed since the run in {out} started (fingerprint "
                        f"{saved.data_fingerprint} in its plan.yaml, {now} now); resume it on the data it started "
                        "on, or start a new run")


def recipe_and_plan(source: Path, out: Path, resume: bool, sharding: str | None, data_path: str | None,
                    eval_data_path: str | None, weights_path: str | None = None,
                    quantize: str | None = None, backbone_path: str | None = None,
                    overrides: Sequence[str] = ()) -> tuple[Recipe, Plan | None]:
    """The recipe (and plan, when given or resumed) with the data paths, the weights, the sharding and the quantised
    base this run uses: --data / --eval-data, --weights, --sharding and --quantize, else the recipe's; a resumed run
    keeps the data, weights, sharding and base it was started with (and refuses weights whose content changed
    since)."""
    recipe, plan = load_recipe_or_plan(source)
    recipe = overrides_of_recipe(recipe, overrides, plan is not None, str(source))  # --set: first, as the file
    recipe = with_data_paths(with_weights(recipe, weights_path, str(source)), data_path, eval_data_path, str(source))
    recipe = with_backbone_weights(recipe, backbone_path, str(source))
    if not resume:
        recipe = with_sharding(with_quantized_base(recipe, quantize, str(source)), sharding)
        return recipe, plan.model_copy(update={"recipe": recipe}) if plan is not None else None
    saved = load_plan(out / "plan.yaml") if (out / "plan.yaml").is_file() else None
    if saved is None:
        raise UserError(f"--resume: {out} has no plan.yaml to resume")
    if backbone_path is not None and recipe.model.backbone_weights != saved.recipe.model.backbone_weights:
        raise UserError(f"--backbone-weights: the run in {out} continues from its checkpoint; resume it without the "
                        "option (its plan.yaml keeps the backbone file it started from)")
    started = saved.recipe.batch.sharding
    if sharding is not None and sharding != started:
        raise UserError(f"--sharding: the run in {out} was started with sharding {started}; resume it with the same "
                        f"(got {sharding})")
    recipe = resumed_data_paths(recipe, saved.recipe, data_path, eval_data_path, out, str(source))
    check_resumed_weights(recipe, saved, weights_path, out)
    check_resumed_data(saved, out)
    base = saved.recipe.model.quantize
    if quantize is not None and quantize != base:
        raise UserError(f"--quantize {quantize}: the run in {out} was started with {base or 'an unquantised'} base; "
                        "resume it as it was started (its plan.yaml keeps model.quantize)")
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"quantize": base})})
    kept = with_grouping_of(with_knobs_of(with_sharding(recipe, started), saved.recipe), saved.recipe)
    if kept != saved.recipe:  # (knobs the plan took, and --packing, kept)
        raise UserError(f"--resume: the recipe in {source} differs from the one {out}/plan.yaml was run with")
    return saved.recipe, saved

