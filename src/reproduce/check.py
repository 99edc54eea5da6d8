"""Reproduction checks for CI: check files (YAML) that name a recipe, a budget, and what must hold.

A check file (`reproduce/*.yaml`):

    recipe: ../papers/digits-mlp.yaml      # relative to the check file (or to the working directory)
    budget: {micro_batch_max: 32, device: cpu, max_steps: 300, seeds: [0]}
    runs:                                   # optional variants of the recipe; `main` is the recipe itself
      plain: {budget: {micro_batch_max: 256}}
      no-scaling: {recipe: ../papers/other.yaml, overrides: {optimizer: {lr: 0.1}}}
    checks:
      - {kind: plan, expect: {micro_batch: 32, accumulation_steps: 8, exact: true}}
      - {kind: verify}                                   # gradient equivalence, via `reproduce verify`
      - {kind: metric, metric: eval_accuracy, min: 0.95}
      - {kind: metric, metric: eval_loss, baseline: data.unigram_loss, max_ratio: 0.8}
      - {kind: metric, metric: top1_accuracy, reported: top1_accuracy, scale: 100}
      - {kind: compare, a: main, b: plain, metric: loss, tolerance: 0.01}

Files are validated strictly (unknown keys, wrong types, unknown run names, recipes that do not load),
every problem one line, before anything runs. Runs train in a work folder (temporary unless given) and
are shared between the checks that name them. Torch is imported only when a check trains or verifies.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import re
import shutil
import statistics
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from .errors import Interrupted, UserError
from .planfile import check_plan, check_writable, write_text_atomic
from .planner import Plan, plan
from .recipe import Recipe, Strict, _is_union_tag, _message, load_recipe, parse_recipe, read_yaml
from .units import format_size, parse_size

DEFAULT_FOLDER = "reproduce"
WORK_MARKER = ".reproduce-check-work"
MAIN = "main"
AGGREGATES = ("mean", "min", "max")


# ---- the schema -----------------------------------------------------------------------------------------


class Budget(Strict):
    """What the checks run with: the micro-batch (or the memory it was measured for), device, and length."""

    micro_batch_max: int | None = Field(default=None, gt=0, description="largest micro-batch that fits")
    memory: str | None = Field(default=None, description="the device memory micro_batch_max is declared for")
    world_size: int = Field(default=1, gt=0)
    policy: Literal["exact", "fast"] = "exact"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    max_steps: int | None = Field(default=None, gt=0, description="stop runs after this many optimizer steps")
    max_epochs: float | None = Field(default=None, gt=0, description="stop runs after this many epochs")
    seeds: list[int] | None = Field(default=None, min_length=1, description="one run per seed")

    @model_validator(mode="after")
    def _consistent(self) -> Budget:
        if self.max_steps is not None and self.max_epochs is not None:
            raise ValueError("give max_steps or max_epochs, not both")
        if self.memory is not None:
            try:
                parse_size(self.memory, "memory")
            except UserError as error:
                raise ValueError(error.lines[0]) from None
        return self


class RunSpec(Strict):
    recipe: str | None = Field(default=None, description="another recipe (default: the file's)")
    overrides: dict[str, Any] = Field(default={}, description="merged into the recipe; null removes a key")
    budget: dict[str, Any] = Field(default={}, description="fields of the file's budget to change")


class _Check(Strict):
    name: str | None = None


class PlanCheck(_Check):
    kind: Literal["plan"]
    run: str = MAIN
    expect: dict[str, Any] = {}


class VerifyCheck(_Check):
    kind: Literal["verify"]
    run: str = MAIN
    samples: int | None = Field(default=None, gt=0)
    tolerance: float | None = Field(default=None, gt=0)
    dtype: Literal["float64", "float32", "bf16", "fp16"] = "float64"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    expect: Literal["equivalent", "not-equivalent"] = "equivalent"


class MetricCheck(_Check):
    kind: Literal["metric"]
    run: str = MAIN
    metric: str
    aggregate: Literal[AGGREGATES] = "mean"  # type: ignore[valid-type]
    scale: float = Field(default=1.0, gt=0, description="multiply the measured value first (fraction -> %)")
    min: float | None = None
    max: float | None = None
    baseline: str | None = Field(default=None, description="a value from the run's summary to divide by")
    min_ratio: float | None = None
    max_ratio: float | None = None
    reported: str | None = Field(default=None, description="a metric in the recipe's `reported` list")
    tolerance: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _something_to_check(self) -> MetricCheck:
        if all(v is None for v in (self.min, self.max, self.min_ratio, self.max_ratio, self.reported)):
            raise ValueError("give min, max, baseline with min_ratio/max_ratio, or reported")
        if (self.min_ratio is not None or self.max_ratio is not None) and self.baseline is None:
            raise ValueError("baseline: required with min_ratio or max_ratio")
        if self.baseline is not None and self.min_ratio is None and self.max_ratio is None:
            raise ValueError("baseline: give min_ratio or max_ratio with it")
        if self.tolerance is not None and self.reported is None:
            raise ValueError("tolerance: only used with reported")
        return self


class CompareCheck(_Check):
    kind: Literal["compare"]
    a: str
    b: str
    metric: str = "loss"
    aggregate: Literal[AGGREGATES] = "mean"  # type: ignore[valid-type]
    tolerance: float | None = Field(default=None, ge=0, description="|a - b| <= tolerance")
    rel_tolerance: float | None = Field(default=None, ge=0, description="|a - b| <= rel_tolerance x |b|")
    at_least: float | None = Field(default=None, description="a - b >= at_least")
    at_most: float | None = Field(default=None, description="a - b <= at_most")

    @model_validator(mode="after")
    def _something_to_check(self) -> CompareCheck:
        if all(v is None for v in (self.tolerance, self.rel_tolerance, self.at_least, self.at_most)):
            raise ValueError("give tolerance, rel_tolerance, at_least or at_most")
        return self


AnyCheck = Annotated[PlanCheck | VerifyCheck | MetricCheck | CompareCheck, Field(discriminator="kind")]
KINDS = ("plan", "verify", "metric", "compare")


class CheckFile(Strict):
    description: str | None = None
    recipe: str
    budget: Budget = Budget()
    runs: dict[str, RunSpec] = {}
    checks: list[AnyCheck] = Field(min_length=1)


# ---- loading: every problem of every file, one line each --------------------------------------------------


@dataclass
class Run:
    """A recipe and a budget: what one training run (per seed) executes."""

    name: str
    recipe: Recipe
    recipe_path: str
    budget: Budget

    @property
    def seeds(self) -> list[int]:
        return list(self.budget.seeds) if self.budget.seeds else [self.recipe.seed]

    def key(self, seed: int) -> str:
        return json.dumps(
            [self.recipe.model_dump(mode="json"), self.budget.model_dump(mode="json", exclude={"seeds"}), seed],
            sort_keys=True,
        )


@dataclass
class LoadedFile:
    path: Path
    spec: CheckFile
    runs: dict[str, Run]
    names: list[str]

    @property
    def label(self) -> str:
        return self.path.name


def collect(paths: list[Path]) -> list[Path]:
    """The check files: each file given, and the *.yaml / *.yml files of each folder given (sorted)."""
    default = not paths
    if default:
        paths = [Path(DEFAULT_FOLDER)]
    files: list[Path] = []
    problems = []
    for path in paths:
        if default and not path.exists():
            problems.append(f"{path}: no such folder (the default: run where the {DEFAULT_FOLDER}/ folder of check "
                            "files is, or give check files or folders)")
            continue
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                problems.append(f"{path}: no check files (*.yaml) in this folder")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            problems.append(f"{path}: no such check file or folder")
    if problems:
        raise UserError(*problems)
    unique = []
    for path in files:
        if path.resolve() not in {p.resolve() for p in unique}:
            unique.append(path)
    return unique


def load_all(paths: list[Path]) -> list[LoadedFile]:
    """Every check file, validated; one UserError listing the problems of all of them."""
    loaded, problems = [], []
    for path in paths:
        try:
            loaded.append(load_check_file(path))
        except UserError as error:
            problems.extend(error.lines)
    if problems:
        raise UserError(*problems)
    return loaded


def load_check_file(path: Path) -> LoadedFile:
    source = str(path)
    data = read_yaml(path, what="check")
    try:
        spec = CheckFile.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_errors(exc, source)) from None
    problems: list[str] = []
    base = _load_recipe(spec.recipe, path, source, "recipe", problems)
    runs: dict[str, Run] = {}
    if base is not None:
        recipe, recipe_path = base
        runs[MAIN] = Run(MAIN, recipe, recipe_path, spec.budget)
        if MAIN in spec.runs:
            problems.append(f"{source}: runs.{MAIN}: the name {MAIN!r} is the file's own recipe; choose another")
        for name, run_spec in spec.runs.items():
            run = _resolve_run(name, run_spec, spec, recipe, recipe_path, path, source, problems)
            if run is not None:
                runs[name] = run
    names = []
    for index, check in enumerate(spec.checks):
        where = f"{source}: checks[{index}]"
        names.append(_unique_name(check_name(check), names))
        if base is None:
            continue
        for field_name in ("run", "a", "b"):
            run_name = getattr(check, field_name, None)
            if run_name is not None and run_name not in runs and run_name not in spec.runs:
                close = difflib.get_close_matches(run_name, [MAIN, *spec.runs], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (runs: {', '.join([MAIN, *spec.runs])})"
                problems.append(f"{where}.{field_name}: no run named {run_name!r}{hint}")
        problems.extend(_check_problems(check, runs, where))
    if problems:
        raise UserError(*problems)
    return LoadedFile(path, spec, runs, names)


def _resolve_recipe_path(name: str, check_path: Path) -> Path | None:
    candidates = [Path(name)] if Path(name).is_absolute() else [check_path.parent / name, Path(name)]
    return next((c for c in candidates if c.is_file()), None)


def _load_recipe(name: str, check_path: Path, source: str, field_name: str, problems: list[str]):
    found = _resolve_recipe_path(name, check_path)
    if found is None:
        problems.append(
            f"{source}: {field_name}: no recipe file {name!r} (looked beside the check file and in the working "
            "directory)"
        )
        return None
    try:
        return load_recipe(found), str(found)
    except UserError as error:
        problems.extend(f"{source}: {field_name}: {line}" for line in error.lines)
        return None


def _resolve_run(name, run_spec, spec, recipe, recipe_path, path, source, problems) -> Run | None:
    where = f"runs.{name}"
    if run_spec.recipe is not None:
        loaded = _load_recipe(run_spec.recipe, path, source, f"{where}.recipe", problems)
        if loaded is None:
            return None
        recipe, recipe_path = loaded
    if run_spec.overrides:
        merged = merge(recipe.model_dump(mode="json", exclude_unset=True), run_spec.overrides)
        try:
            recipe = parse_recipe(merged, source=f"{source}: {where}.overrides")
        except UserError as error:
            problems.extend(error.lines)
            return None
    try:
        budget = Budget.model_validate({**spec.budget.model_dump(exclude_unset=True), **run_spec.budget})
    except ValidationError as exc:
        problems.extend(format_errors(exc, f"{source}: {where}.budget", root=Budget))
        return None
    return Run(name, recipe, recipe_path, budget)


def merge(base: dict, overrides: dict) -> dict:
    """`overrides` merged into a copy of `base`, mappings recursively; a null value removes the key."""
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _check_problems(check: Any, runs: dict[str, Run], where: str) -> list[str]:
    """What a check asks that its runs cannot give: missing budget, data not here, unknown plan fields."""
    problems = []
    for field_name in ("run", "a", "b"):
        run = runs.get(getattr(check, field_name, None) or "")
        if run is None:
            continue
        label = f"run {run.name!r}"
        if run.budget.micro_batch_max is None:
            problems.append(f"{where}: budget.micro_batch_max: required to plan {label} (the largest micro-batch "
                            "that fits one device)")
        if check.kind in ("verify", "metric", "compare") and not run.recipe.data.available:
            what = "trains" if check.kind != "verify" else "computes gradients on"
            problems.append(
                f"{where}.kind: a {check.kind} check {what} {label}, but its data {run.recipe.data.name!r} is "
                "available: false; use a plan check"
            )
        if check.kind in ("metric", "compare") and run.budget.world_size != 1:
            problems.append(f"{where}: budget.world_size: runs train in one process; {label} has world_size "
                            f"{run.budget.world_size} (plan checks may declare more)")
    if check.kind == "plan":
        known = [name for name in Plan.model_fields if name != "recipe"]
        for key in check.expect:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{where}.expect.{key}: not a plan field{hint}")
    if check.kind == "metric" and check.reported is not None and check.run in runs:
        recipe = runs[check.run].recipe
        reported = {r.metric: r for r in recipe.reported}
        if check.reported not in reported:
            names = ", ".join(reported) or "none"
            problems.append(f"{where}.reported: the recipe reports no {check.reported!r} (it reports: {names})")
        elif check.tolerance is None and reported[check.reported].tolerance is None:
            problems.append(f"{where}.tolerance: required: the recipe's {check.reported!r} states none")
    return problems


def check_name(check: Any) -> str:
    if check.name:
        return check.name
    if check.kind == "plan":
        return "plan invariants" + ("" if check.run == MAIN else f" ({check.run})")
    if check.kind == "verify":
        return "gradient equivalence" + ("" if check.run == MAIN else f" ({check.run})")
    if check.kind == "metric":
        return check.metric + ("" if check.run == MAIN else f" ({check.run})")
    return f"{check.metric}: {check.a} vs {check.b}"


def _unique_name(name: str, taken: list[str]) -> str:
    candidate, number = name, 2
    while candidate in taken:
        candidate, number = f"{name} #{number}", number + 1
    return candidate


# ---- one line per validation error ----------------------------------------------------------------------


def format_errors(exc: ValidationError, source: str, root: type[BaseModel] = CheckFile) -> list[str]:
    """recipe.format_validation_errors' style for check files: `file: checks[1].min: must be ... (got ...)`."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = [part for part in error["loc"] if not (isinstance(part, str) and _is_union_tag(part))]
        kind = error["type"]
        if kind == "union_tag_not_found":
            loc, message = [*loc, "kind"], f"required: one of {', '.join(KINDS)}"
        elif kind == "union_tag_invalid":
            tag = error.get("ctx", {}).get("tag")
            close = difflib.get_close_matches(str(tag), KINDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            loc, message = [*loc, "kind"], f"expected one of {', '.join(KINDS)} (got {tag!r}{hint})"
        elif kind == "extra_forbidden":
            known = _fields_at(root, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})" if known else ""
            message = f"unknown key{hint}"
        else:
            message = _message(error, root)
            head = message.split(":", 1)[0]
            if ":" in message and " " not in head and head in _fields_at(root, loc):
                loc, message = [*loc, head], message.split(":", 1)[1].strip()
        line = f"{source}: {_path(root, loc)}: {message}"
        if line not in lines:
            lines.append(line)
    return lines


def _path(root: type[BaseModel], loc: list) -> str:
    """checks[1].min, with the discriminator tag pydantic adds to the location left out."""
    text, node = "", root
    for part in loc:
        if isinstance(part, str) and part in KINDS and _union_member(node, part) is not None:
            node = _union_member(node, part)
            continue
        node = _step(node, part)
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _fields_at(root: type[BaseModel], loc: list) -> list[str]:
    node: Any = root
    for part in loc:
        member = _union_member(node, part) if isinstance(part, str) else None
        node = member if member is not None else _step(node, part)
        if node is None:
            return []
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _step(node: Any, part: Any) -> Any:
    """The annotation found one step into `node` (a model, list, dict, or union of them)."""
    if node is None:
        return None
    origin, args = getattr(node, "__origin__", None), getattr(node, "__args__", ())
    if isinstance(node, type) and issubclass(node, BaseModel):
        field_info = node.model_fields.get(str(part))
        return field_info.annotation if field_info else None
    if origin is list and isinstance(part, int):
        return args[0] if args else None
    if origin is dict and isinstance(part, str):
        return args[1] if len(args) > 1 else None
    if args:  # Optional / Union / Annotated: the first member that knows the part
        for arg in args:
            found = _step(arg, part)
            if found is not None:
                return found
    metadata = getattr(node, "__metadata__", None)
    if metadata is not None:
        return _step(getattr(node, "__origin__", None), part)
    return None


def _union_member(node: Any, tag: str) -> Any:
    """The member of a discriminated union of checks whose `kind` is `tag` (None when `node` is no union)."""
    if isinstance(node, type) or node is None:
        return None
    for arg in _flatten(node):
        if isinstance(arg, type) and issubclass(arg, _Check):
            literal = arg.model_fields["kind"].annotation
            if tag in getattr(literal, "__args__", ()):
                return arg
    return None


def _flatten(node: Any) -> list:
    args = getattr(node, "__args__", ())
    if not args:
        origin = getattr(node, "__origin__", None)
        return _flatten(origin) if origin is not None else [node]
    return [leaf for arg in args for leaf in _flatten(arg)]


# ---- results ----------------------------------------------------------------------------------------------


@dataclass
class Result:
    file: str
    name: str
    kind: str
    status: Literal["pass", "fail", "error"]
    measured: str
    expected: str
    seconds: float
    details: list[str] = field(default_factory=list)
    plot: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class RunResult:
    out: Path
    summary: dict
    seconds: float


class Runner:
    """Evaluates checks; trains each distinct (recipe, budget, seed) once, in `work`."""

    def __init__(self, work: Path, plots: Path | None = None, log: Callable[[str], None] | None = None):
        self.work, self.plots = work, plots
        self.log = log or (lambda text: None)
        self.cache: dict[str, RunResult] = {}
        self.data: dict[str, dict] = {}

    # ---- runs ---------------------------------------------------------------------------------------

    def dataset(self, recipe: Recipe) -> dict:
        from .data import build_data

        key = json.dumps([recipe.data.model_dump(mode="json"), recipe.batch.sequence_length], sort_keys=True)
        if key not in self.data:
            self.data[key] = build_data(recipe)
        return self.data[key]

    def plan_for(self, run: Run, dataset_size: int | dict | None) -> Plan:
        budget = run.budget
        return plan(run.recipe, budget.micro_batch_max, budget.world_size, budget.policy,
                    dataset_size=dataset_size, recipe_path=run.recipe_path)

    def train(self, file: LoadedFile, run: Run, seed: int) -> RunResult:
        key = run.key(seed)
        if key in self.cache:
            return self.cache[key]
        from .data.lengths import training_sizes
        from .train.trainer import train

        data = self.dataset(run.recipe)
        the_plan = self.plan_for(run, training_sizes(run.recipe, data["train"]))
        max_steps = run.budget.max_steps
        if run.budget.max_epochs is not None and the_plan.steps_per_epoch:
            max_steps = max(1, math.ceil(run.budget.max_epochs * the_plan.steps_per_epoch))
        out = self.work / _slug(file.path.stem) / _slug(run.name) / f"seed-{seed}"
        self.log(f"  training {run.name!r} seed {seed}: {the_plan.arithmetic}, "
                 f"{min(max_steps or the_plan.optimizer_steps or 0, the_plan.optimizer_steps or 0)} steps")
        started = time.perf_counter()
        summary = train(the_plan, out, device=run.budget.device, max_steps=max_steps, seed=seed, force=True, data=data)
        result = RunResult(out, summary, time.perf_counter() - started)
        self.cache[key] = result
        return result

    def values(self, file: LoadedFile, run: Run, metric: str) -> list[float]:
        return [lookup(self.train(file, run, seed).summary, metric) for seed in run.seeds]

    # ---- checks -------------------------------------------------------------------------------------

    def evaluate(self, file: LoadedFile, index: int) -> Result:
        check = file.spec.checks[index]
        name = file.names[index]
        started = time.perf_counter()
        try:
            status, measured, expected, details, plot = getattr(self, f"_{check.kind}")(file, check)
        except UserError as error:
            status, measured, expected, details, plot = "error", "-", "-", list(error.lines), None
        except Interrupted:
            raise
        except Exception as error:  # a crash in training or in the user's factory: reported, not fatal
            status, measured, expected, plot = "error", "-", "-", None
            details = [f"{type(error).__name__}: {error}"]
        return Result(file.label, name, check.kind, status, measured, expected,
                      round(time.perf_counter() - started, 2), details, plot)

    def _plan(self, file: LoadedFile, check: PlanCheck):
        run = file.runs[check.run]
        the_plan = self.plan_for(run, run.recipe.data.train_size)
        problems = plan_problems(the_plan, run.budget)
        for key, want in check.expect.items():
            got = getattr(the_plan, key)
            if not _same(got, want):
                problems.append(f"{key}: expected {want!r}, the plan has {got!r}")
        steps = the_plan.optimizer_steps
        measured = (f"{the_plan.arithmetic} {'' if the_plan.effective_tokens else the_plan.unit}".rstrip()
                    + f", lr {the_plan.lr:.4g}, {steps if steps is not None else '?'} steps")
        budget = run.budget
        memory = f", {format_size(parse_size(budget.memory))}" if budget.memory else ""
        stated = f" + {len(check.expect)} stated values" if check.expect else ""
        expected = f"invariants{stated} (m <= {budget.micro_batch_max}, W = {budget.world_size}{memory})"
        details = problems + [f"plan warning: {w}" for w in the_plan.warnings]
        if check.expect:
            details.append("stated: " + ", ".join(f"{k} {_short(v)}" for k, v in check.expect.items()))
        return ("pass" if not problems else "fail"), measured, expected, details, None

    def _verify(self, file: LoadedFile, check: VerifyCheck):
        from .verify import verify

        run = file.runs[check.run]
        from .data.lengths import training_sizes

        data = self.dataset(run.recipe)
        the_plan = self.plan_for(run, training_sizes(run.recipe, data["train"]))
        seed = run.seeds[0]
        result = verify(the_plan, samples=check.samples, tolerance=check.tolerance, dtype=check.dtype,
                        device=check.device, seed=seed, data=data)
        got = "equivalent" if result.within_tolerance else "not-equivalent"
        measured = f"{result.verdict}: rel. error {result.global_relative_error:.3g}"
        if check.expect == "equivalent":
            expected = f"equivalent: rel. error <= {result.tolerance:g} ({result.dtype})"
        else:
            expected = f"not equivalent: rel. error > {result.tolerance:g} ({result.dtype})"
        details = [
            f"{result.samples} samples in {result.micro_batches} micro-batches of {result.micro_batch} vs "
            f"{result.reference_chunks} pass(es); worst parameter {result.worst_parameter}: "
            f"{result.worst_relative_error:.3g}",
            result.explanation, *result.notes,
        ]
        return ("pass" if got == check.expect else "fail"), measured, expected, details, None

    def _metric(self, file: LoadedFile, check: MetricCheck):
        run = file.runs[check.run]
        values = [v * check.scale for v in self.values(file, run, check.metric)]
        value = aggregate(values, check.aggregate)
        conditions, expected = [], []
        if check.min is not None:
            conditions.append(value >= check.min)
            expected.append(f">= {check.min:g}")
        if check.max is not None:
            conditions.append(value <= check.max)
            expected.append(f"<= {check.max:g}")
        measured = _measured(value, values, check.aggregate)
        details = [f"{check.metric} x {check.scale:g}" if check.scale != 1 else check.metric]
        details[0] += f" per seed {run.seeds}: {', '.join(f'{v:.4g}' for v in values)}"
        if check.baseline is not None:
            base = aggregate(self.values(file, run, check.baseline), check.aggregate)
            ratio = value / base if base else math.inf
            measured += f" = {ratio:.3f} x {check.baseline} ({base:.4g})"
            if check.min_ratio is not None:
                conditions.append(ratio >= check.min_ratio)
                expected.append(f">= {check.min_ratio:g} x {check.baseline}")
            if check.max_ratio is not None:
                conditions.append(ratio <= check.max_ratio)
                expected.append(f"<= {check.max_ratio:g} x {check.baseline}")
        if check.reported is not None:
            reported = next(r for r in run.recipe.reported if r.metric == check.reported)
            tolerance = check.tolerance if check.tolerance is not None else reported.tolerance
            conditions.append(abs(value - reported.value) <= tolerance)
            expected.append(f"reported {reported.value:g} +- {tolerance:g}")
        return ("pass" if all(conditions) else "fail"), measured, ", ".join(expected), details, None

    def _compare(self, file: LoadedFile, check: CompareCheck):
        run_a, run_b = file.runs[check.a], file.runs[check.b]
        values_a, values_b = self.values(file, run_a, check.metric), self.values(file, run_b, check.metric)
        a, b = aggregate(values_a, check.aggregate), aggregate(values_b, check.aggregate)
        diff = a - b
        conditions, expected = [], []
        if check.tolerance is not None:
            conditions.append(abs(diff) <= check.tolerance)
            expected.append(f"|a - b| <= {check.tolerance:g}")
        if check.rel_tolerance is not None:
            conditions.append(abs(diff) <= check.rel_tolerance * abs(b))
            expected.append(f"|a - b| <= {check.rel_tolerance:g} x |b|")
        if check.at_least is not None:
            conditions.append(diff >= check.at_least)
            expected.append(f"a - b >= {check.at_least:g}")
        if check.at_most is not None:
            conditions.append(diff <= check.at_most)
            expected.append(f"a - b <= {check.at_most:g}")
        measured = f"a {a:.4g}, b {b:.4g}: a - b = {diff:+.3g}"
        details = [
            f"a = {check.a} ({check.aggregate} over seeds {run_a.seeds}: {', '.join(f'{v:.4g}' for v in values_a)})",
            f"b = {check.b} ({check.aggregate} over seeds {run_b.seeds}: {', '.join(f'{v:.4g}' for v in values_b)})",
        ]
        plot, note = self.plot(file, check, run_a, run_b)
        if note:
            details.append(note)
        return ("pass" if all(conditions) else "fail"), measured, ", ".join(expected), details, plot

    def plot(self, file: LoadedFile, check: CompareCheck, run_a: Run, run_b: Run) -> tuple[str | None, str | None]:
        """Both runs' curves of the compared metric on one PNG (first seed of each), when matplotlib is here."""
        if self.plots is None:
            return None, "no plot: give --plots DIR (or --summary) to keep one"
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None, "no plot: matplotlib is not installed (pip install 'reproduce[plots]')"
        from .train.trainer import read_metrics

        figure, axis = plt.subplots(figsize=(7, 4))
        key = check.metric
        for label, run, style in (("a", run_a, "-"), ("b", run_b, "--")):
            records = read_metrics(self.train(file, run, run.seeds[0]).out / "metrics.jsonl")
            xs, ys = [r["epoch"] for r in records if key in r], [r[key] for r in records if key in r]
            if xs:
                axis.plot(xs, ys, style, marker="o" if len(xs) < 30 else None, label=f"{label}: {run.name}")
        axis.set_xlabel("epoch")
        axis.set_ylabel(key)
        axis.set_title(f"{file.label}: {check_name(check)}")
        axis.legend()
        figure.tight_layout()
        self.plots.mkdir(parents=True, exist_ok=True)
        png = self.plots / f"{_slug(file.path.stem)}-{_slug(check_name(check))}.png"
        figure.savefig(png, dpi=100)
        plt.close(figure)
        return str(png), None


def lookup(summary: dict, metric: str) -> float:
    """A run's value: a key of its final metrics record (loss, eval_loss, eval_accuracy, ...) or a dotted path
    into summary.json (data.unigram_loss, seconds)."""
    final = summary.get("final", {})
    if metric in final:
        return float(final[metric])
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            known = sorted(k for k, v in final.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
            raise UserError(f"metric {metric!r}: not in the run's results (final record has: {', '.join(known)}; "
                            "or give a dotted path into summary.json such as data.unigram_loss)")
        node = node[part]
    if isinstance(node, dict) and "reason" in node:  # a summary entry that says why it has no value (noise_scale)
        raise UserError(f"metric {metric!r}: not measured in this run: {node['reason']}")
    if not isinstance(node, (int, float)) or isinstance(node, bool):
        raise UserError(f"metric {metric!r}: is not a number (got {node!r})")
    return float(node)


def aggregate(values: list[float], how: str) -> float:
    return {"mean": statistics.fmean, "min": min, "max": max}[how](values)


def plan_problems(the_plan: Plan, budget: Budget) -> list[str]:
    """Invariants every plan must satisfy, derived here independently of the planner."""
    problems = []
    try:
        check_plan(the_plan, "plan")
    except UserError as error:
        problems.extend(line.removeprefix("plan: ") for line in error.lines)
    recipe = the_plan.recipe
    paper = recipe.batch.sequences
    micro, accumulation, world = the_plan.micro_batch, the_plan.accumulation_steps, the_plan.world_size
    if micro * accumulation * world != the_plan.effective_batch:
        problems.append(f"effective batch: {micro} x {accumulation} x {world} != {the_plan.effective_batch}")
    if budget.micro_batch_max is not None and micro > budget.micro_batch_max:
        problems.append(f"micro_batch: {micro} exceeds the budget's micro_batch_max {budget.micro_batch_max}")
    if world != budget.world_size:
        problems.append(f"world_size: {world}, but the budget declares {budget.world_size}")
    if budget.policy == "exact" and paper % budget.world_size == 0 and not the_plan.exact:
        problems.append(f"exact: {paper} {recipe.batch.count_unit} split over {budget.world_size} process(es) "
                        f"exactly, but the plan's batch is {the_plan.effective_batch}")
    # the LR rule as stated
    factor = the_plan.effective_batch / paper
    if the_plan.exact:
        rule = "exact"
    elif recipe.scaling_rule == "auto":
        rule = "linear" if recipe.optimizer.family == "sgd" else "sqrt"
    else:
        rule = recipe.scaling_rule
    want_lr = recipe.optimizer.lr * {"exact": 1.0, "none": 1.0, "linear": factor, "sqrt": math.sqrt(factor)}[rule]
    if the_plan.lr_rule != rule:
        problems.append(f"lr_rule: expected {rule} (scaling_rule {recipe.scaling_rule}, optimizer "
                        f"{recipe.optimizer.name}), the plan applies {the_plan.lr_rule}")
    if not math.isclose(the_plan.lr, want_lr, rel_tol=1e-9):
        problems.append(f"lr: the {rule} rule gives {want_lr:.6g} for batch x{factor:.4g}; the plan has "
                        f"{the_plan.lr:.6g}")
    if the_plan.phases:
        # the steps of a changing batch come from walking its phases (phases.py); check_plan has checked each
        # phase's split and order above, and the phases must cover the recipe's
        return problems + _phase_schedule_problems(the_plan)
    # steps converted: the same data as the paper's schedule covers
    dataset = the_plan.dataset_size
    per_epoch = None
    if dataset is not None:
        full, rest = divmod(dataset, the_plan.effective_batch)
        per_epoch = full if recipe.data.drop_last or not rest else full + 1
        if the_plan.steps_per_epoch != per_epoch:
            problems.append(f"steps_per_epoch: {dataset} // {the_plan.effective_batch} gives {per_epoch}; the "
                            f"plan has {the_plan.steps_per_epoch}")
    total = _steps(recipe.schedule.total, recipe, the_plan.effective_batch, per_epoch)
    if total is not None and the_plan.optimizer_steps != total:
        problems.append(f"optimizer_steps: schedule.total {_length(recipe.schedule.total)} is {total} steps of "
                        f"{the_plan.effective_batch}; the plan has {the_plan.optimizer_steps}")
    warmup = recipe.schedule.warmup
    if warmup is not None:
        if warmup.ratio is not None:
            want = round(warmup.ratio * the_plan.optimizer_steps) if the_plan.optimizer_steps is not None else None
        else:
            want = _steps(warmup, recipe, the_plan.effective_batch, per_epoch)
        if want is not None and the_plan.warmup_steps != want:
            problems.append(f"warmup_steps: expected {want}, the plan has {the_plan.warmup_steps}")
    milestones = recipe.schedule.decay.milestones
    if milestones is not None:
        from .recipe import Length

        want = [_steps(Length(**{milestones.unit: v}), recipe, the_plan.effective_batch, per_epoch)
                for v in milestones.value]
        if None not in want and the_plan.decay_milestones != want:
            problems.append(f"decay_milestones: expected {want}, the plan has {the_plan.decay_milestones}")
    if recipe.model.has_batchnorm and recipe.batch.per_device:
        per_device = recipe.batch.per_device
        per_rank = paper // world if paper % world == 0 else None
        fits = budget.micro_batch_max is None or per_device <= budget.micro_batch_max
        if fits and per_rank and per_rank % per_device == 0 and micro != per_device:
            problems.append(f"micro_batch: BatchNorm: the paper's per-device batch {per_device} fits and divides "
                            f"the batch, but the plan uses {micro}")
    return problems


def _phase_schedule_problems(the_plan: Plan) -> list[str]:
    """With batch phases: each phase's length in steps covers the data the recipe's phase length says, re-derived
    here phase by phase (exact phases keep the paper's steps)."""
    problems = []
    for index, (phase, spec) in enumerate(zip(the_plan.phases, the_plan.recipe.batch.phases or [], strict=False)):
        if phase.steps is None:
            continue
        unit, value = spec.unit, spec.value
        if unit == "epochs":
            want = None if phase.steps_per_epoch is None else round(value * phase.steps_per_epoch)
        else:
            samples = value * phase.paper_effective_batch if unit == "steps" else value if unit == "samples" else (
                value / phase.sequence_length)
            want = round(samples / phase.effective_batch)
        if want is not None and want != phase.steps:
            problems.append(f"phases[{index}].steps: batch.phases[{index}] is {_length(spec)}, {want} steps of "
                            f"{phase.effective_batch}; the plan has {phase.steps}")
    return problems


def _steps(length: Any, recipe: Recipe, effective: int, per_epoch: int | None) -> int | None:
    unit, value = length.unit, length.value
    if unit == "epochs":
        return None if per_epoch is None else round(value * per_epoch)
    samples = {"steps": lambda: value * recipe.batch.sequences, "samples": lambda: value,
               "tokens": lambda: value / recipe.batch.sequence_length}[unit]()
    return round(samples / effective)


def _length(length: Any) -> str:
    return f"{length.value:g} {length.unit}"


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, float) or isinstance(want, float):
        try:
            return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(got, tuple):
        got = list(got)
    return got == want


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _measured(value: float, values: list[float], how: str) -> str:
    if len(values) == 1:
        return f"{value:.4g}"
    return f"{value:.4g} ({how} of {len(values)} seeds, {min(values):.4g}..{max(values):.4g})"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "check"


# ---- the whole suite, and its reports -------------------------------------------------------------------


def prepare_work(work: Path | None) -> tuple[Path, bool]:
    """The folder runs are written to: `work` (ours, or empty), or a new temporary one (removed afterwards)."""
    if work is None:
        return Path(tempfile.mkdtemp(prefix="reproduce-check-")), True
    if work.exists() and not work.is_dir():
        raise UserError(f"--work: {work} exists and is not a folder")
    if work.is_dir() and any(work.iterdir()) and not (work / WORK_MARKER).is_file():
        raise UserError(f"--work: {work} holds other files (it is not a work folder of `reproduce check`); "
                        "choose an empty or new folder")
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARKER).write_text("runs of `reproduce check`; safe to delete\n", encoding="utf-8")
    return work, False


def run_checks(
    files: list[LoadedFile], work: Path, plots: Path | None = None,
    log: Callable[[str], None] | None = None, on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    runner = Runner(work, plots, log)
    results = []
    for file in files:
        for index in range(len(file.spec.checks)):
            (log or (lambda text: None))(f"{file.path}: {file.names[index]}")
            result = runner.evaluate(file, index)
            results.append(result)
            if on_result:
                on_result(result)
    return results


def cleanup(work: Path, temporary: bool) -> None:
    if temporary:
        shutil.rmtree(work, ignore_errors=True)


def counts(results: list[Result]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in ("pass", "fail", "error")}


def junit_xml(results: list[Result], seconds: float) -> str:
    """JUnit XML: one testsuite per check file, one testcase per check; failures and errors with details."""
    total = counts(results)
    suites = ET.Element("testsuites", name="reproduce check", tests=str(len(results)),
                        failures=str(total["fail"]), errors=str(total["error"]), time=f"{seconds:.2f}")
    for file in dict.fromkeys(r.file for r in results):
        mine = [r for r in results if r.file == file]
        c = counts(mine)
        suite = ET.SubElement(suites, "testsuite", name=file, tests=str(len(mine)), failures=str(c["fail"]),
                              errors=str(c["error"]), skipped="0", time=f"{sum(r.seconds for r in mine):.2f}")
        for r in mine:
            case = ET.SubElement(suite, "testcase", classname=f"reproduce.{Path(file).stem}", name=r.name,
                                 time=f"{r.seconds:.2f}")
            text = f"measured: {r.measured}\nexpected: {r.expected}\n" + "\n".join(r.details)
            if r.status == "fail":
                ET.SubElement(case, "failure", message=f"measured {r.measured}; expected {r.expected}",
                              type=r.kind).text = text
            elif r.status == "error":
                ET.SubElement(case, "error", message=(r.details or ["error"])[0], type=r.kind).text = text
            ET.SubElement(case, "system-out").text = text
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


ICONS = {"pass": "✅ pass", "fail": "❌ FAIL", "error": "💥 ERROR"}


def markdown(results: list[Result], seconds: float) -> str:
    """A Markdown report for a CI job summary: totals, one table row per check, then the failures' details."""
    c = counts(results)
    head = f"{c['pass']} passed, {c['fail']} failed" + (f", {c['error']} errors" if c["error"] else "")
    lines = [f"## reproduce check: {head} in {seconds:.0f} s", "",
             "| status | file | check | measured | expected | seconds |", "|---|---|---|---|---|---:|"]
    for r in results:
        cells = [ICONS[r.status], r.file, r.name, r.measured, r.expected, f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    bad = [r for r in results if not r.passed]
    if bad:
        lines += ["", "### Failures", ""]
        for r in bad:
            lines.append(f"- **{_cell(r.file)}: {_cell(r.name)}** ({r.status}): measured {_cell(r.measured)}; "
                         f"expected {_cell(r.expected)}")
            lines += [f"  - {_cell(d)}" for d in r.details]
    plots = [r for r in results if r.plot]
    if plots:
        lines += ["", "### Plots", ""] + [f"- {r.file}: {r.name}: `{r.plot}`" for r in plots]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_reports(results: list[Result], seconds: float, junit: Path | None, summary: Path | None) -> None:
    if junit is not None:
        write_text_atomic(junit, junit_xml(results, seconds))
    if summary is not None:
        write_text_atomic(summary, markdown(results, seconds))


def check_outputs(junit: Path | None, summary: Path | None, plots: Path | None, inputs: list[Path]) -> None:
    """Refuse output paths that are folders, lie under files, or are one of the check files."""
    for path, option in ((junit, "--junit"), (summary, "--summary")):
        if path is not None:
            check_writable(path, option, protect=tuple(inputs))
    if plots is not None and plots.exists() and not plots.is_dir():
        raise UserError(f"--plots: {plots} exists and is not a folder")
