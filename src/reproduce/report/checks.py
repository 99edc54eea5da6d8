"""`reproduce check --junit FILE.xml` also writes FILE.html: the checks' results, their comparison plots, and the
curves of the runs they trained (one section per check file, its runs and seeds overlaid), in one page."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..plan.planfile import check_writable, write_text_atomic
from .document import Block, Table, to_html
from .figures import Figure, figures, matplotlib_missing
from .runs import load_run


def check_blocks(results: list, seconds: float, work: Path) -> list[Block]:
    """`results`: check.runner.Result items; `work`: the folder the runs were trained in (work/FILE/RUN/seed-N)."""
    count = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error")}
    head = f"{count['pass']} passed, {count['fail']} failed" + (f", {count['error']} errors" if count["error"] else "")
    rows = [[r.status, r.file, r.name, r.measured, r.expected, f"{r.seconds:.1f}", "; ".join(r.details)]
            for r in results]
    content: list[Block] = [
        ("h1", f"reproduce check: {head} in {seconds:.0f} s"),
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
