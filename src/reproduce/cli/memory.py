"""`reproduce memory RECIPE --micro-batch N`: the step's memory at one micro-batch, by part, with its peak."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..plan.overlay import changes_of
from ..plan.units import format_size
from ..session import recipe_for_plan
from . import options
from .app import app
from .common import print_lines, recipe_argument

METER_HELP = ("estimate: fake tensors with the GPU's kernels (a GPU you do not have; the default without a GPU "
              "here); cpu: a real step on this CPU, its tensors counted; cuda: a real step on this GPU.")
SEQUENCE_HELP = "Tokens a sequence, instead of the recipe's batch.sequence_length (synthetic tokens)."


@app.command("memory")
def memory_command(
    context: typer.Context,
    recipe_path: Path = typer.Argument(
        ..., metavar="RECIPE", help="The paper's recipe: a file, or a shipped recipe's name (digits-mlp)."
    ),
    micro_batch: int = typer.Option(..., "--micro-batch", min=1, help="Samples (sequences) a micro-batch."),
    gpu: options.GpuOption = None,
    memory: options.MemoryOption = None,
    meter: options.MeterName = typer.Option(options.MeterName.auto, "--meter", help=METER_HELP),
    sequence_length: int | None = typer.Option(None, "--sequence-length", metavar="L", help=SEQUENCE_HELP),
    headroom: options.HeadroomOption = 0.1,
    as_json: bool = typer.Option(False, "--json", help="Print the answer as one JSON object."),
    weights: options.WeightsOption = None,
    activation_checkpointing: options.CheckpointingOption = False,
    quantize: options.QuantizeOption = None,
    overrides: options.SetOption = None,
) -> None:
    """How much memory one training step needs at micro-batch N: weights, gradients, optimizer state, activations,
    logits and loss, the optimizer step's temporaries; where the peak is; allocated, reserved and driver-level."""
    given = str(recipe_path)  # as the user named it (a shipped recipe's name, or a file)
    recipe_path = recipe_argument(recipe_path)
    recipe = recipe_for_plan(recipe_path, [*changes_of(overrides or []), *options.alias_changes(context)])
    probing = options.probe_options(memory, gpu, meter, headroom, True)
    from ..probe.answer import memory_at  # torch: only when the command runs (`reproduce --help` imports none)

    answer = memory_at(recipe, micro_batch, probing, given, sequence_length)
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    print_lines(render(answer))


def render(answer: dict) -> list[str]:
    from ..probe.advice import peak_line
    from ..probe.gpu_like import UNSEEN_ACTIVATIONS
    from ..probe.tracker import ALLOWANCE

    size = format_size
    micro = answer["micro_batch"]
    tokens = f" x {answer['sequence_length']} tokens" if answer["sequence_length"] else ""
    window = "two micro-batches accumulated (the second's forward runs while the first's gradients are held)" if (
        answer["accumulates"]) else "one micro-batch, no accumulation (the whole batch per process)"
    lines = [
        f"memory {answer['recipe_path']}: micro-batch {micro}{tokens}; {answer['meter']} meter, {answer['device']}",
        f"step: {window}; {answer['data']}",
        f"weights: {answer['weights_form']}",
        f"optimizer: {answer['optimizer']}",
        "what the step holds (the most of each):",
    ]
    for name, value in answer["held"].items():
        if value:
            note = "  (part of activations: the model's output and the loss computed from it)" if (
                name == "logits and loss") else (
                f"  ({UNSEEN_ACTIVATIONS:.0%} of activations: cuDNN's workspaces, the allocator's whole blocks, ...)"
                if name == ALLOWANCE else "")
            lines.append(f"  {name:<50} {size(value):>11}{note}")
    lines.append(f"peak: in {answer['peak_stage']}, {size(answer['tensor_bytes'])} of tensors: {peak_line(answer)}")
    figures = [("allocated (max_memory_allocated)", answer["allocated_bytes"])]
    if answer["reserved_bytes"] is not None:
        figures += [("reserved (max_memory_reserved)", answer["reserved_bytes"]),
                    ("driver (nvidia-smi; reserved + context + outside)", answer["driver_bytes"])]
    lines.extend(f"  {name:<50} {size(value):>11}" for name, value in figures)
    lines.extend(f"    with {name}: {size(value)}" for name, value in answer["allowances"].items())
    lines.append(f"measured: {answer['measured']}")
    if answer["fits"] is not None:
        lines.append(f"{'fits' if answer['fits'] else 'does not fit'}: limit {size(answer['limit_bytes'])} of "
                     f"{size(answer['budget_bytes'])} (budget less headroom)")
    lines.extend(f"note: {note}" for note in answer["notes"])
    return lines
