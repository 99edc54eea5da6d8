"""The run folders a report shows, read as far as they got (no torch: while the run is still going, if need be), and
the paper's reported metric beside a run's final value, with its tolerance and the verdict: the reported name matched
to the run's field in one table, a paper's percentage shown as the run's fraction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..plan.planfile import load_plan
from ..plan.planner import Plan
from ..plan.reported import paper_scale


@dataclass
class RunFolder:
    path: Path
    name: str
    plan: Plan
    records: list[dict]  # the optimizer steps' records, in order (event lines apart)
    events: list[dict] = field(default_factory=list)  # out-of-memory notes and the like
    summary: dict | None = None  # None: still going, or stopped before the end

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"] if self.records else 0

    @property
    def status(self) -> str:
        """finished, or how far a run still going (or stopped, or resumed) got."""
        planned = self.plan.optimizer_steps
        if self.summary is None:
            return f"in progress or stopped: {self.last_step} of {planned} optimizer steps so far"
        text = "finished" if self.summary["steps"] == planned else (
            f"stopped early by --max-steps: {self.summary['steps']} of {planned} optimizer steps")
        if self.summary.get("resumed_from_step"):
            text += f" (resumed after step {self.summary['resumed_from_step']})"
        return text

    @property
    def complete(self) -> bool:
        return self.summary is not None and self.summary["steps"] == self.plan.optimizer_steps

    def final(self, key: str) -> tuple[int, float] | None:
        """The last step that has `key` and its value."""
        found = [(r["step"], float(r[key])) for r in self.records
                 if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return found[-1] if found else None


# counts of an evaluation, not results; and segmentation's per-class IoU, a list (the report's class table)
NOT_METRICS = {"eval_items", "eval_samples", "eval_tokens", "eval_seconds", "eval_class_iou"}


def eval_metrics(runs: list[RunFolder]) -> list[str]:
    """The evaluation results the runs record (eval_loss, eval_accuracy, ...), in a fixed order."""
    return sorted({key for run in runs for record in run.records for key in record
                   if key.startswith("eval_") and key not in NOT_METRICS})


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """Step records and event lines of metrics.jsonl. A run still writing may have a torn last line: left out."""
    steps, events = [], []
    if not path.is_file():
        return steps, events
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # being written right now
            raise UserError(f"{path}: line {number}: not a JSON record; metrics.jsonl is damaged") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {number}: expected a JSON object (a metrics record)")
        if "event" in record:
            events.append(record)
        elif isinstance(record.get("step"), int):
            steps.append(record)
    return steps, events


def what_it_holds(path: Path) -> str:
    """A few words on a folder that is not a run: the runs inside it, else the first names in it."""
    inside = sorted(p.parent for p in path.glob("*/plan.yaml"))
    if inside:
        shown = " ".join(str(p) for p in inside[:4]) + (" ..." if len(inside) > 4 else "")
        return f"it holds run folders: give them, e.g. reproduce report {shown}"
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
    if not names:
        return "it is empty"
    return "it holds " + ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def load_run(path: str | Path, name: str | None = None) -> RunFolder:
    """A run folder of `reproduce run`, or one line saying what the folder is instead."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such folder")
    if not path.is_dir():
        raise UserError(f"{path}: not a folder; give a run folder (the `out` of reproduce run)")
    if not (path / "plan.yaml").is_file():
        raise UserError(f"{path}: not a run of reproduce (no plan.yaml; {what_it_holds(path)})")
    plan = load_plan(path / "plan.yaml")
    records, events = read_records(path / "metrics.jsonl")
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise UserError(f"{path / 'summary.json'}: not JSON ({error.msg}, line {error.lineno})") from None
        if summary.get("final") and records and summary["final"].get("step") != records[-1]["step"]:
            summary = None  # a resumed run still going: the summary is the earlier part's
    return RunFolder(path, name or path.name, plan, records, events, summary)


def load_runs(paths: list[str | Path]) -> list[RunFolder]:
    if not paths:
        raise UserError("RUN_DIR: give at least one run folder")
    parts = [Path(p).resolve().parts for p in paths]  # names that tell the runs apart: as many parents as it takes
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            break
    else:
        names = [str(Path(p)) for p in paths]
    return [load_run(path, name) for path, name in zip(paths, names, strict=True)]


# reported metric -> (the run's field, how the run's value becomes the reported metric: "same" or "error")
MATCHES = {
    "top1_accuracy": ("eval_accuracy", "same"),
    "accuracy": ("eval_accuracy", "same"),
    "top1_error": ("eval_accuracy", "error"),
    "error": ("eval_accuracy", "error"),
    "val_loss": ("eval_loss", "same"),
    "eval_loss": ("eval_loss", "same"),
    "test_loss": ("eval_loss", "same"),
}


@dataclass
class Verdict:
    run: str
    metric: str
    split: str | None
    reported: float  # the paper's value in the run's scale (a percentage as a fraction)
    tolerance: float | None
    field: str | None  # the run's value compared, as a formula of its field (None: the run does not measure it)
    value: float | None  # the run's final value of the reported metric (a rate as a fraction)
    step: int | None
    verdict: str  # "within tolerance", "outside tolerance", "no tolerance stated", "not measured by this run"
    note: str = ""

    @property
    def passed(self) -> bool | None:
        return {"within tolerance": True, "outside tolerance": False}.get(self.verdict)


def verdicts(run: RunFolder) -> list[Verdict]:
    found = []
    for reported in run.plan.recipe.reported:
        field, how = MATCHES.get(reported.metric, (None, "same"))
        candidates = [field] if field else [f"eval_{reported.metric}", reported.metric]
        final = None
        for candidate in candidates:
            final = run.final(candidate)
            if final is not None:
                field = candidate
                break
        scale = paper_scale(reported.metric, reported.value)
        common = dict(run=run.name, metric=reported.metric, split=reported.split,
                      reported=round(reported.value * scale, 12),
                      tolerance=None if reported.tolerance is None else round(reported.tolerance * scale, 12))
        if final is None:
            found.append(Verdict(**common, field=None, value=None, step=None, verdict="not measured by this run",
                                 note=f"the run records no {' or '.join(candidates)}"))
            continue
        step, raw = final
        value, formula = (1.0 - raw, f"1 - {field}") if how == "error" else (raw, field)  # the reported metric
        if common["tolerance"] is None:
            verdict = "no tolerance stated"
        else:
            inside = abs(value - common["reported"]) <= common["tolerance"]
            verdict = "within tolerance" if inside else "outside tolerance"
        note = "" if run.complete else f"the run has not trained the paper's {run.plan.optimizer_steps} steps"
        found.append(Verdict(**common, field=formula, value=value, step=step, verdict=verdict, note=note))
    return found
