"""Writing the report: the HTML file, its Markdown twin and the twin's PNG folder, each written whole; and
`reproduce check --junit FILE.xml`'s FILE.html: the checks' results, their comparison plots, and the curves of the
runs they trained (one section per check file, its runs and seeds overlaid), in one page."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from .document import Block, Table, blocks, tally, to_html, to_markdown
from .figures import FIGURE_NAMES, Figure, figures, matplotlib_missing
from .runs import RunFolder, load_run


def write_report(runs: list[RunFolder], out: Path, markdown: Path | None = None, plots: bool = True,
                 history: tuple[Path, list[dict]] | None = None) -> list[Path]:
    """report.html and, unless `markdown` is the HTML itself, report.md with its PNGs; with `history` (a `check
    --history` file and its records) its values beside the paper's (runs optional)."""
    out = check_writable(out, "`out`")
    if out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"{out}: expected an .html file name (the Markdown twin is written beside it as .md)",
                        field="out")
    markdown = out.with_suffix(".md") if markdown is None else check_writable(markdown, "`markdown`")
    protected = {run.path.resolve() / name for run in runs for name in ("plan.yaml", "metrics.jsonl", "summary.json")}
    for path in (out, markdown):
        if path.resolve() in protected:
            raise UserError(f"{path}: is one of the run's own files; choose another name")
    if runs:
        content = blocks(runs, plots)
    else:  # the title of a report of a history and no run
        import datetime

        from .. import __version__

        made, shown = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}", history[0] if history else None
        content = [("h1", f"reproduce report: {shown.name if shown else 'no run'}"),
                   ("p", f"Made by reproduce {__version__} on {made} UTC from the history {shown}.")]
    if history is not None:
        from .history import history_blocks

        content += history_blocks(*history, plots)
    images = markdown.with_name(markdown.stem + "_files")  # report.md -> report_files/, as browsers save a page
    text, files = to_markdown(content, images, markdown.parent)
    if images.is_dir():  # plots an earlier report made that this one has not (only names a report gives)
        for old in images.glob("*.png"):
            if old not in files and (old.stem in FIGURE_NAMES or old.stem.startswith(("eval_", "history_"))):
                old.unlink()
    for path, png in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
    write_text_atomic(markdown, text)
    write_text_atomic(out, to_html(content))
    return [out, markdown, *files]


def check_blocks(results: list, seconds: float, work: Path) -> list[Block]:
    """`results`: check.runner.Result items; `work`: the folder the runs were trained in (work/FILE/RUN/seed-N)."""
    rows = [[r.status, r.file, r.name, r.measured, r.expected, f"{r.seconds:.1f}", "; ".join(r.details)]
            for r in results]
    content: list[Block] = [
        ("h1", f"reproduce check: {tally(results)} in {seconds:.0f} s"),
        ("table", Table(["status", "file", "check", "measured", "expected", "seconds", "details"], rows,
                        css="checks", row_css=[r.status for r in results])),
    ]
    plots = [r for r in results if r.plot and Path(r.plot).is_file()]
    if plots:
        content.append(("h2", "Comparison plots"))
        content += [("figure", Figure(Path(r.plot).stem, f"{r.file}: {r.name}", f"{r.file}: {r.name}.",
                                      Path(r.plot).read_bytes())) for r in plots]
    missing = matplotlib_missing()
    for group in sorted(p for p in work.iterdir() if p.is_dir()) if work.is_dir() else []:
        folders = sorted(p.parent for p in group.glob("*/seed-*/plan.yaml") if (p.parent / "metrics.jsonl").is_file())
        if not folders:
            continue
        runs = []
        for folder in folders:
            try:
                runs.append(load_run(folder, f"{folder.parent.name}/{folder.name}"))
            except UserError:  # a run that failed before writing its plan: its check says why
                continue
        content.append(("h2", f"Runs of {group.name}"))
        if missing:
            content.append(("p", missing))
        elif runs:
            content += [("figure", Figure(f"{group.name}-{f.name}", f"{group.name}: {f.title}", f.caption, f.png))
                        for f in figures(runs)]
    return content


def html_beside(junit: Path) -> Path:
    """The HTML report's path beside the JUnit file: junit.xml -> junit.html (never the JUnit file itself)."""
    if junit.suffix.lower() == ".html":
        return junit.with_name(junit.stem + ".report.html")
    return junit.with_suffix(".html")


def write_check_report(results: list, seconds: float, work: Path, path: Path) -> Path:
    path = check_writable(path, "`junit` (its HTML report)")
    write_text_atomic(path, to_html(check_blocks(results, seconds, work)))
    return path
