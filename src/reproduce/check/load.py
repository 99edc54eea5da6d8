"""Loading check files: every problem of every file, one line each, before anything runs."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import UserError
from ..plan.factory import remember_folder
from ..plan.flatview import FLAT_FIELDS
from ..plan.recipe import Recipe, load_recipe, parse_recipe
from ..plan.validation import read_yaml
from ..shipped import resolve_recipe
from .schema import DEFAULT_FOLDER, MAIN, Budget, CheckFile, format_errors


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
                            "files is, or give check files or folders; `shipped` runs the suite shipped with "
                            "reproduce)")
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
    unique: dict[Path, Path] = {}  # each file once, as first given
    for path in files:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


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
    remember_folder(path)  # factories it names (in its runs' overrides) are looked for beside it first
    try:
        spec = CheckFile.model_validate(data)
    except ValidationError as exc:
        raise UserError(*format_errors(exc, source)) from None
    problems: list[str] = []
    base = _load_recipe(spec.recipe, path, source, "recipe", problems)
    runs: dict[str, Run] = {}
    if base is not None and spec.sample_data is not None:
        recipe = _overlaid(base[0], {"data": {"path": str(sample_folder(spec.sample_data)), "available": True}},
                           f"{source}: sample_data", problems)
        base = None if recipe is None else (recipe, base[1])
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
        name, number = check_name(check), 2
        while name in names:  # a second check of the same name: `NAME #2`
            name, number = f"{check_name(check)} #{number}", number + 1
        names.append(name)
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


def sample_folder(kind: str) -> Path:
    """The data of a check file's `sample_data`, made once per process in a temporary folder removed at exit."""
    if kind not in _SAMPLE_FOLDERS:
        import atexit
        import shutil
        import tempfile

        from ..data.samples import write_voc

        folder = Path(tempfile.mkdtemp(prefix=f"reproduce-check-{kind}-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        write_voc(folder / kind)
        _SAMPLE_FOLDERS[kind] = folder / kind
    return _SAMPLE_FOLDERS[kind]


_SAMPLE_FOLDERS: dict[str, Path] = {}


def _overlaid(recipe: Recipe, overrides: dict, source: str, problems: list[str]) -> Recipe | None:
    """`recipe` with `overrides` merged in and validated again; None, its problems added, when it is invalid."""
    try:
        return parse_recipe(merge(recipe.model_dump(mode="json", exclude_unset=True), overrides), source=source)
    except UserError as error:
        problems.extend(error.lines)
        return None


def _load_recipe(name: str, check_path: Path, source: str, field_name: str, problems: list[str]):
    """The recipe beside the check file, in the working directory, else a shipped recipe of that name."""
    candidates = [Path(name)] if Path(name).is_absolute() else [check_path.parent / name, Path(name)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        with contextlib.suppress(UserError):
            found = resolve_recipe(name)
    if found is None:
        problems.append(
            f"{source}: {field_name}: no recipe file {name!r} (looked beside the check file, in the working "
            "directory and among the shipped recipes)"
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
        recipe = _overlaid(recipe, run_spec.overrides, f"{source}: {where}.overrides", problems)
        if recipe is None:
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
        known = list(FLAT_FIELDS)  # the plan as `plan --json` shows it
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
    if check.name or check.kind == "compare":
        return check.name or f"{check.metric}: {check.a} vs {check.b}"
    what = {"plan": "plan invariants", "verify": "gradient equivalence"}.get(check.kind) or check.metric
    return what + ("" if check.run == MAIN else f" ({check.run})")
