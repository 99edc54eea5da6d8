"""`reproduce run --log-to tensorboard,wandb,mlflow`: the run in the experiment trackers researchers watch.

`Trackers` sends the run's start, records and end to each backend (tracker_backends.py), beside the CLI's renderer;
neither calls the other, and the trainer does not know trackers exist. The plan is the run's config and plan.yaml
its artifact; every numeric field of each metrics.jsonl record is logged at its step under its own name;
summary.json, loss.svg and plots/*.png are artifacts at the end. W&B runs offline unless WANDB_MODE or an API key
says otherwise (files in RUN/wandb, `wandb sync` uploads them); MLflow logs to RUN/mlflow (SQLite) unless
MLFLOW_TRACKING_URI names another store. RUN/trackers.json keeps each tracker's run id and last step: a resume
continues the same tracker run, catching up from metrics.jsonl and never logging a step twice (steps logged past the
checkpoint keep their values, recomputed bitwise equal; TensorBoard drops them, `purge_step`). A failing tracker
gives one warning and is dropped (metrics.jsonl stays the truth); a missing package is a UserError naming the extra,
from `parse_log_to` before anything trains.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import Interrupted, UserError
from ..storage.signals import SignalReceived
from .outputs import read_metrics
from .tracker_backends import BACKENDS, Tracker

TRACKERS = ("tensorboard", "wandb", "mlflow")
STATE = "trackers.json"
LOG_TO_HELP = ("Also log each optimizer step to experiment trackers: a comma-separated list of tensorboard, wandb, "
               "mlflow (wandb offline without an API key, files in OUT/wandb; mlflow in OUT/mlflow unless "
               "MLFLOW_TRACKING_URI is set).")
_PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),  # module, pip
             "mlflow": ("mlflow", "mlflow-skinny")}


def parse_log_to(values: list[str] | None, tensorboard: bool = False) -> list[str]:
    """The trackers --log-to and --tensorboard name, in a fixed order, each importable (else the extra to install)."""
    names = [name.strip().lower() for value in values or [] for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise UserError(f"unknown tracker {unknown[0]!r}; expected a comma-separated list of "
                        f"{', '.join(TRACKERS)}", field="log_to")
    chosen = [name for name in TRACKERS if name in names or (tensorboard and name == "tensorboard")]
    for name in chosen:
        try:
            importlib.import_module(_PACKAGES[name][0])
        except ImportError:
            raise UserError(f"`log_to` {name}: the {_PACKAGES[name][1]} package is not installed; install the extra: "
                            f"pip install 'reproduce-large-batch[{name}]' (metrics.jsonl has the same numbers)"
                            ) from None
    return chosen


def numeric(record: dict) -> dict[str, float]:
    """A metrics record's numeric fields but `step` (booleans as 0/1, a non-finite loss as it is)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))}


def step_of(record: dict) -> int | None:
    """The optimizer step of a step record; None for event lines (out of memory) and anything else."""
    step = record.get("step")
    if "event" in record or not isinstance(step, int) or isinstance(step, bool):
        return None
    return step


class Trackers:
    """The run's start, records, gates and end sent to each tracker; each method returns the lines to show. As a
    context manager around `train`, a run stopped early closes its tracker runs as failed or killed."""

    def __init__(self, names: list[str], out: str | Path, backends: dict | None = None):
        self.out = Path(out)
        self.trackers = [(backends or BACKENDS)[name]() for name in names]
        self.last: dict[str, int] = {}  # tracker -> last step it holds
        self.state: dict[str, dict] = {}
        self.said: list[str] = []  # the lines to show, since the last call

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        stopped = (Interrupted, KeyboardInterrupt, SignalReceived)
        status = "killed" if kind is not None and issubclass(kind, stopped) else "failed"
        for tracker in self.trackers:
            self._call(tracker, tracker.close, status)

    def _lines(self) -> list[str]:
        lines, self.said = self.said, []
        return lines

    def _call(self, tracker: Tracker, method, *args, doing: str = "") -> bool:
        """Call a tracker; a failure is one warning, and the tracker is dropped from the run."""
        try:
            method(*args)
            return True
        except Exception as error:  # any failure of a tracker's library: the run must go on
            if tracker in self.trackers:
                self.trackers.remove(tracker)
                if doing:
                    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                    self.said.append(f"warning: {tracker.name} logging stopped ({doing}: {type(error).__name__}: "
                                     f"{first}); the run goes on and {self.out / 'metrics.jsonl'} has every step")
                with contextlib.suppress(Exception):  # it failed once already, and that was reported
                    tracker.close("failed")
            return False

    def _save_state(self) -> None:
        """trackers.json, replaced whole after each step. Without an fsync (12 ms each on this disk): a crash of
        the machine itself may leave it a few steps behind, which W&B then drops as steps it already has."""
        path = self.out / STATE
        temporary = path.with_name(f".{STATE}.tmp")
        temporary.write_text(json.dumps(self.state, indent=2) + "\n", encoding="utf-8")
        os.replace(temporary, path)

    def start(self, start) -> list[str]:
        """Each tracker's run opened with the plan (`start`: train/reporter.RunStart)."""
        plan, first_step = start.plan, start.first_step
        path = self.out / STATE
        saved = json.loads(path.read_text(encoding="utf-8")) if first_step and path.is_file() else {}
        records = read_metrics(self.out / "metrics.jsonl") if first_step else []  # truncated to the checkpoint
        for tracker in list(self.trackers):
            previous = saved.get(tracker.name)

            def opened(tracker=tracker, previous=previous) -> None:
                self.state[tracker.name] = tracker.open(plan, self.out, first_step, previous)

            if not self._call(tracker, opened, doing="opening its run"):
                continue
            self.last[tracker.name] = tracker.resumes(first_step, previous) if previous else 0
            for record in records:  # catch up on the steps it missed (a resume, a tracker added on resume)
                step = step_of(record)
                if step is not None and step > self.last[tracker.name]:
                    self._log(tracker, step, record)
        if self.state:
            self._save_state()
        return self._lines()

    def _log(self, tracker: Tracker, step: int, record: dict) -> None:
        if self._call(tracker, tracker.log, step, numeric(record), doing=f"step {step}"):
            self.last[tracker.name] = step
            self.state[tracker.name]["step"] = step

    def step(self, record: Any) -> list[str]:
        """A step's record (train/reporter.StepRecord): its metrics.jsonl line logged."""
        return self.log(record.line())

    def log(self, record: dict) -> list[str]:
        step = step_of(record)
        if step is not None and self.trackers:
            for tracker in list(self.trackers):
                if step > self.last.get(tracker.name, 0):
                    self._log(tracker, step, record)
            self._save_state()
        return self._lines()

    def message(self, text: str) -> None:
        """(The run's notes are the renderer's to show.)"""

    def gate(self, event: dict) -> list[str]:
        for tracker in list(self.trackers):
            self._call(tracker, tracker.event, event["step"], event, doing=f"gate {event['name']}")
        return self._lines()

    def _plots(self, folder: Path) -> dict[str, Path]:
        """`reproduce report`'s curves of this run as artifacts `plots/NAME.png`; none without matplotlib."""
        from ..report.figures import figures, matplotlib_missing
        from ..report.runs import load_run

        if matplotlib_missing():
            return {}
        made = {}
        for figure in figures([load_run(self.out)]):
            path = folder / f"{figure.name}.png"
            path.write_bytes(figure.png)
            made[f"plots/{figure.name}.png"] = path
        return made

    def finish(self, end) -> list[str]:
        """Each tracker's run finished with the summary and the run's files (`end`: a RunEnd); where they lie."""
        summary = end.summary
        files = {name: self.out / name for name in ("plan.yaml", "summary.json", "loss.svg")
                 if (self.out / name).is_file()}
        with tempfile.TemporaryDirectory(prefix="reproduce-plots-") as folder:
            try:
                files.update(self._plots(Path(folder)) if self.trackers else {})
            except Exception as error:  # the curves are extras: the run's own outputs are written
                self.said.append(f"warning: the trackers get no plots ({type(error).__name__}: {error})")
            for tracker in list(self.trackers):
                if self._call(tracker, tracker.finish, summary, files, doing="finishing its run"):
                    self.trackers.remove(tracker)
        wandb = self.state.get("wandb")
        if wandb and wandb.get("mode") == "offline":
            self.said.append(f"wandb: offline run {wandb['id']} in {self.out / 'wandb'}; upload it with: "
                             f"wandb sync {self.out / 'wandb'}/offline-run-*")
        mlflow = self.state.get("mlflow")
        if mlflow:
            self.said.append(f"mlflow: run {mlflow['run_id']} in {mlflow['tracking_uri']}")
        return self._lines()
