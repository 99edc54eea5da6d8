"""Drift across reruns: `reproduce check --history FILE` appends each check's value to a JSONL history (with the
commit, date and machine), and a check with `drift:` must stay within a band of its own last passing values there,
so a metric that shifts slowly, run after run, is caught. A failed value is recorded but not counted: a deliberate
change starts a new history file. No torch here.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import reproduce

from ..errors import UserError
from .schema import Drift


@dataclass(frozen=True)
class Band:
    """The band a check's value must stay in: `mean` +- `half_width`, from `runs` values of its history."""

    mean: float
    half_width: float
    runs: int
    low: float  # the history's smallest and largest value in the band's window
    high: float

    def to_json(self) -> dict[str, float | int]:
        return {"mean": self.mean, "half_width": self.half_width, "runs": self.runs}

    def text(self) -> str:
        return f"{self.mean:.4g} +- {self.half_width:.3g} of its last {self.runs} passing runs"


class History:
    """The JSONL history file: read once before the checks run, appended to once after."""

    def __init__(self, path: Path):
        self.path = path
        self.records = read_history(path)

    def band(self, file: str, check: str, drift: Drift) -> tuple[Band | None, int]:
        """The band of the check's last `drift.last` passing values (None with fewer than `drift.min_runs`), and how
        many there are."""
        values = [float(r["value"]) for r in self.records if r.get("file") == file and r.get("check") == check
                  and r.get("status") == "pass" and isinstance(r.get("value"), (int, float))][-drift.last:]
        if len(values) < drift.min_runs:
            return None, len(values)
        mean = statistics.fmean(values)
        widths = [drift.tolerance or 0.0, (drift.rel_tolerance or 0.0) * abs(mean)]
        if drift.sigmas is not None:
            widths.append(drift.sigmas * statistics.stdev(values))
        return Band(mean, max(widths), len(values), min(values), max(values)), len(values)

    def append(self, results: list[Any]) -> int:
        """One line per result (the runner's Result), with the commit of the working directory's checkout (None
        outside one), the date (UTC) and the machine; returns how many were written."""
        commit, dirty = git_state(Path.cwd())
        stamp = {"commit": commit, "dirty": dirty, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(), "reproduce": reproduce.__version__}
        lines = [json.dumps({"file": r.file, "check": r.name, "kind": r.kind, "metric": r.metric, "value": r.value,
                             "values": r.values, "status": r.status, "measured": r.measured, "paper": r.paper,
                             "band": r.band, **stamp}, sort_keys=False) for r in results]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        return len(lines)


def read_history(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: line {number}: not JSON ({error.msg}); a history holds one JSON object a line, "
                            "as `history` of reproduce check writes them", field="history") from None
        if not isinstance(record, dict) or not isinstance(record.get("file"), str) or not isinstance(
                record.get("check"), str):
            raise UserError(f"{path}: line {number}: expected an object with file, check and value, as `history` of "
                            "reproduce check writes them", field="history")
        records.append(record)
    return records


def git_state(folder: Path) -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def machine() -> dict[str, Any]:
    """The host, its system and CPUs, Python, and torch with its GPU when the checks imported it."""
    out: dict[str, Any] = {"host": platform.node(), "system": platform.platform(), "cpus": os.cpu_count(),
                           "python": platform.python_version()}
    torch = sys.modules.get("torch")  # only when a check trained: a plan-only suite imports no torch for this
    if torch is not None:
        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def drift_verdict(history: History | None, file: str, check: str, value: float, drift: Drift,
                  ) -> tuple[bool, str, str, Band | None]:
    """(whether it holds, the expected text, the detail line, the band) of a value's drift against its history."""
    if history is None:
        return True, "drift not checked", "drift: not checked (give --history FILE to keep and check the values)", None
    band, runs = history.band(file, check, drift)
    if band is None:
        return True, f"drift: {runs} of {drift.min_runs} runs", (
            f"drift: not checked yet: {runs} passing value(s) in {history.path}, the band needs {drift.min_runs}"), None
    expected = f"within {band.text()}"
    if abs(value - band.mean) <= band.half_width:
        return True, expected, f"drift: {value:.4g} within {band.text()} in {history.path} ({band.low:.4g} .. " \
                               f"{band.high:.4g})", band
    return False, expected, (f"drift: {value:.4g} moved {value - band.mean:+.3g} from {band.text()} in "
                             f"{history.path} ({band.low:.4g} .. {band.high:.4g}), beyond the band"), band
