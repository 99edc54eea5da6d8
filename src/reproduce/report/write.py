"""Writing the report: the HTML file, its Markdown twin and the twin's PNG folder, each written whole; and
`reproduce check --junit FILE.xml`'s FILE.html: the checks' results, their comparison plots, and the curves of the
runs they trained (one section per check file, its runs and seeds overlaid), in one page. With `--history FILE`,
the values `reproduce check --history` kept, rerun after rerun, as a table and one plot a check beside the paper's
value, so a metric that drifts shows before a check fails."""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path

from .. import __version__
from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from .document import Block, Table, blocks, tally, to_html, to_markdown
from .figures import FIGURE_NAMES, Figure, figures, finished_png, matplotlib_missing
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
        made, shown = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}", history[0] if history else None
        content = [("h1", f"reproduce report: {shown.name if shown else 'no run'}"),
                   ("p", f"Made by reproduce {__version__} on {made} UTC from the history {shown}.")]
    if history is not None:
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
            with contextlib.suppress(UserError):  # a run that failed before writing its plan: its check says why
                runs.append(load_run(folder, f"{folder.parent.name}/{folder.name}"))
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


def write_check_report(results: list, seconds: float, work: Path, junit: Path) -> Path:
    """The HTML report beside the JUnit file, its path checked with the other outputs' before the checks ran."""
    path = html_beside(junit)
    write_text_atomic(path, to_html(check_blocks(results, seconds, work)))
    return path


def series(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The records with a value, by (check file, check name), oldest first."""
    out: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        if isinstance(record.get("value"), (int, float)) and not isinstance(record.get("value"), bool):
            out.setdefault((record["file"], record["check"]), []).append(record)
    return out


def history_table(found: dict[tuple[str, str], list[dict]]) -> Table:
    rows, css = [], []
    for (file, check), records in found.items():
        last, paper = records[-1], _paper(records)
        values = [float(r["value"]) for r in records]
        commit = (last.get("commit") or "-")[:10] + ("+" if last.get("dirty") else "")
        shown = "-" if paper is None else f"{paper['value']:g}" + (
            f" +- {paper['tolerance']:g}" if paper.get("tolerance") is not None else "")
        rows.append([file, check, last.get("metric") or "-", str(len(records)), f"{min(values):.4g} .. "
                     f"{max(values):.4g}", f"{values[-1]:.4g} ({last.get('status', '-')})", shown,
                     f"{last.get('date', '-')}, {commit}, {(last.get('machine') or {}).get('host', '-')}"])
        css.append({"pass": "pass", "fail": "fail"}.get(last.get("status"), "none"))
    return Table(["file", "check", "metric", "runs", "range", "last (status)", "paper", "last run (date, commit, "
                  "machine)"], rows, css="verdict", row_css=css)


def history_blocks(path: Path, records: list[dict], plots: bool = True) -> list[Block]:
    """The section of the history at `path`, whose `records` the caller read (the report imports no check)."""
    found = series(records)
    out: list[Block] = [("h2", f"Drift across reruns ({path.name})")]
    if not found:
        return [*out, ("p", f"{path} holds no measured value yet (`reproduce check --history {path}` adds them).")]
    out += [("p", "Each check's value at every rerun `reproduce check --history` recorded, with the paper's "
                  "value where its recipe reports one."), ("table", history_table(found))]
    missing = matplotlib_missing() if plots else "plots left out (--no-plots)"
    if missing:
        return [*out, ("p", missing)]
    return out + [("figure", figure) for figure in history_figures(found)]


def history_figures(found: dict[tuple[str, str], list[dict]]) -> list[Figure]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    made = []
    for index, ((file, check), records) in enumerate(found.items()):
        figure, ax = plt.subplots(figsize=(8, 3.6))
        xs = list(range(1, len(records) + 1))
        ys = [float(r["value"]) for r in records]
        ax.plot(xs, ys, "-", color="C0", alpha=0.5)
        for status, marker, color in (("pass", "o", "C0"), ("fail", "X", "C3"), ("error", "s", "C7")):
            picked = [(x, y) for x, y, r in zip(xs, ys, records, strict=True) if r.get("status") == status]
            if picked:
                ax.plot(*zip(*picked, strict=True), marker, color=color, linestyle="none", label=f"check {status}")
        band = records[-1].get("band")
        if isinstance(band, dict):  # what the last rerun was checked against
            ax.axhspan(band["mean"] - band["half_width"], band["mean"] + band["half_width"], color="C0", alpha=0.1,
                       label=f"drift band at the last rerun (its last {band['runs']} passing)")
        paper = _paper(records)
        if paper is not None:
            ax.axhline(paper["value"], color="C2", linestyle="--", label=f"paper {paper['value']:g}")
            if paper.get("tolerance"):
                ax.axhspan(paper["value"] - paper["tolerance"], paper["value"] + paper["tolerance"], color="C2",
                           alpha=0.12, label=f"paper +- {paper['tolerance']:g}")
        metric = records[-1].get("metric") or "value"
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("rerun (oldest first)")
        ax.set_ylabel(metric)
        ax.set_title(f"{file}: {check}")
        png = finished_png(figure, ax)
        dates = f"{records[0].get('date', '?')} to {records[-1].get('date', '?')}"
        caption = (f"{metric} at each of {len(records)} reruns ({dates}); the paper's value dashed where the recipe "
                   "reports one, the drift band shaded where the last rerun was checked against one.")
        made.append(Figure(f"history_{index + 1}", f"{file}: {check}", caption, png))
    return made


def _paper(records: list[dict]) -> dict | None:
    """The paper's value the latest record carries (the recipe's `reported:` at that run)."""
    return next((r["paper"] for r in reversed(records) if isinstance(r.get("paper"), dict)), None)
