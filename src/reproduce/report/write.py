"""Writing the report: the HTML file, its Markdown twin and the twin's PNG folder, each written whole."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from .document import blocks, to_html, to_markdown
from .figures import FIGURE_NAMES
from .runs import RunFolder


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
