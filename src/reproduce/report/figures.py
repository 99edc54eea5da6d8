"""The report's curves, every run overlaid (PNG bytes, matplotlib: the `plots` extra). Runs of different effective
batches share an epoch axis, where they compare; runs of one batch share the optimizer step."""

from __future__ import annotations

import io
from dataclasses import dataclass

from .runs import RunFolder, eval_metrics

FIGURE_NAMES = ("loss", "lr", "grad_norm", "throughput", "noise_scale")  # and one eval_* per evaluation metric


@dataclass
class Figure:
    name: str  # a file name without extension: loss, eval_accuracy, lr, ...
    title: str
    caption: str
    png: bytes


GATE_COLORS = {"passed": "tab:green", "warned": "tab:orange", "accepted": "tab:orange", "paused": "tab:red"}


def matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no plots: matplotlib is not installed (pip install 'reproduce-large-batch[plots]')"
    return None


def finished_png(figure, ax) -> bytes:
    """The report's finish of one figure (grid, legend, tight layout) as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()


def x_axis(runs: list[RunFolder]) -> str:
    batches = {tuple(segment.effective_batch for segment in run.plan.segments) for run in runs}
    return "epoch" if len(batches) > 1 else "step"


def throughput(run: RunFolder) -> tuple[str, list[tuple[dict, float]]]:
    """Each step's samples (or tokens) per second: the trainer's own field, else the step's count over its seconds."""
    for key, unit in (("tokens_per_second", "tokens/s"), ("samples_per_second", "samples/s")):
        rows = [(r, float(r[key])) for r in run.records if isinstance(r.get(key), (int, float))]
        if rows:
            return unit, rows
    key, unit = ("tokens", "tokens/s") if any(r.get("tokens") for r in run.records) else ("samples", "samples/s")
    return unit, [(r, r[key] / r["seconds"]) for r in run.records if r.get("seconds") and key in r]


def figures(runs: list[RunFolder]) -> list[Figure]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = x_axis(runs)
    label = "epoch" if axis == "epoch" else "optimizer step"
    names = ", ".join(run.name for run in runs)
    made: list[Figure] = []

    def x(record: dict) -> float:
        return record["epoch"] if axis == "epoch" else record["step"]

    def draw(name: str, title: str, ylabel: str, lines, caption: str, log: bool = False, extra=None) -> None:
        """`lines`: (label, xs, ys, style, color) for each curve; nothing is drawn when there is no point at all."""
        lines = [line for line in lines if line[1]]
        if not lines:
            return
        figure, ax = plt.subplots(figsize=(8, 4.2))
        for text, xs, ys, style, color in lines:
            ax.plot(xs, ys, style, label=text, markersize=4, color=color)
        if extra:
            extra(ax)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        made.append(Figure(name, title, f"{caption} Runs: {names}.", finished_png(figure, ax)))

    def curve(run: RunFolder, key: str, text: str, style: str = "-"):
        rows = [r for r in run.records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return text, [x(r) for r in rows], [float(r[key]) for r in rows], style, color(run)

    def color(run: RunFolder) -> str:  # one colour per run in every figure
        return f"C{runs.index(run) % 10}"

    several = len(runs) > 1

    def named(run: RunFolder, what: str) -> str:
        return f"{run.name}: {what}" if several else what

    lines = []
    for run in runs:
        lines += [curve(run, "loss", named(run, "train loss")), curve(run, "eval_loss", named(run, "eval loss"), "o--")]

    draw("loss", "loss", "loss", lines, "Training loss of each optimizer step (the whole window's mean) and the "
         "evaluation loss; dashed lines: the gates (green passed, orange warned or accepted, red paused).",
         extra=lambda ax: _gate_lines(ax, runs, x, named))
    evals = [key for key in eval_metrics(runs) if key != "eval_loss"]
    for key in evals:
        draw(key, key.removeprefix("eval_").replace("_", " ") + " (evaluation)", key,
             [curve(run, key, run.name, "o-") for run in runs], f"{key} at each evaluation.")
    draw("lr", "learning rate", "learning rate", [curve(run, "lr", run.name) for run in runs],
         "The learning rate each optimizer step used (warm-up, then the decay, in steps of the plan).")
    draw("grad_norm", "gradient norm", "gradient norm (before clipping)",
         [curve(run, "grad_norm", run.name) for run in runs], "The norm of each optimizer step's whole-window "
         "gradient.", log=True)
    rates = []
    units = set()
    for run in runs:
        unit, rows = throughput(run)
        units.add(unit)
        rates.append((f"{run.name} ({unit})" if several else unit, [x(r) for r, _ in rows], [v for _, v in rows], "-",
                      color(run)))
    draw("throughput", "throughput", " or ".join(sorted(units)) or "per second", rates,
         "Samples (or tokens) per second of each optimizer step, data loading included.")

    draw("noise_scale", "gradient noise scale against the effective batch", f"noise scale ({runs[0].plan.unit})",
         [curve(run, "noise_scale", run.name) for run in runs], "The simple gradient noise scale B_simple "
         "(McCandlish et al. 2018), averaged over steps; a batch far above it buys few steps for its samples.",
         log=True, extra=lambda ax: _batch_lines(ax, runs, color, named))
    return made


def _gate_lines(ax, runs: list[RunFolder], x, named) -> None:
    """Each gate the runs met, at its step: green passed, orange warned or accepted, red paused."""
    for run in runs:
        by_step = {r["step"]: x(r) for r in run.records}
        for event in (e for e in run.events if e.get("event") == "gate" and e.get("step") in by_step):
            ax.axvline(by_step[event["step"]], linestyle="--", linewidth=1,
                       color=GATE_COLORS.get(event["status"], "grey"),
                       label=named(run, f"gate {event['name']}: {event['status']}"))


def _batch_lines(ax, runs: list[RunFolder], color, named) -> None:
    for run in runs:
        batch = run.plan.effective_batch
        ax.axhline(batch, linestyle=":", color=color(run), label=named(run, f"effective batch {batch}"))
