"""`reproduce check [PATH ...]`: run the reproduction checks in check files (default: the reproduce/ folder)."""

from __future__ import annotations

import functools
import shutil
import sys
import time
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from ..errors import UserError
from ..plan.planfile import check_writable
from ..shipped import checks_folder, recipe_files
from .app import app
from .common import stdout

STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta"}
Annotations = Enum("Annotations", {"github": "github"}, type=str)


@app.command("check")
def check_command(
    paths: list[Path] = typer.Argument(None, metavar="PATH", help="Check files or folders (default: reproduce/)."),
    shipped: bool = typer.Option(
        False, "--shipped", help="Run the suite shipped with reproduce (PATHs are then its file names: digits-mlp)."
    ),
    junit: Path | None = typer.Option(None, "--junit", help="Write a JUnit XML report here (for CI test views)."),
    summary: Path | None = typer.Option(None, "--summary", help="Write a Markdown report here (a CI job summary)."),
    work: Path | None = typer.Option(None, "--work", help="Keep the runs in this folder (default: a temporary one)."),
    plots: Path | None = typer.Option(
        None, "--plots", help="Folder for comparison plots (default: plots/ beside --summary; needs matplotlib)."
    ),
    history: Path | None = typer.Option(
        None, "--history", metavar="FILE", help="Append each check's measured value (with the git commit, the date, "
        "the machine) to this JSONL file, and check each `drift:` against the check's own last values there."
    ),
    annotations: Annotations | None = typer.Option(
        None, "--annotations", help="github: print each failing check as a GitHub Actions ::error annotation on "
        "its line of the check file."
    ),
) -> None:
    """Run reproduction checks: plan invariants, gradient equivalence, metric thresholds, run comparisons."""
    # imported here, not with the CLI: every other command (a short `run` most) starts without them
    from ..check import check_outputs, collect, load_all, prepare_work, run_checks, write_reports
    from ..check.history import History
    from ..check.report import github_annotations

    files = collect(shipped_paths(list(paths or [])) if shipped else list(paths or []))
    loaded = load_all(files)  # every problem in every file, before anything runs: exit 2
    if plots is None and summary is not None:
        plots = summary.parent / "plots"
    check_outputs(junit, summary, plots, files)
    kept = None
    if history is not None:
        check_writable(history, "`history`", protect=tuple(files))  # none of the check files
        kept = History(history)  # read (and a bad line refused) before anything runs
    folder, temporary = prepare_work(work)
    total = sum(len(f.spec.checks) for f in loaded)
    log = functools.partial(print, file=sys.stderr, flush=True)  # the suite's progress: each run trained, each result
    log(f"{total} checks in {len(loaded)} file(s); runs in {folder}{' (temporary)' if temporary else ''}")
    started = time.perf_counter()
    done = 0

    def on_result(result) -> None:
        nonlocal done
        done += 1
        log(f"[{done}/{total}] {result.file}: {result.name}: {result.status.upper()} ({result.seconds:.1f}s) "
            f"measured {result.measured}")

    html = None
    try:
        results = run_checks(loaded, folder, plots, log=log, on_result=on_result, history=kept)
        seconds = time.perf_counter() - started
        if junit is not None:  # beside the JUnit file, with the runs' curves: made before the runs are removed
            from ..report.write import write_check_report

            html = write_check_report(results, seconds, folder, junit)
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
    write_reports(results, seconds, junit, summary)
    if kept is not None:
        kept.append(results)  # after the reports: an interrupted suite adds nothing
    render(results, seconds)
    if annotations is Annotations.github:
        for line in github_annotations(loaded, results):
            print(line, flush=True)
    for path, what in ((junit, "JUnit XML"), (html, "HTML report"), (summary, "Markdown summary")):
        if path is not None:
            stdout.print(f"{what} written to {path}", markup=False)
    if history is not None:
        stdout.print(f"{len(results)} value{'s' if len(results) != 1 else ''} appended to the history {history}",
                     markup=False)
    raise typer.Exit(0 if all(r.passed for r in results) else 1)


def shipped_paths(names: list[Path]) -> list[Path]:
    """--shipped: the shipped suite's folder, or its files of these names (`digits-mlp`, `digits-mlp.yaml`)."""
    folder = checks_folder()
    if folder is None:
        raise UserError("--shipped: no check files were shipped with this installation of reproduce")
    if not names:
        return [folder]
    shipped = {p.stem: p for p in recipe_files(folder)}
    stems = [n.stem if n.suffix in (".yaml", ".yml") else n.name for n in names]
    missing = [str(n) for n, stem in zip(names, stems, strict=True) if stem not in shipped or len(n.parts) > 1]
    if missing:
        raise UserError(f"--shipped: no shipped check file {', '.join(missing)} (they are: {', '.join(shipped)})")
    return [shipped[stem] for stem in stems]


def render(results, seconds: float) -> None:
    from ..check import ICONS, tally

    table = Table(title="reproduce check", title_justify="left")
    for column, ratio in (("file", None), ("check", 2), ("status", None), ("measured", 3), ("expected", 3)):
        table.add_column(column, ratio=ratio, no_wrap=ratio is None)  # the short cells whole, the long ones wrapped
    table.add_column("seconds", justify="right", no_wrap=True)
    for r in results:
        table.add_row(r.file, r.name, f"[{STYLE[r.status]}]{ICONS[r.status].split()[-1]}[/]", r.measured,
                      r.expected, f"{r.seconds:.1f}")
    stdout.print(table)
    for r in results:
        if not r.passed:
            stdout.print(f"[{STYLE[r.status]}]{r.status.upper()}[/] {r.file}: {r.name}")
            for line in r.details:
                stdout.print(f"  {line}", markup=False)
    stdout.print(f"[bold]{tally(results)}[/] in {seconds:.1f}s")
