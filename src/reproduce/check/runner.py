"""Running the checks: runs shared between the checks that name them, trained in a work folder."""

from __future__ import annotations

import json
import math
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import Interrupted, UserError
from ..plan.flatview import flat_fields
from ..plan.planner import Plan, make_plan
from ..plan.recipe import NamedData, Recipe
from ..plan.units import format_size, parse_size
from .history import History, drift_verdict
from .invariants import plan_problems
from .load import LoadedFile, Run, check_name
from .schema import WORK_MARKER, CompareCheck, MetricCheck, PlanCheck, VerifyCheck

if TYPE_CHECKING:
    from ..data import Datasets


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
    metric: str | None = None  # what `value` measures (metric and compare checks; `--history` keeps it)
    value: float | None = None
    values: list[float] | None = None  # per seed (compare: a's and b's aggregates)
    paper: dict | None = None  # the paper's value of the metric {value, tolerance}, as `value` is scaled
    band: dict | None = None  # the drift band `value` was checked against {mean, half_width, runs}

    @property
    def passed(self) -> bool:
        return self.status == "pass"


class Runner:
    """Evaluates checks; trains each distinct (recipe, budget, seed) once, in `work`."""

    def __init__(self, work: Path, plots: Path | None = None, log: Callable[[str], None] | None = None,
                 history: History | None = None):
        self.work, self.plots, self.history = work, plots, history
        self.log = log or (lambda text: None)
        self.cache: dict[str, dict] = {}  # each run's summary.json
        self.data: dict[str, Datasets] = {}

    def dataset(self, recipe: Recipe) -> Datasets:
        from ..data import build_data

        key = json.dumps([recipe.data.model_dump(mode="json"), recipe.batch.sequence_length], sort_keys=True)
        if key not in self.data:
            self.data[key] = build_data(recipe)
        return self.data[key]

    def plan_for(self, run: Run, dataset_size: int | dict | None) -> Plan:
        budget = run.budget
        return make_plan(run.recipe, budget.micro_batch_max, budget.world_size, budget.policy,
                    dataset_size=dataset_size, recipe_path=run.recipe_path)

    def planned(self, run: Run) -> tuple[Datasets, Plan]:
        """The run's data, and its plan for the data's size (as `run` plans it)."""
        from ..data import training_sizes

        data = self.dataset(run.recipe)
        return data, self.plan_for(run, training_sizes(run.recipe, data.train))

    def folder(self, file: LoadedFile, run: Run, seed: int) -> Path:
        return self.work / _slug(file.path.stem) / _slug(run.name) / f"seed-{seed}"

    def train(self, file: LoadedFile, run: Run, seed: int) -> dict:
        key = run.key(seed)
        if key in self.cache:
            return self.cache[key]
        from ..train.trainer import RunRequest, train

        data, plan = self.planned(run)
        max_steps = run.budget.max_steps
        if run.budget.max_epochs is not None and plan.steps_per_epoch:
            max_steps = max(1, math.ceil(run.budget.max_epochs * plan.steps_per_epoch))
        self.log(f"  training {run.name!r} seed {seed}: {plan.arithmetic}, "
                 f"{min(max_steps or plan.optimizer_steps or 0, plan.optimizer_steps or 0)} steps")
        request = RunRequest(self.folder(file, run, seed), device=run.budget.device, max_steps=max_steps, seed=seed,
                             force=True)
        self.cache[key] = train(plan, request, data=data)
        return self.cache[key]

    def values(self, file: LoadedFile, run: Run, metric: str) -> list[float]:
        return [lookup(self.train(file, run, seed), metric) for seed in run.seeds]

    def evaluate(self, file: LoadedFile, index: int) -> Result:
        check = file.spec.checks[index]
        name = file.names[index]
        started = time.perf_counter()
        value, values, paper, band = None, None, None, None
        try:
            status, measured, expected, details, plot, *numbers = getattr(self, f"_{check.kind}")(file, check)
            if numbers:
                value, values = numbers
                paper = paper_value(file.runs[check.run].recipe, check) if check.kind == "metric" else None
            drift = getattr(check, "drift", None)
            if drift is not None and value is not None:  # the value against the band of its own history
                holds, wanted, line, found = drift_verdict(self.history, file.label, name, value, drift)
                band = found.to_json() if found is not None else None
                status = status if holds else "fail"
                expected = f"{expected}, {wanted}" if expected else wanted
                details = [line, *details] if not holds else [*details, line]
        except Interrupted:
            raise
        except Exception as error:  # bad input, or a crash in training or in the user's factory: reported, not fatal
            status, measured, expected, plot = "error", "-", "-", None
            details = list(error.lines) if isinstance(error, UserError) else [f"{type(error).__name__}: {error}"]
        return Result(file.label, name, check.kind, status, measured, expected,
                      round(time.perf_counter() - started, 2), details, plot, getattr(check, "metric", None), value,
                      values, paper, band)

    def _plan(self, file: LoadedFile, check: PlanCheck):
        run = file.runs[check.run]
        spec = run.recipe.data  # data.train_size, else the size of the data a `factory:` makes, as `plan` asks it
        size = spec.train_size
        if size is None and spec.available and isinstance(spec, NamedData) and spec.factory is not None:
            from ..data import training_sizes

            size = training_sizes(run.recipe, self.dataset(run.recipe).train)
        plan = self.plan_for(run, size)
        problems = plan_problems(plan, run.budget)
        shown = flat_fields(plan)  # the fields as `plan --json` shows them, which `expect` names
        for key, want in check.expect.items():
            got = shown[key]
            if not _same(got, want):
                problems.append(f"{key}: expected {want!r}, the plan has {got!r}")
        steps = plan.optimizer_steps
        measured = (f"{plan.arithmetic} {'' if plan.effective_tokens else plan.unit}".rstrip()
                    + f", lr {plan.lr:.4g}, {steps if steps is not None else '?'} steps")
        budget = run.budget
        memory = f", {format_size(parse_size(budget.memory))}" if budget.memory else ""
        stated = f" + {len(check.expect)} stated values" if check.expect else ""
        expected = f"invariants{stated} (m <= {budget.micro_batch_max}, W = {budget.world_size}{memory})"
        details = problems + [f"plan warning: {w}" for w in plan.warnings]
        if check.expect:
            details.append("stated: " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in check.expect.items()))
        return ("pass" if not problems else "fail"), measured, expected, details, None

    def _verify(self, file: LoadedFile, check: VerifyCheck):
        from ..verify.accumulation import verify

        run = file.runs[check.run]
        data, plan = self.planned(run)
        result = verify(plan, samples=check.samples, tolerance=check.tolerance, dtype=check.dtype,
                        device=check.device, seed=run.seeds[0], data=data)
        got = "equivalent" if result.within_tolerance else "not-equivalent"
        measured = f"{result.verdict}: rel. error {result.global_relative_error:.3g}"
        expected = (f"equivalent: rel. error <= {result.tolerance:g}" if check.expect == "equivalent" else
                    f"not equivalent: rel. error > {result.tolerance:g}") + f" ({result.dtype})"
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
        conditions: list[bool] = []
        expected: list[str] = []
        _bounds(value, check.min, check.max, conditions, expected)
        spread = f" ({check.aggregate} of {len(values)} seeds, {min(values):.4g}..{max(values):.4g})"
        measured = f"{value:.4g}" + (spread if len(values) > 1 else "")
        details = [f"{check.metric} x {check.scale:g}" if check.scale != 1 else check.metric]
        details[0] += f" per seed {run.seeds}: {', '.join(f'{v:.4g}' for v in values)}"
        if check.baseline is not None:
            base = aggregate(self.values(file, run, check.baseline), check.aggregate)
            ratio = value / base if base else math.inf
            measured += f" = {ratio:.3f} x {check.baseline} ({base:.4g})"
            _bounds(ratio, check.min_ratio, check.max_ratio, conditions, expected, suffix=f" x {check.baseline}")
        if check.reported is not None:  # the paper's value and tolerance, as the result carries them
            paper = paper_value(run.recipe, check)
            conditions.append(abs(value - paper["value"]) <= paper["tolerance"])
            expected.append(f"reported {paper['value']:g} +- {paper['tolerance']:g}")
        return ("pass" if all(conditions) else "fail"), measured, ", ".join(expected), details, None, value, values

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
        _bounds(diff, check.at_least, check.at_most, conditions, expected, prefix="a - b ")
        measured = f"a {a:.4g}, b {b:.4g}: a - b = {diff:+.3g}"
        details = [
            f"a = {check.a} ({check.aggregate} over seeds {run_a.seeds}: {', '.join(f'{v:.4g}' for v in values_a)})",
            f"b = {check.b} ({check.aggregate} over seeds {run_b.seeds}: {', '.join(f'{v:.4g}' for v in values_b)})",
        ]
        plot, note = self.plot(file, check, run_a, run_b)
        if note:
            details.append(note)
        return ("pass" if all(conditions) else "fail"), measured, ", ".join(expected), details, plot, diff, [a, b]

    def plot(self, file: LoadedFile, check: CompareCheck, run_a: Run, run_b: Run) -> tuple[str | None, str | None]:
        """Both runs' curves of the compared metric on one PNG (first seed of each), when matplotlib is here."""
        if self.plots is None:
            return None, "no plot: give --plots DIR (or --summary) to keep one"
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None, "no plot: matplotlib is not installed (pip install 'reproduce-large-batch[plots]')"
        from ..observe.outputs import read_metrics

        figure, axis = plt.subplots(figsize=(7, 4))
        key = check.metric
        for label, run, style in (("a", run_a, "-"), ("b", run_b, "--")):
            self.train(file, run, run.seeds[0])
            records = read_metrics(self.folder(file, run, run.seeds[0]) / "metrics.jsonl")
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


def paper_value(recipe: Recipe, check: MetricCheck) -> dict | None:
    """The paper's value of a metric check's measure (the `reported:` one it names, else its metric's when unscaled)."""
    name = check.reported or (check.metric if check.scale == 1 else None)
    found = next((r for r in recipe.reported if r.metric == name), None)
    if found is None:
        return None
    tolerance = check.tolerance if check.reported is not None and check.tolerance is not None else found.tolerance
    return {"metric": found.metric, "value": found.value, "tolerance": tolerance}


def aggregate(values: list[float], how: str) -> float:
    return {"mean": statistics.fmean, "min": min, "max": max}[how](values)


def _bounds(value: float, low: float | None, high: float | None, conditions: list[bool], expected: list[str],
            prefix: str = "", suffix: str = "") -> None:
    """`value` >= `low` and <= `high`, each bound given: its condition, and its line in the expected text."""
    if low is not None:
        conditions.append(value >= low)
        expected.append(f"{prefix}>= {low:g}{suffix}")
    if high is not None:
        conditions.append(value <= high)
        expected.append(f"{prefix}<= {high:g}{suffix}")


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, float) or isinstance(want, float):
        try:
            return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(got, tuple):
        got = list(got)
    return got == want


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "check"


def prepare_work(work: Path | None) -> tuple[Path, bool]:
    """The folder runs are written to: `work` (ours, or empty), or a new temporary one (removed afterwards)."""
    if work is None:
        return Path(tempfile.mkdtemp(prefix="reproduce-check-")), True
    if work.exists() and not work.is_dir():
        raise UserError(f"{work} exists and is not a folder", field="work")
    if work.is_dir() and any(work.iterdir()) and not (work / WORK_MARKER).is_file():
        raise UserError(f"{work} holds other files (it is not a work folder of `reproduce check`); "
                        "choose an empty or new folder", field="work")
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARKER).write_text("runs of `reproduce check`; safe to delete\n", encoding="utf-8")
    return work, False


def run_checks(
    files: list[LoadedFile], work: Path, plots: Path | None = None,
    log: Callable[[str], None] | None = None, on_result: Callable[[Result], None] | None = None,
    history: History | None = None,
) -> list[Result]:
    runner = Runner(work, plots, log, history)
    results = []
    for file in files:
        for index in range(len(file.spec.checks)):
            results.append(runner.evaluate(file, index))
            if on_result:
                on_result(results[-1])
    return results
