"""`reproduce evaluate RUN_DIR [--data DIR] [--eval-data DIR]`: a finished run's model evaluated again, without
training, with the metrics the run reports (segmentation: mIoU, the per-class IoU table, pixel accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .app import app
from .common import loss_text, print_lines

RUN_HELP = "A finished run's folder (the --out of reproduce run): its plan.yaml and model.pt."
DATA_HELP = "The data folder, instead of the run's data.path (a voc folder's val list is evaluated)."
EVAL_DATA_HELP = "The evaluation data, instead of the run's data.eval_path."
WORKERS_HELP = "DataLoader worker processes (default: as reproduce run)."


@app.command("evaluate")
def evaluate_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help=RUN_HELP),
    data_path: str | None = typer.Option(None, "--data", metavar="PATH", help=DATA_HELP),
    eval_data_path: str | None = typer.Option(None, "--eval-data", metavar="PATH", help=EVAL_DATA_HELP),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    workers: int | None = typer.Option(None, "--workers", min=0, help=WORKERS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
) -> None:
    """Evaluate a finished run's model.pt on its evaluation data, as the run evaluates (no training)."""
    from ..train.evaluation import evaluate_run

    metrics = evaluate_run(run_dir, data_path, eval_data_path, device, workers)
    if as_json:
        print(json.dumps(metrics, indent=2))
        return
    print_lines(metric_lines(metrics))


def metric_lines(metrics: dict) -> list[str]:
    """The per-class IoU table (n/a: a class in neither the predictions nor the targets), then the means."""
    lines = []
    ious = metrics.get("eval_class_iou")
    if ious is not None:
        lines.append("class  IoU")
        lines += [f"{index:>5}  {'n/a' if iou is None else f'{iou:.4f}'}" for index, iou in enumerate(ious)]
        present = sum(iou is not None for iou in ious)
        lines.append(f"mIoU {metrics['eval_miou']:.4f}: the mean over the {present} of {len(ious)} classes in the "
                     "predictions or the targets, from one confusion matrix over the split (MMSegmentation's); pixel "
                     f"accuracy {metrics['eval_pixel_accuracy']:.4f}")
    if "eval_accuracy" in metrics:
        lines.append(f"accuracy {metrics['eval_accuracy']:.4f}")
    lines.append(f"eval loss {loss_text(metrics['eval_loss'])} over {metrics['eval_items']:,} items")
    return lines
