"""`reproduce report --history FILE`: the values `reproduce check --history` kept, rerun after rerun, as a table and
one plot a check beside the paper's value, so a metric that drifts shows before a check fails."""

from __future__ import annotations

from pathlib import Path

from .document import Block, Table
from .figures import Figure, finished_png, matplotlib_missing


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
