"""How `reproduce plan` shows the throughput policy's decision and the predicted time (rendering only)."""

from __future__ import annotations

from rich.table import Table

from ..plan.launch import GPUS_PER_NODE, node_split
from ..plan.planner import Plan
from ..throughput.cost import format_duration
from .common import print_lines, stdout

FREE_BATCHNORM_HELP = (
    "With --policy throughput and a BatchNorm model: let the timings choose its micro-batch too (its statistics are "
    "then over another batch than the paper's per-device one)."
)
MFU_HELP = "The MFU assumed by the predicted time (default 0.40; see docs/throughput.md for its source)."


def render_throughput(p: Plan) -> None:
    decision = p.throughput
    if not decision:
        return
    unit = p.unit
    candidates = decision.candidates
    how = "a model: nothing timed" if decision.basis == "model" else f"measured on {decision.device or '-'}"
    title = f"--policy throughput ({how}): {len(candidates)} of {decision.exact_splits} exact splits"
    if candidates:
        table = Table(title=title, title_justify="left")
        tokens = any(c.tokens_per_second for c in candidates)
        measured = any(c.spread is not None for c in candidates)
        columns = ["micro x accum", "s / optimizer step", *(["spread", "repeats", "timing s"] if measured else []),
                   f"{unit}/s", *(["tokens/s"] if tokens else []), "% of best", "from", ""]
        for column in columns:
            table.add_column(column, justify="left" if column in ("micro x accum", "from", "") else "right")
        for c in candidates:
            table.add_row(
                f"{c.micro_batch} x {c.accumulation_steps}", f"{c.step_seconds:.3g}",
                *([f"{c.spread:.1%}", str(len(c.repeats or [])), f"{c.timing_seconds:.2f}"] if measured else []),
                f"{c.samples_per_second:,.1f}",
                *([f"{c.tokens_per_second:,.0f}" if c.tokens_per_second else "-"] if tokens else []),
                f"{c.share_of_best:.0%}", c.source, "chosen" if c.chosen else "",
            )
        stdout.print(table)
    else:
        stdout.print(title)
    print_lines(filter(None, [f"throughput: {decision.reason}", decision.cost_line()]))


def cluster_cost(hours: float | None, world_size: int = 0, gpus_per_node: int = GPUS_PER_NODE) -> str:
    """`; 12.4 GPU-hours (4 nodes x 8 GPUs)`: the whole run's GPUs x hours, and the nodes it fills."""
    if hours is None:
        return ""
    nodes, per_node = node_split(world_size, gpus_per_node) if world_size > 1 else (1, 1)
    where = f" ({nodes} node{'s' if nodes > 1 else ''} x {per_node} GPUs)" if world_size > 1 else ""
    return f"; {hours:.3g} GPU-hours{where}"


def render_prediction(prediction: dict, world_size: int = 1, gpus_per_node: int = GPUS_PER_NODE) -> None:
    def text(seconds: float | None) -> str:
        return format_duration(seconds) if seconds is not None else "unknown"

    lines = []
    if "flops_per_step" in prediction:
        per_step = prediction["flops_per_step"]
        lines.append(f"FLOPs: {prediction['flops_per_sample']:.4g} per sample, {per_step:.4g} per optimizer step "
                     "(model FLOPs, forward and backward)")
        if prediction["predicted_basis"]:
            lines.append(f"predicted time: {text(prediction['predicted_seconds'])} ({prediction['predicted_basis']})"
                         + cluster_cost(prediction["gpu_hours"], world_size, gpus_per_node))
        if prediction["paper_basis"]:
            lines.append(f"predicted time on the paper's hardware: {text(prediction['paper_predicted_seconds'])} "
                         f"({prediction['paper_basis']})" + cluster_cost(prediction["paper_gpu_hours"]))
        if "FLOPs model" in (prediction["predicted_basis"] or "") + (prediction["paper_basis"] or ""):
            lines.append(f"MFU: {prediction['mfu_source']}")
    print_lines([*lines, *(f"note: {note}" for note in prediction["notes"])])
