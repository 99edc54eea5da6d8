"""The session: what a command decides between reading its options and showing its output, as values: the
recipe changed and validated once, a run's checks (`checked_run`, before launching), data, probe and plan
(`prepare_run`). Nothing here prints: lines come back as data or go to `on_note`; torch is imported only where
something is measured or built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import MicroBatchError, UserError
from .model_facts import count_factory_batchnorm, weights_of
from .plan.overlay import Change, changes_of, overlay, phase_recipe, resumed
from .plan.packing import with_probed_budget
from .plan.planfile import load_plan, load_recipe_or_plan
from .plan.planner import MicroBatchMax, Plan, finish_plan, make_plan
from .plan.recipe import NamedData, Recipe, default_packing, load_recipe
from .plan.resume_rules import check_resumed_data, check_resumed_weights, replan
from .plan.sharding import check_sharding
from .plan.units import parse_size
from .plan.weightfiles import data_fingerprint
from .probe.runner import (
    BudgetRequired,
    ProbeOptions,
    ProbeResult,
    does_not_fit,
    measures_whole_model,
    probe_line,
    run_probe,
)
from .train.options import RunRequest

if TYPE_CHECKING:
    from .data import Datasets

OnNote = Callable[[str], None]


@dataclass
class Planned:
    """A plan and the probe's result behind it (None: nothing was probed)."""

    plan: Plan
    probe: ProbeResult | None = None


def plan_and_probe(recipe: Recipe, recipe_path: str, micro_batch_max: MicroBatchMax | None, world_size: int,
                   policy: str = "exact", dataset_size: int | dict | None = None, *, probe: ProbeOptions | None = None,
                   data: Datasets | None = None, keep_batchnorm: bool = True, on_note: OnNote | None = None,
                   fingerprint: str | None = None) -> Planned:
    """Plan `recipe`; the one place that decides where the micro-batch maximum comes from: given, or measured by
    the memory probe (`probe`: budget and meter; default: this GPU) on `data` when built. With batch phases of
    several sequence lengths it probes each length at its largest batch (what fits at 128 tokens does not at 512);
    the result returned is the main length's. `fingerprint`: the data files' (a run's); `on_note`: how the plan was
    reached, a line at a time."""
    note = on_note if on_note is not None else lambda line: None
    if policy == "throughput":
        from .throughput.policy import check_phases

        check_phases(recipe)  # before a probe per phase: refused at the end anyway
    result, memory = None, []
    if micro_batch_max is not None and probe is not None and searches_budget(recipe, probe):
        recipe, result = budget_for_memory(recipe, recipe_path, world_size, probe, data, note)
    elif micro_batch_max is not None and probe is not None and probe.memory:
        note(f"`memory` {probe.memory}: not used: `micro_batch_max` was given, so nothing was probed (the "
             "micro-batch; the token budget, the micro-batch x the longest example, not searched; the ways to group "
             "the data, not timed); leave `micro_batch_max` out to probe for that memory")
    if micro_batch_max is None and len(recipe.batch.sequence_lengths) > 1:
        micro_batch_max, result = probe_phases(recipe, recipe_path, world_size, policy, dataset_size, probe, data, note)
    if micro_batch_max is None:
        recipe, result, memory = probe_recipe(recipe, recipe_path, world_size, probe, data, note)
        micro_batch_max = result.micro_batch_max
    plan = probed_plan(recipe, recipe_path, micro_batch_max, world_size, policy, dataset_size, result, probe=probe,
                       data=data, keep_batchnorm=keep_batchnorm, on_note=note, memory=memory, fingerprint=fingerprint)
    return Planned(plan, result)


def searches_budget(recipe: Recipe, probe: ProbeOptions) -> bool:
    """Whether `memory`/`gpu` leave a token budget to search beside a given `micro_batch_max`: sorted's, not given."""
    return (bool(probe.memory or probe.gpu) and (recipe.data.packing or default_packing(recipe)) == "sorted"
            and recipe.data.token_budget is None and len(recipe.batch.sequence_lengths) == 1)


def budget_for_memory(recipe: Recipe, recipe_path: str, world_size: int, probe: ProbeOptions, data: Datasets | None,
                      note: OnNote) -> tuple[Recipe, ProbeResult]:
    """`sorted`'s T searched for the memory, the micro-batch given kept (the probe's rows bracket T, probe/tokens)."""
    result = run_probe(recipe, recipe_path, probe, world_size, data=data)
    if result.micro_batch_max is None:
        raise does_not_fit(result)
    given = f"`memory` {probe.memory}" if probe.memory else f"`gpu` {probe.gpu}"
    found = (f"searched for it: {result.token_budget:,} tokens per micro-batch (sorted)" if result.token_budget else
             "not searched: the whole batch per process fits in rows of the longest example (T: the micro-batch x the "
             "longest example)")  # (probe/tokens.py: no T to search only then, one row fitting)
    note(f"{given}: `micro_batch_max` was given, so the micro-batch was not probed (nor the ways to group the data "
         f"timed); the token budget, {found}")
    return with_probed_budget(recipe, result.token_budget), result


def probe_phases(recipe: Recipe, recipe_path: str, world_size: int, policy: str, dataset_size: int | dict | None,
                 probe: ProbeOptions | None, data: Datasets | None,
                 note: OnNote) -> tuple[MicroBatchMax, ProbeResult | None]:
    """Each sequence length's micro-batch maximum (`data` for the main length only) and the main length's result;
    each length's plan is made and dropped, as a check (on `dataset_size`: a schedule in epochs counts from it)."""
    maxima: dict[int | None, int] = {}
    main_result, unheard = None, lambda line: None  # (a phase's own lines: its `sequence length` line says it)
    for length, fixed in phase_probes(recipe).items():
        main = length == recipe.batch.sequence_length
        phase_data = data if main else None
        fixed, result, memory = probe_recipe(fixed, recipe_path, world_size, probe, phase_data, unheard)
        assert result.micro_batch_max is not None  # (probe_recipe raised DoesNotFit otherwise)
        probed_plan(fixed, recipe_path, result.micro_batch_max, world_size, policy, dataset_size, result, probe=probe,
                    data=phase_data, keep_batchnorm=True, on_note=unheard, memory=memory, fingerprint=None)
        note(f"sequence length {length}: {probe_line(result)}")
        maxima[length] = result.micro_batch_max
        main_result = result if main else main_result
    return maxima, main_result


def probe_recipe(recipe: Recipe, recipe_path: str, world_size: int, probe: ProbeOptions | None,
                 data: Datasets | None, note: OnNote) -> tuple[Recipe, ProbeResult, list[str]]:
    """One recipe's memory probe: the recipe with the memory knobs, token budget and way it chose, the result (with a
    maximum, else DoesNotFit) and the memory notes; a probe error adds that the maximum can be given instead."""
    options = probe or ProbeOptions()
    try:
        result = run_probe(recipe, recipe_path, options, world_size, data=data)
    except BudgetRequired:
        raise UserError(
            "`micro_batch_max`: required when there is no GPU here to probe: give `micro_batch_max` N, "
            "or `memory` SIZE / `gpu` NAME to probe for that memory"
        ) from None
    except MicroBatchError:
        raise
    except UserError as error:
        hint = f"{error.lines[-1]} (or give `micro_batch_max` to skip the probe)"
        raise UserError(*error.lines[:-1], hint) from None
    from .probe.memory_plan import choose as choose_memory  # (imports torch: only when the probe ran)

    recipe, result, memory = choose_memory(
        recipe, result, lambda changed: run_probe(changed, recipe_path, options, world_size, data=data), world_size)
    if result.micro_batch_max is None:
        raise does_not_fit(result)
    default = default_packing(recipe) if recipe.data.packing is None else None  # the way the rule gives
    recipe = with_probed_budget(recipe, result.token_budget)  # sorted: T measured in tokens (probe/tokens.py)
    note(probe_line(result))
    if default is not None:
        recipe, result = fastest_way(recipe, default, result, result.micro_batch_max, world_size, data, note)
    return recipe, result, memory


def probed_plan(recipe: Recipe, recipe_path: str, micro_batch_max: MicroBatchMax, world_size: int, policy: str,
                dataset_size: int | dict | None, result: ProbeResult | None, *, probe: ProbeOptions | None,
                data: Datasets | None, keep_batchnorm: bool, on_note: OnNote, memory: list[str],
                fingerprint: str | None) -> Plan:
    """The plan of `recipe` for a micro-batch maximum given or probed (`result`), by the chosen policy."""
    if policy == "throughput":  # the exact splits timed, the fastest taken (throughput/policy.py)
        from .throughput.policy import throughput_plan

        return throughput_plan(recipe, recipe_path, micro_batch_max, world_size, dataset_size, result, data=data,
                               keep_batchnorm=keep_batchnorm, gpu=probe.gpu if probe else None, on_note=on_note,
                               weights=weights_of(recipe), data_fingerprint=fingerprint)
    counted = count_factory_batchnorm(recipe, data)
    # with the memory knobs the plan took, or the ways it weighed (probe/memory_plan.py)
    return make_plan(recipe, micro_batch_max, world_size, policy, dataset_size=dataset_size, recipe_path=recipe_path,
                     batchnorm_layers=counted, memory_notes=memory, weights=weights_of(recipe),
                     data_fingerprint=fingerprint)


def fastest_way(recipe: Recipe, default: str, result: ProbeResult, micro_batch_max: int, world_size: int,
                data: Datasets | None, note: OnNote) -> tuple[Recipe, ProbeResult]:
    """`recipe`, whose data.packing the rule defaulted to `default`, with the way to group its data that ran
    fastest here (none, sorted, and packed where the default is), and `result` with what was timed; as they are
    unless the probe measured this device (cpu or cuda meter), one process, on the run's data."""
    if data is None or world_size != 1 or result.meter not in ("cpu", "cuda"):
        return recipe, result
    import torch

    from .throughput.ways import time_ways

    plan = make_plan(recipe, micro_batch_max, world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if result.meter == "cuda" else torch.device("cpu")
    ways = ["none", "sorted"] + (["packed"] if default == "packed" else [])
    timings = time_ways(recipe, ways, plan.micro_batch, plan.micro_batch * plan.accumulation_steps, data, device)
    note(timings.line())
    changes = [Change("data.packing", timings.chosen)]
    if timings.chosen != "sorted" and recipe.data.token_budget is not None:
        changes.append(Change("data.token_budget", None))  # (sorted's, measured by the probe)
    return overlay(recipe, changes, "the ways' timing"), result.model_copy(update={"ways": timings.to_json()})


def phase_probes(recipe: Recipe) -> dict[int | None, Recipe]:
    """For each sequence length of the batch phases, the recipe to probe: its largest batch at that length."""
    batch, largest = recipe.batch, {}
    for phase in batch.phases or []:
        length = phase.sequence_length or batch.sequence_length
        largest[length] = max(largest.get(length, 0), batch.phase_sequences(phase))
    return {length: phase_recipe(recipe, sequences, length) for length, sequences in sorted(largest.items())}


def planned_data_size(recipe: Recipe, given: bool = False) -> tuple[Datasets | None, int | dict | None]:
    """The data and its size as `run` gets them (from its factory, or on disk), when the recipe does not state
    data.train_size or the data is `given` (`plan --data`: `run` counts the user's data, not the paper's)."""
    spec = recipe.data
    on_disk = bool(spec.files) and spec.files[0] is not None
    if (spec.train_size is not None and not (given and on_disk)) or not spec.available or (
            not (isinstance(spec, NamedData) and spec.factory is not None) and not on_disk):
        return None, None
    # torch, and the user's own code: only for data that a factory makes or on disk
    from .data import build_data, training_sizes

    data = build_data(recipe)
    return data, training_sizes(recipe, data.train)


def recipe_for_plan(source: Path, changes: Sequence[Change], world_size: int = 1) -> Recipe:
    """The recipe file with the command's changes (`--set`, then its options), validated once, for `plan`, `probe`
    and `memory`."""
    recipe = overlay(load_recipe(source), changes, str(source))
    _check_changed(recipe, changes, world_size)
    return recipe


def recipe_for_run(source: Path, overrides: Sequence[Change], options: Sequence[Change], *, resume: bool = False,
                   out: Path | None = None) -> tuple[Recipe, Plan | None]:
    """The recipe (and plan, from a plan file or a resumed run's) as `run` and `verify` take it. `overrides`
    (`--set`) are refused on a plan file (its recipe is what its plan was made for); `options` change either. A
    resumed run keeps the fields its plan.yaml fixes (`overlay.resumed`)."""
    recipe, plan = load_recipe_or_plan(source)
    if overrides and plan is not None:
        raise UserError(f"{overrides[0].label}: {source} is a plan file, whose recipe its plan was made for; give "
                        "the recipe file to set its fields (a resumed run's plan.yaml already holds the fields it "
                        "was started with)")
    changes = [*overrides, *options]
    changed = overlay(recipe, changes, str(source))
    _check_changed(changed, changes, None)
    if resume:
        saved = load_plan(out / "plan.yaml") if out is not None and (out / "plan.yaml").is_file() else None
        if saved is None:
            raise UserError(f"`resume`: {out} has no plan.yaml to resume")
        saved_recipe = resumed(changed, changes, saved.recipe, out, str(source))
        check_resumed_weights(saved, out)
        check_resumed_data(saved, out)
        return saved_recipe, saved
    if plan is None:
        return changed, None
    for change in changes:  # the plan's BN batch, probe and options were planned for its own choice
        planned = plan.recipe.model.batchnorm
        if change.path == "model.batchnorm" and change.value != planned:
            raise UserError(f"{change.label}: the plan was made with model.batchnorm {planned}; plan again for "
                            f"{change.value}, or leave it out")
    return changed, finish_plan(plan, recipe=changed)


def _check_changed(recipe: Recipe, changes: Sequence[Change], world_size: int | None) -> None:
    """Beyond the schema: sharding needs two or more processes; activation checkpointing a model with blocks."""
    for change in changes:
        if change.path == "batch.sharding" and change.value == "fsdp" and world_size is not None and world_size < 2:
            raise UserError(
                f"{change.label} fsdp: shards the model over the `world_size` processes, and `world_size` is "
                f"{world_size}; give `world_size` 2 or more (one process has nothing to shard over)")
    if recipe.model.activation_checkpointing:  # a model with no blocks: one line now, before anything runs
        from .models.checkpointing import check_checkpointable

        check_checkpointable(recipe)


def check_launch_policy(policy: str, plan: Plan | None, processes: int) -> None:
    """--policy throughput times one device: several processes would each choose their own split."""
    if policy == "throughput" and plan is None and processes > 1:
        raise UserError("`policy` throughput: each process would time its own device and might choose another "
                        "split; plan first (`reproduce plan` `policy` throughput `out` plan.yaml) and run that plan")


def probe_consensus(recipe: Recipe, recipe_path: str, world_size: int, policy: str, dataset_size: int | dict | None,
                    all_min: Callable[[int], int], *, micro_batch_max: int | None = None,
                    probe: ProbeOptions | None = None, data: Datasets | None = None,
                    on_note: OnNote | None = None) -> tuple[Recipe, MicroBatchMax]:
    """Every rank probes its own device; all take the smallest result (`all_min`, a collective), so no rank runs
    out of memory. Returns the recipe with the memory knobs the plan took and the agreed maximum (per sequence
    length when the plan reads several), or `micro_batch_max` given and only sorted's token budget agreed."""
    probed = plan_and_probe(recipe, recipe_path, micro_batch_max, world_size, policy, dataset_size, probe=probe,
                            data=data, on_note=on_note).plan
    if micro_batch_max is not None:
        return agreed_budget(recipe, probed.recipe, all_min), micro_batch_max
    # one maximum per sequence length the plan reads, agreed in the same order on every rank
    maxima = {segment.sequence_length: segment.micro_batch_max for segment in probed.segments}
    agreed = {length: all_min(maxima[length]) for length in sorted(maxima, key=lambda length: length or 0)}
    return agreed_budget(recipe, probed.recipe, all_min), agreed if len(agreed) > 1 else next(iter(agreed.values()))


NO_BUDGET = 2**62  # a rank whose probe measured no token budget (its whole share fits): any other rank's is smaller


def agreed_budget(given: Recipe, probed: Recipe, all_min: Callable[[int], int]) -> Recipe:
    """`probed` with the token budget every rank agrees on (a collective), for `sorted` without one of the recipe's
    own: the smallest any rank measured, so every rank groups its windows alike and within what it measured."""
    if given.data.token_budget is not None or (given.data.packing or default_packing(given)) != "sorted":
        return probed
    budget = all_min(probed.data.token_budget if probed.data.token_budget is not None else NO_BUDGET)
    changes = [Change("data.packing", "sorted"), Change("data.token_budget", budget if budget != NO_BUDGET else None)]
    return overlay(probed, changes, "the probe")


@dataclass
class PreparedRun:
    """A run ready to train: its plan, its data, and the warnings to show at its start."""

    plan: Plan
    data: Datasets
    warnings: list[str]


def checked_run(request: RunRequest, processes: int, resume: bool) -> tuple[Recipe, Plan | None]:
    """The recipe (and plan) of a run of `processes`, after every check that needs no data (the launcher's)."""
    recipe, plan = recipe_for_run(request.source, changes_of(request.overrides), request.changes, resume=resume,
                                      out=request.out)
    if recipe.model.batchnorm == "sync":  # refused before anything is built or launched: one process, or no CUDA
        from .train.distributed.processes import World
        from .train.setup import check_sync_batchnorm, resolve_device

        check_sync_batchnorm(World(size=processes), resolve_device(request.device))
    check_sharding(recipe, processes)
    # with FSDP and no micro-batch maximum given, a probe that measures the whole unsharded model on one device (the
    # cuda and cpu meters) does not measure what one rank holds
    if recipe.batch.sharding == "fsdp" and plan is None and request.micro_batch_max is None and (
            measures_whole_model(request.meter)):
        raise UserError(
            "`micro_batch_max`: with `batch.sharding` fsdp give it (or `meter` estimate): the cuda and cpu probes "
            "measure the whole unsharded model on one device, not one rank's share"
        )
    return recipe, plan


def prepare_run(request: RunRequest, world: Any, resume: bool, on_note: OnNote | None = None,
                checked: tuple[Recipe, Plan | None] | None = None) -> PreparedRun:
    """This process's run: the checks (unless `checked`), its data, the probe and the plan, and its warnings."""
    from .data import build_data, text_warnings, training_sizes

    if request.memory is not None:  # a budget that is no size: one line, before anything is built
        parse_size(request.memory)
    probe = ProbeOptions(memory=request.memory, gpu=request.gpu, meter=request.meter, headroom=request.headroom,
                         use_cache=not request.no_cache)
    recipe, plan = checked or checked_run(request, world.size, resume)
    data = build_data(recipe)
    size = training_sizes(recipe, data.train)  # per sequence length when batch phases change it
    world_size = world.size if world.distributed else request.world_size
    micro_batch_max: MicroBatchMax | None = request.micro_batch_max
    agree = plan is None and world.distributed and (micro_batch_max is None or searches_budget(recipe, probe))
    if agree:  # (then planned with what the ranks agreed on, nothing probed again)
        from .train.distributed import processes as distributed
        from .train.setup import resolve_device

        rank_device = distributed.init(world, resolve_device(request.device))
        recipe, micro_batch_max = probe_consensus(
            recipe, str(request.source), world_size, request.policy, size,
            lambda maximum: distributed.all_min(world, maximum, rank_device), micro_batch_max=request.micro_batch_max,
            probe=probe, data=data, on_note=on_note)
    plan, warnings = run_plan(recipe, str(request.source), plan, micro_batch_max, world_size, request.policy, size,
                              resume, probe=None if agree else probe, data=data, on_note=on_note)
    warnings = [*warnings, *text_warnings(data.info)]  # what tokenising cut, with counts
    return PreparedRun(plan, data, warnings)


def run_plan(recipe: Recipe, source: str, plan: Plan | None, micro_batch_max: MicroBatchMax | None,
             world_size: int, policy: str, dataset_size: int | dict, resume: bool, *,
             probe: ProbeOptions | None = None, data: Datasets | None = None,
             on_note: OnNote | None = None) -> tuple[Plan, list[str]]:
    """The plan a run uses and its start's warnings: a new one, or the given (or resumed) one re-derived for another
    number of processes, a smaller `micro_batch_max` on resume, or the data's size (resume_rules.replan)."""
    # (a resumed run's weights and data were checked against its records: resume_rules)
    fingerprint = (data_fingerprint([recipe.data.path, recipe.data.eval_path])
                   if not resume and recipe.data.format is not None else None)
    if plan is None:
        plan = plan_and_probe(recipe, source, micro_batch_max, world_size, policy, dataset_size=dataset_size,
                              probe=probe, data=data, on_note=on_note, fingerprint=fingerprint).plan
    else:
        smaller = resume and micro_batch_max is not None and micro_batch_max < plan.micro_batch
        if plan.world_size != world_size or smaller or plan.dataset_size is None:
            plan = replan(plan, world_size, micro_batch_max if smaller else None, dataset_size, source)
        if not resume:
            plan = finish_plan(plan, weights=weights_of(plan.recipe), data_fingerprint=fingerprint
                               if recipe.data.format is not None else plan.data_fingerprint)
    warnings = list(plan.warnings)
    main_size = dataset_size.get(recipe.batch.sequence_length) if isinstance(dataset_size, dict) else dataset_size
    if recipe.data.train_size is not None and recipe.data.train_size != main_size:
        warnings.append(f"data.train_size is {recipe.data.train_size}; the data has {main_size}: using {main_size}")
    return plan, warnings
