"""`reproduce report RUN_DIR [RUN_DIR ...] --out report.html`: the runs' result in one self-contained file."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UserError
from .app import app
from .common import stdout

OUT_HELP = "The HTML file (default: RUN_DIR/report.html for one run); its Markdown twin is written beside it (.md)."


@app.command("report")
def report_command(
    runs: list[Path] = typer.Argument(None, metavar="RUN_DIR", help="Run folders (the --out of reproduce run)."),
    out: Path | None = typer.Option(None, "--out", help=OUT_HELP),
    markdown: Path | None = typer.Option(None, "--markdown", help="The Markdown twin (default: --out with .md)."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Tables only (no matplotlib needed)."),
    history: Path | None = typer.Option(
        None, "--history", metavar="FILE", help="Add the values a `reproduce check --history FILE` kept, rerun "
        "after rerun, one plot a check beside the paper's value (RUN_DIR is then optional)."),
) -> None:
    """Show a run's result: plan against the paper, curves of every run overlaid, the paper's metric and verdict."""
    from ..report import load_runs, verdicts, write_report

    runs = list(runs or [])
    kept = None
    if history is not None:
        from ..check.history import read_history

        if not history.is_file():
            raise UserError(f"--history: {history} is not a file (give the JSONL file `reproduce check --history` "
                            "wrote)")
        kept = (history, read_history(history))
    loaded = load_runs(runs) if runs or history is None else []
    if out is None:
        if len(runs) != 1:
            raise UserError("--out: required with several runs or none (the report's HTML file, e.g. --out "
                            "report.html)")
        out = runs[0] / "report.html"
    written = write_report(loaded, out, markdown, plots=not no_plots, history=kept)
    for run in loaded:
        stdout.print(f"{run.name}: {run.status}", markup=False)
        for v in verdicts(run):
            value = "-" if v.value is None else f"{v.value:.4g}"
            tolerance = "" if v.tolerance is None else f" +- {v.tolerance:g}"
            stdout.print(f"  {v.metric}: paper {v.reported:g}{tolerance}, this run {value}: {v.verdict}", markup=False)
    images = len(written) - 2
    stdout.print(f"report written to {written[0]} and {written[1]}" + (f" (+ {images} plots)" if images else ""),
                 markup=False)
