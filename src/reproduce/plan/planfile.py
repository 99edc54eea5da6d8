"""Reading and writing plan files (`plan.yaml`): the plan `reproduce run` executes, with its recipe inside.

And what a checkpoint records of its plan: `computation(plan)`, every field that changes what the run computes, by
dotted path (`as_record`, train/resume.py). A resume whose plan differs in any of them is refused, naming the
fields (`changed_fields`), so a hand-edited plan.yaml never trains a different model silently. Left out: what a
resume may change on purpose and keep exact (micro-batch and accumulation, the processes, and what follows from
them), the weights and data files (their own fingerprints: resume_rules), and words (titles, warnings, sources)."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import yaml
from pydantic import ValidationError

from ..errors import UserError
from .factory import remember_folder
from .flatview import FLAT_FORMAT, parts_from_flat
from .planner import Plan
from .recipe import Recipe, parse_recipe
from .split import split_text
from .validation import format_validation_errors, read_yaml

PLAN_FORMAT = "reproduce-plan/2"
PLAN_FORMATS = (PLAN_FORMAT, FLAT_FORMAT)  # a reproduce-plan/1 file (flat fields) still loads: flatview.py


def plan_to_yaml(plan: Plan) -> str:
    header = (
        f"# reproduce plan: {plan.arithmetic} {plan.unit} per optimizer step\n"
        "# run it with: reproduce run THIS_FILE --out DIR\n"
    )
    return header + yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=110)


def check_writable(path: str | Path, option: str, protect: tuple[str | Path, ...] = ()) -> Path:
    """A file path we may write: not a folder, not under a file, not one of the `protect` inputs."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option}: {path} is a folder; give a file name such as {path / 'plan.yaml'}")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{option}: {parent} is a file, so {path} cannot be created under it")
    for other in protect:
        if path.exists() and Path(other).exists() and path.resolve() == Path(other).resolve():
            raise UserError(f"{option}: {path} is the input file itself; choose another name")
    return path


def write_text_atomic(path: str | Path, text: str | Callable[[BinaryIO], object]) -> None:
    """`text` (or what `text(handle)` writes) into a temporary beside `path`, flushed, then renamed over `path`: a
    crash leaves the old file whole. OS errors are raised as they are (storage.files.write_atomic: as WriteFailed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the file should read like any other the user writes
    try:
        with os.fdopen(descriptor, "w+b") as handle:  # (read too: storage's write_torch_file may hash it again)
            text(handle) if callable(text) else handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_plan(plan: Plan, path: str | Path) -> None:
    write_text_atomic(path, plan_to_yaml(plan))


def load_plan(path: str | Path) -> Plan:
    return parse_plan(read_yaml(path, what="plan"), str(path))


def parse_plan(data: dict[str, Any], source: str) -> Plan:
    if data.get("format") not in PLAN_FORMATS:
        raise UserError(f"{source}: format: expected {PLAN_FORMAT!r} (got {data.get('format')!r}); is this a recipe?")
    if data.get("format") == FLAT_FORMAT:
        data = parts_from_flat(data)
    recipe_data = data.get("recipe")
    if not isinstance(recipe_data, dict):
        raise UserError(f"{source}: recipe: expected the recipe as a mapping")
    try:
        parse_recipe(recipe_data, source=f"{source}: recipe")
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_validation_errors(exc, source, Plan)) from None
    check_plan(plan, source)
    return plan


def check_plan(plan: Plan, source: str) -> None:
    """The invariants a plan edited by hand must still satisfy; every broken one is reported."""
    problems = []
    batch = plan.recipe.batch
    split = plan.split
    sizes = {"split.micro_batch": split.micro_batch, "split.accumulation_steps": split.accumulation_steps,
             "split.world_size": split.world_size, "micro_batch_max": plan.micro_batch_max,
             "split.effective_batch": split.effective_batch}
    for field, value in sizes.items():
        if value < 1:
            problems.append(f"{source}: {field}: must be >= 1 (got {value})")
    if problems:
        raise UserError(*problems)
    product = split.micro_batch * split.accumulation_steps * split.world_size
    if product != split.effective_batch:
        problems.append(
            f"{source}: split.effective_batch: micro_batch x accumulation_steps x world_size = "
            f"{split_text(split.micro_batch, split.accumulation_steps, split.world_size, product)}, "
            f"not {split.effective_batch}"
        )
    if split.exact != (split.effective_batch == batch.sequences):
        problems.append(
            f"{source}: split.exact: {split.exact} contradicts effective_batch {split.effective_batch} "
            f"vs the paper's {batch.sequences}"
        )
    if split.micro_batch > plan.micro_batch_max:
        problems.append(f"{source}: split.micro_batch: {split.micro_batch} exceeds micro_batch_max "
                        f"{plan.micro_batch_max}")
    base_lr = plan.recipe.optimizer.lr
    if not math.isclose(split.lr, base_lr * split.lr_factor, rel_tol=1e-9):
        problems.append(f"{source}: split.lr: expected the recipe's lr x lr_factor = {base_lr * split.lr_factor:g} "
                        f"(got {split.lr:g})")
    if split.exact and split.lr_factor != 1.0:
        problems.append(f"{source}: split.lr_factor: must be 1 when the batch is exact (got {split.lr_factor})")
    if plan.schedule.lr != split.lr or plan.schedule.start_step != 0:
        problems.append(f"{source}: schedule: starts at step 0 with the split's lr {split.lr:g} (got step "
                        f"{plan.schedule.start_step}, lr {plan.schedule.lr:g})")
    if plan.optimizer_steps is not None and plan.optimizer_steps < 1:
        problems.append(f"{source}: schedule.end_step: must be >= 1 (got {plan.optimizer_steps}): one optimizer "
                        f"step reads {plan.effective_batch} {plan.unit}")
    problems.extend(f"{source}: {problem}" for problem in phase_problems(plan))
    if problems:
        raise UserError(*problems)


def phase_problems(plan: Plan) -> list[str]:
    """What is wrong with a plan's segments: one `whole` segment of the split without batch phases; with them, each
    segment's split, their order, and their match with the recipe's `batch.phases` or `batch.ramp`."""
    batch, phases = plan.recipe.batch, plan.segments
    if not phases:
        return ["segments: a plan has at least one segment; plan it again"]
    if not (batch.phases or batch.ramp):
        return _whole_problems(plan)
    if not plan.has_phases:
        return ["segments: the recipe's batch has phases or a ramp, but the plan has one `whole` segment; plan it "
                "again"]
    problems = []
    expected_start = 0
    for index, phase in enumerate(phases):
        where = f"segments[{index}]"
        last = index == len(phases) - 1
        if min(phase.micro_batch, phase.accumulation_steps, phase.effective_batch) < 1:
            problems.append(f"{where}: micro_batch, accumulation_steps and effective_batch must be >= 1")
            continue
        product = phase.micro_batch * phase.accumulation_steps * plan.world_size
        if phase.kind == "ramp":  # a ramp step's last micro-batch may be smaller (phases.py)
            share, remainder = divmod(phase.effective_batch, plan.world_size)
            if remainder or phase.accumulation_steps != -(-share // phase.micro_batch):
                problems.append(f"{where}.accumulation_steps: a ramp step of {phase.effective_batch} over "
                                f"{plan.world_size} process(es) in micro-batches of {phase.micro_batch} takes "
                                f"{-(-share // phase.micro_batch)} (got {phase.accumulation_steps})")
        elif product != phase.effective_batch:
            shown = split_text(phase.micro_batch, phase.accumulation_steps, plan.world_size, product)
            problems.append(f"{where}.effective_batch: micro_batch x accumulation_steps x world_size = {shown}, "
                            f"not {phase.effective_batch}")
        if phase.micro_batch > phase.micro_batch_max:
            problems.append(f"{where}.micro_batch: {phase.micro_batch} exceeds micro_batch_max {phase.micro_batch_max}")
        if phase.start_step != expected_start:
            problems.append(f"{where}.start_step: expected {expected_start} (where the segment before it ends), got "
                            f"{phase.start_step}")
        if last != (phase.steps is None):
            problems.append(f"{where}.steps: " + ("the last segment runs to the end: expected none" if last
                                                  else "expected the segment's number of steps"))
        elif phase.steps is not None:
            if phase.steps < 0:
                problems.append(f"{where}.steps: must be >= 0 (got {phase.steps})")
            expected_start = phase.start_step + phase.steps
        if phase.kind == "phase":
            if phase.paper_effective_batch is None or phase.exact != (
                    phase.effective_batch == phase.paper_effective_batch):
                problems.append(f"{where}.exact: {phase.exact} contradicts effective_batch {phase.effective_batch} vs "
                                f"the paper's {phase.paper_effective_batch}")
            elif phase.exact and phase.lr_factor != 1.0:
                problems.append(f"{where}.lr_factor: must be 1 when the batch is exact (got {phase.lr_factor})")
        else:
            if phase.effective_batch > plan.effective_batch:
                problems.append(f"{where}.effective_batch: a ramp step's batch {phase.effective_batch} is above the "
                                f"batch it ramps up to, {plan.effective_batch}")
            if phase.lr_factor != plan.split.lr_factor:
                problems.append(f"{where}.lr_factor: a ramp step has the main batch's LR factor "
                                f"{plan.split.lr_factor} (got {phase.lr_factor})")
            before = phases[index - 1].effective_batch if index else 0
            if before > phase.effective_batch:
                problems.append(f"{where}.effective_batch: a ramp's batches never shrink ({before} then "
                                f"{phase.effective_batch})")
    kinds = [phase.kind for phase in phases]
    if batch.phases:
        wanted = [(batch.phase_sequences(p), p.sequence_length or batch.sequence_length) for p in batch.phases]
        got = [(p.paper_effective_batch, p.sequence_length) for p in phases]
        if kinds != ["phase"] * len(batch.phases) or got != wanted:
            problems.append(f"segments: the recipe's phases are {wanted} (batch, sequence length); the plan has {got}")
        problems.extend(f"segments[{index}].schedule: " + ("the recipe's phase has its own lr / warmup / decay; "
                                                           "plan it again" if spec.has_schedule else
                                                           "the recipe's phase has no schedule of its own")
                        for index, (spec, phase) in enumerate(zip(batch.phases, phases, strict=False))
                        if spec.has_schedule != (phase.schedule is not None))
    elif kinds[-1] != "phase" or "phase" in kinds[:-1] or phases[-1].paper_effective_batch != batch.sequences:
        problems.append("segments: a ramp plan is ramp segments, then the recipe's batch to the end")
    if not batch.phases and any(phase.schedule is not None for phase in phases):
        problems.append("segments: a ramp's segments have no schedules of their own")
    return problems


def _whole_problems(plan: Plan) -> list[str]:
    """A plan without batch phases: one `whole` segment at the split's batch."""
    segments, split = plan.segments, plan.split
    whole = segments[0]
    if len(segments) != 1 or whole.kind != "whole":
        return [f"segments: the recipe's batch has no phases or ramp: expected one `whole` segment, got "
                f"{len(segments)} ({', '.join(segment.kind for segment in segments)})"]
    found = (whole.start_step, whole.steps, whole.micro_batch, whole.accumulation_steps, whole.effective_batch)
    split_batch = (0, None, split.micro_batch, split.accumulation_steps, split.effective_batch)
    if found != split_batch:
        return [f"segments[0]: the whole run at the split's batch: expected (start_step, steps, micro_batch, "
                f"accumulation_steps, effective_batch) {split_batch}, got {found}"]
    return []


def load_recipe_or_plan(path: str | Path) -> tuple[Recipe, Plan | None]:
    """A recipe file gives (recipe, None); a plan file gives (its recipe, the plan)."""
    data = read_yaml(path, what="recipe or plan")
    if data.get("format") in PLAN_FORMATS:
        plan = parse_plan(data, str(path))
        if plan.recipe_path and Path(plan.recipe_path).is_file():  # the factories beside the recipe it was made from
            remember_folder(plan.recipe_path)
        return plan.recipe, plan
    remember_folder(path)
    return parse_recipe(data, source=str(path)), None


# ---- what a checkpoint records of the plan ---------------------------------------------------------------------

NOT_COMPUTATION = (
    "format", "recipe_path", "policy", "micro_batch_max", "alternative", "alternative.*", "batchnorm",
    "batchnorm.*", "batchnorm_warning", "warnings", "warnings.*", "throughput", "throughput.*", "memory_notes",
    "memory_notes.*", "weights", "weights.*", "data_fingerprint",
    "split.policy", "split.micro_batch", "split.accumulation_steps", "split.world_size",
    "segments.*.micro_batch", "segments.*.accumulation_steps", "segments.*.micro_batch_max",
    "lr_scaling.source", "lr_scaling.adam_option.source",
    "recipe.paper", "recipe.paper.*", "recipe.reported", "recipe.reported.*", "recipe.deviations",
    "recipe.deviations.*", "recipe.model.description", "recipe.model.pretrained", "recipe.model.pretrained.*",
)


def computation(plan: Plan) -> dict[str, Any]:
    """The plan's fields that change what the run computes, by dotted path (list items by their index)."""
    flat: dict[str, Any] = {}
    _flatten(plan.model_dump(mode="json"), "", flat)
    if flat.get("recipe.data.packing") is None and "recipe.data.packing" in flat:
        flat["recipe.data.packing"] = "none"  # (left unset, it ran `none`, which a re-plan writes: packing.py)
    return {path: value for path, value in flat.items()
            if not any(fnmatch.fnmatchcase(path, pattern) for pattern in NOT_COMPUTATION)}


def _flatten(value: Any, path: str, into: dict[str, Any]) -> None:
    """Each leaf by its dotted path; an empty mapping or list has none (its items, when it gets some, are named)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), into)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _flatten(item, f"{path}.{index}", into)
    else:
        into[path] = value


def as_record(plan: Plan) -> str:
    """`computation(plan)` as the JSON text a checkpoint keeps."""
    return json.dumps(computation(plan), sort_keys=True)


def changed_fields(recorded: str, plan: Plan) -> list[str]:
    """Each field whose value in `plan` differs from the checkpoint's record (`as_record`), as `path (A at the
    checkpoint, B now)`; a field only one of them has counts too."""
    then: dict[str, Any] = json.loads(recorded)
    now: dict[str, Any] = json.loads(as_record(plan))  # (through JSON as the record went: tuples, floats alike)
    missing = object()
    changed = []
    for path in sorted(then.keys() | now.keys()):
        before, after = then.get(path, missing), now.get(path, missing)
        if before != after:
            changed.append(f"{path} ({_shown(before, missing)} at the checkpoint, {_shown(after, missing)} now)")
    return changed


def _shown(value: Any, missing: object) -> str:
    if value is missing:
        return "absent"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."
