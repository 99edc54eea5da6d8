"""What a run leaves in its folder: the folder's guard (never overwrite another run), metrics.jsonl, the loss plot.

No torch here: `reproduce check` reads metrics and plots without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import UserError


def check_out_dir(out: Path, resume: bool, force: bool) -> None:
    """Never overwrite another run: a non-empty folder needs --resume (same run) or --force."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} exists and is not a folder")
    if resume:
        if not (out / "checkpoints" / "last.pt").is_file():
            raise UserError(f"--resume: {out} has no checkpoints/last.pt to resume from")
        return
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out: {out} is not empty ({folder_holds(out)}); " + (
            "pass --resume to continue it, --force to overwrite its outputs, or choose another folder"
            if any((out / name).exists() for name in OUTPUTS) else
            "choose another folder (--force would keep these files and write the run's outputs beside them)"
        ))


def folder_holds(out: Path) -> str:
    """What a folder holds, in a few words: another run's outputs, or the names of what is there."""
    runs = [name for name in OUTPUTS if (out / name).exists()]
    if runs:
        return f"it holds another run: {', '.join(runs)}"
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in out.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"it holds {shown}, not a run of reproduce"


OUTPUTS = ("plan.yaml", "metrics.jsonl", "summary.json", "model.pt", "loss.png", "checkpoints/last.pt")


def remove_outputs(out: Path) -> None:
    """The files a run writes, removed before another run takes the folder over (--force); nothing else."""
    from .checkpoint import SHARDED_PREFIX  # (torch: this module is read without it)

    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    for sharded in (out / "checkpoints").glob(f"{SHARDED_PREFIX}*"):
        shutil.rmtree(sharded)
    for folder in ("tensorboard", "wandb", "mlflow", "adapter", "merged"):  # trackers' runs, models/trained.py
        if (out / folder).is_dir():
            shutil.rmtree(out / folder)
    (out / "trackers.json").unlink(missing_ok=True)


class MetricsLog:
    """metrics.jsonl, appended and flushed once per optimizer step; written by rank 0 alone."""

    def __init__(self, path: Path, offset: int, enabled: bool):
        self.path, self.handle = path, None
        if enabled:
            with open(path, "a+b") as handle:
                handle.truncate(offset)  # drop lines written after the checkpoint we resume from
            self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, record: dict) -> None:
        if self.handle:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def offset(self) -> int:
        return self.handle.tell() if self.handle else 0

    def close(self) -> None:
        if self.handle:
            self.handle.close()


def read_metrics(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_metrics(metrics_path: Path, png: Path) -> str:
    """A loss curve PNG when matplotlib is installed (the `plots` extra); otherwise a note saying so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no loss plot: matplotlib is not installed (pip install 'reproduce-large-batch[plots]')"
    records = [r for r in read_metrics(metrics_path) if "loss" in r]  # not the out-of-memory event lines
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        axis.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return str(png)
