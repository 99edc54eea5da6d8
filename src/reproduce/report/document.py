"""The report as one self-contained HTML file (plots as data: URIs, no script) and its Markdown twin (the plots
as PNG files beside it): one list of blocks, rendered by each format."""

from __future__ import annotations

import base64
import datetime
import html
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..plan.segments import batch_phases
from ..plan.split import split_text
from .figures import figures, matplotlib_missing
from .runs import RunFolder, Verdict, eval_metrics, verdicts


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    css: str = ""  # the HTML table's class
    row_css: list[str] | None = None  # each row's class (the verdict's pass / fail)


Block = tuple[str, object]  # ("h2", text), ("p", text), ("table", Table), ("figure", Figure)


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plan_table(run: RunFolder) -> Table:
    """The paper's recipe against this plan, quantity by quantity."""
    plan, recipe = run.plan, run.plan.recipe
    batch, schedule = recipe.batch, recipe.schedule
    paper_batch = f"{plan.paper_effective_batch:,} {plan.unit}"
    if batch.devices and batch.per_device:
        paper_batch += f" = {batch.devices} devices x {batch.per_device}" + (
            f" x {batch.accumulation} accumulation" if batch.accumulation else "")
    warmup = schedule.warmup
    paper_warmup = "none" if warmup is None else (
        f"{warmup.ratio:g} of the run" if warmup.ratio is not None else warmup.label())
    decay = schedule.decay
    paper_decay = decay.kind + (f" at {list(decay.milestones.value)} {decay.milestones.unit}, x{decay.factor:g}"
                                if decay.milestones else "")
    steps = plan.schedule
    plan_decay = steps.decay_kind + (f" at steps {steps.decay_milestones}, x{steps.decay_factor:g}"
                                     if steps.decay_milestones else "") + f", to lr {steps.min_lr:.4g}"
    rows = [
        ["effective batch", paper_batch, f"{plan.arithmetic} {'' if plan.effective_tokens else plan.unit}".strip()
         + ("" if plan.exact else f" (not the paper's {plan.paper_effective_batch:,})")],
        ["learning rate", f"{plan.recipe.optimizer.lr:.6g} ({recipe.optimizer.name})",
         f"{plan.lr:.6g}: rule {plan.lr_scaling.rule} ({plan.lr_scaling.source})"],
        ["warm-up", paper_warmup, f"{plan.warmup_steps} optimizer steps from lr {plan.schedule.warmup_start_lr:.4g}"],
        ["decay", paper_decay, plan_decay],
        ["length", schedule.total.label(),
         f"{_number(plan.optimizer_steps)} optimizer steps ({_number(plan.steps_per_epoch)} per epoch of "
         f"{_number(plan.dataset_size)} {plan.unit})"],
        ["exact", "-", "yes: the paper's batch, every step" if plan.exact else "no: see the learning-rate rule"],
    ]
    shown = 12  # a batch ramp can have many segments
    phases = batch_phases(plan.segments)
    for index, phase in enumerate(phases[:shown]):
        end = f"{phase.start_step + phase.steps}" if phase.steps is not None else "end"
        length = f", sequence length {phase.sequence_length}" if phase.sequence_length else ""
        split = split_text(phase.micro_batch, phase.accumulation_steps, plan.world_size, f"{phase.effective_batch:,}")
        rows.append([f"batch {phase.kind} {index + 1}", _number(phase.paper_effective_batch),
                     f"steps {phase.start_step + 1}-{end}: {split}{length}"])
    if len(phases) > shown:
        rows.append(["...", "", f"{len(phases) - shown} more segments (plan.yaml has them all)"])
    return Table(["", "paper", f"this plan ({run.name})"], rows, css="plan")


def runs_table(runs: list[RunFolder]) -> Table:
    evals = eval_metrics(runs)
    rows = []
    for run in runs:
        final = [run.final(key) for key in ["loss", *evals]]
        seconds = run.summary.get("seconds") if run.summary else None
        steps = f"{_number(run.last_step)} / {_number(run.plan.optimizer_steps)}"
        rows.append([run.name, str(run.path), run.status, steps,
                     *[_number(value[1]) if value else "-" for value in final], _number(seconds)])
    return Table(["run", "folder", "status", "steps", "final loss", *[f"final {k}" for k in evals], "seconds"], rows,
                 css="runs")


def verdict_table(found: list[Verdict]) -> Table:
    rows, css = [], []
    for v in found:
        split = f" ({v.split})" if v.split else ""
        value = "-" if v.value is None else f"{v.value:.4g} ({v.field}, step {v.step})"
        tolerance = "-" if v.tolerance is None else f"+- {v.tolerance:g}"
        rows.append([v.run, v.metric + split, f"{v.reported:g}", tolerance, value, v.verdict, v.note])
        css.append({True: "pass", False: "fail"}.get(v.passed, "none"))
    return Table(["run", "paper's metric", "paper", "tolerance", "this run", "verdict", "note"], rows, css="verdict",
                 row_css=css)


GATE_CSS = {"passed": "pass", "paused": "fail", "warned": "warn", "accepted": "warn", "not measured": "warn"}


def gates_table(runs: list[RunFolder]) -> Table | None:
    """Each gate the runs met: its step, metric, bound, the measured value and what it did; None without any."""
    rows, css = [], []
    for run in runs:
        for event in (event for event in run.events if event.get("event") == "gate"):  # (train/gates.py)
            value = "not measured" if event.get("value") is None else f"{event['value']:.5g}"
            rows.append([run.name, event["name"], str(event["step"]), event["metric"], event["bound"], value,
                         event["status"], event.get("source") or "-"])
            css.append(GATE_CSS.get(event["status"], "none"))
    if not rows:
        return None
    return Table(["run", "gate", "step", "metric", "bound", "measured", "status", "source"], rows, css="verdict",
                 row_css=css)


def cost_line(run: RunFolder) -> str:
    """The GPU-hours the run has spent (its steps' wall time x its processes), against the recipe's budget."""
    seconds = sum(float(r.get("seconds", 0.0)) for r in run.records)
    spent = seconds * run.plan.world_size / 3600
    budget = run.plan.recipe.budget
    hours = budget.gpu_hours if budget is not None else None
    against = f" of the budget's {hours:g} ({spent / hours:.1%})" if hours else " (the recipe sets no budget)"
    return (f"{run.name}: {spent:.4g} GPU-hours spent over {run.last_step} optimizer steps (the steps' wall time x "
            f"{run.plan.world_size} process{'es' if run.plan.world_size > 1 else ''}){against}.")


def class_iou_table(runs: list[RunFolder]) -> Table | None:
    """Segmentation: each class's IoU at each run's last evaluation, or None when no run records it."""
    last = {}
    for run in runs:
        found = next((r for r in reversed(run.records) if isinstance(r.get("eval_class_iou"), list)), None)
        if found is not None:
            last[run.name] = found
    if not last:
        return None
    classes = max(len(record["eval_class_iou"]) for record in last.values())
    rows = [[str(index), *["-" if index >= len(r["eval_class_iou"]) else
                           "n/a" if r["eval_class_iou"][index] is None else f"{r['eval_class_iou'][index]:.4f}"
                           for r in last.values()]] for index in range(classes)]
    rows.append(["mIoU", *[f"{r['eval_miou']:.4f}" for r in last.values()]])
    return Table(["class", *[f"{name} (step {r['step']})" for name, r in last.items()]], rows, css="runs")


def blocks(runs: list[RunFolder], plots: bool = True) -> list[Block]:
    out: list[Block] = [("h1", "reproduce report: " + ", ".join(run.name for run in runs)),
                        ("p", f"Made by reproduce {__version__} on "
                              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from "
                              f"{len(runs)} run folder{'s' if len(runs) > 1 else ''}.")]
    out += [("h2", "Runs"), ("table", runs_table(runs))]
    per_class = class_iou_table(runs)
    if per_class is not None:  # one confusion matrix over the split, as MMSegmentation reports it
        out += [("h2", "IoU per class (last evaluation)"),
                ("p", "One confusion matrix over the whole evaluation split (MMSegmentation's definition); n/a: a "
                      "class in neither the predictions nor the targets, left out of the mean."),
                ("table", per_class)]
    found = [v for run in runs for v in verdicts(run)]
    out.append(("h2", "The paper's reported result"))
    if found:
        out.append(("table", verdict_table(found)))
    else:
        out.append(("p", "The recipe reports no metric to compare with (its `reported:` list is empty)."))
    gates = gates_table(runs)
    if gates is not None or any(run.plan.recipe.gates or run.plan.recipe.budget for run in runs):
        out += [("h2", "Gates and cost"),
                ("p", "Each gate the run met (the recipe's gates:, its budget's cost gate, a reference run's band): "
                      "passed, warned, accepted (a miss the run was told to go past) or paused; marked on the loss "
                      "curve at its step.")]
        if gates is not None:
            out.append(("table", gates))
        out += [("p", cost_line(run)) for run in runs]
    out.append(("h2", "Curves"))
    missing = matplotlib_missing() if plots else "plots left out (--no-plots)"
    if missing:
        out.append(("p", missing))
    else:
        out += [("figure", figure) for figure in figures(runs)]
    for run in runs:
        out += [("h2", f"Plan: {run.name}"), ("p", _paper(run)), ("table", plan_table(run))]
        noise = (run.summary or {}).get("noise_scale")
        if noise and noise.get("sentence"):
            out.append(("p", f"Gradient noise scale: {noise['sentence']}"))
        for event in (e for e in run.events if e.get("event") != "gate"):  # (gates: their own table)
            out.append(("p", f"Event at step {event.get('step')}: {event.get('event')} "
                             + ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("event", "step"))))
    return out


def _paper(run: RunFolder) -> str:
    paper = run.plan.recipe.paper
    recipe = run.plan.recipe_path or "the plan's recipe"
    if paper is None:
        return f"Recipe {recipe}."
    return f"{paper.title}" + (f" ({paper.year})" if paper.year else "") + f"; recipe {recipe}."


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 72em;
       color: #222; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
tr.pass td { background: #e6f4ea; } tr.fail td { background: #fce8e6; } tr.warn td { background: #fef7e0; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; }
"""


def to_html(content: list[Block]) -> str:
    e = html.escape
    title = next(text for kind, text in content if kind == "h1")
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(title)}</title>",
             f"<style>{CSS}</style>", "</head>", "<body>"]
    for kind, item in content:
        if kind in ("h1", "h2", "p"):
            parts.append(f"<{kind}>{e(item)}</{kind}>")
        elif kind == "table":
            parts.append(f'<table class="{e(item.css)}">')
            parts.append("<tr>" + "".join(f"<th>{e(cell)}</th>" for cell in item.header) + "</tr>")
            for index, row in enumerate(item.rows):
                css = f' class="{e(item.row_css[index])}"' if item.row_css else ""
                parts.append(f"<tr{css}>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>")
            parts.append("</table>")
        elif kind == "figure":
            data = base64.b64encode(item.png).decode("ascii")
            parts.append(f'<figure id="{e(item.name)}"><img src="data:image/png;base64,{data}" alt="{e(item.title)}">'
                         f"<figcaption>{e(item.caption)}</figcaption></figure>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def counts(results: list) -> dict[str, int]:
    """How many of `check`'s results passed, failed and erred."""
    return {status: sum(r.status == status for r in results) for status in ("pass", "fail", "error")}


def tally(results: list) -> str:
    """`3 passed, 1 failed, 1 errors`: the suite's count, as every report of it opens (no errors: not said)."""
    c = counts(results)
    return f"{c['pass']} passed, {c['fail']} failed" + (f", {c['error']} errors" if c["error"] else "")


def markdown_cell(text: str) -> str:
    """`text` as one cell of a Markdown table row (`check --summary` writes its rows with it too)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(content: list[Block], images: Path, relative_to: Path) -> tuple[str, dict[Path, bytes]]:
    """The Markdown text and the PNG files it links to (written by the caller into `images`)."""
    lines, files = [], {}
    for kind, item in content:
        if kind == "h1":
            lines += [f"# {item}", ""]
        elif kind == "h2":
            lines += [f"## {item}", ""]
        elif kind == "p":
            lines += [str(item), ""]
        elif kind == "table":
            lines.append("| " + " | ".join(markdown_cell(c) for c in item.header) + " |")
            lines.append("|" + "---|" * len(item.header))
            lines += ["| " + " | ".join(markdown_cell(c) for c in row) + " |" for row in item.rows]
            lines.append("")
        elif kind == "figure":
            path = images / f"{item.name}.png"
            files[path] = item.png
            link = path.relative_to(relative_to).as_posix() if path.is_relative_to(relative_to) else path.as_posix()
            lines += [f"![{item.title}]({link})", "", f"*{item.caption}*", ""]
    return "\n".join(lines), files
