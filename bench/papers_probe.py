"""Plan and probe every shipped paper: with --gpu rtx4090, and with --gpu set to the paper's own device.

    python bench/papers_probe.py                         # every papers/*.yaml, estimate meter (minutes)
    python bench/papers_probe.py goyal2017 nanogpt       # recipes whose file name starts with one of these
    python bench/papers_probe.py --gpu a100-80gb --headroom 0
    python bench/papers_probe.py --paper-batches         # does the estimate accept each paper's own per-device batch?

Each row is what `reproduce plan papers/X.yaml --gpu NAME` does (the probe, then the plan), run in this process
through the same functions: the largest micro-batch the estimate meter finds, the plan made from it, and the
seconds the probe took; or the one-line error the command would print (exit code 2), or for "does not fit"
(exit code 3) the ways out its report finds. The paper's own device is
`batch.device` looked up in the GPU catalog; a device the catalog does not hold (a TPU, a GPU named without its
memory) is listed as such. The probe cache is not used (every figure is measured now). Prints a Markdown table.

`--paper-batches` checks the estimate against the papers instead: every recipe that states its device and its
per-device batch is evidence that this batch fitted there. The estimate meter plans for the paper's own device
(`--gpu DEVICE --headroom 0`; with `batch.sharding: fsdp`, sharded over the paper's number of devices, else one
process) and its largest micro-batch must be at least the paper's: the table gives both and their ratio, and
the script exits 1 when a paper's batch is refused. A TPU is not a GPU the estimate models: such rows say so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from reproduce.errors import DoesNotFit, UserError
from reproduce.hardware.catalog import lookup
from reproduce.models import build_model, count_parameters
from reproduce.plan.recipe import load_recipe
from reproduce.plan.units import format_count, format_size
from reproduce.probe.runner import ProbeOptions, run_probe
from reproduce.probe.workload import synthetic_data
from reproduce.session import plan_and_probe

PAPERS = Path(__file__).resolve().parent.parent / "papers"


def model_text(recipe) -> str:
    if recipe.model.builtin is None:
        return "-"
    info = synthetic_data(recipe).info if not recipe.data.available else None
    with torch.device("meta"):
        total, trainable = count_parameters(build_model(recipe, info))
    text = f"{recipe.model.builtin} {format_count(total)}"
    return text + (f" ({format_count(trainable)} trainable)" if trainable != total else "")


def probe_row(path: Path, recipe, gpu: str, headroom: float) -> list[str]:
    options = ProbeOptions(gpu=gpu, meter="estimate", headroom=headroom, use_cache=False)
    started = time.perf_counter()
    try:
        planned = plan_and_probe(recipe, str(path), None, 1, "exact", probe=options)
        plan, result = planned.plan, planned.probe
    except DoesNotFit as error:  # exit 3: what would fit, from its report
        fitting = [line.strip() for line in error.lines if line.strip().startswith("[fits]")]
        note = "does not fit (exit 3); " + ("; ".join(fitting) if fitting else "nothing tried fits")
        return [gpu, "-", "-", f"{time.perf_counter() - started:.0f}", note]
    except UserError as error:
        return [gpu, "-", "-", f"{time.perf_counter() - started:.0f}", f"error: {error.lines[-1]}"]
    peak = f"{result.micro_batch_max} ({format_size(result.peak_bytes)})"
    return [gpu, peak, plan.arithmetic, f"{time.perf_counter() - started:.0f}", ""]


def paper_batch_row(path: Path) -> dict:
    """The estimate's largest micro-batch on the paper's own device, beside the per-device batch the paper ran."""
    recipe = load_recipe(path)
    batch = recipe.batch
    row = {"recipe": path.stem, "device": batch.device or "-", "per_device": batch.per_device, "max": None,
           "ratio": None, "seconds": None, "note": ""}
    if batch.device is None:
        row["note"] = "the paper states no device" if not recipe.data.available else "runs on this machine"
        return row
    try:
        lookup(batch.device)
    except UserError as error:
        row["note"] = "a TPU: not modelled (the estimate models CUDA GPUs)" if "TPU" in error.lines[0] else (
            f"error: {error.lines[0]}")
        return row
    world = batch.devices if batch.sharding == "fsdp" and batch.devices else 1
    options = ProbeOptions(gpu=batch.device, meter="estimate", headroom=0.0, use_cache=False, time_steps=False)
    started = time.perf_counter()
    result = run_probe(recipe, str(path), options, world_size=world)
    row["seconds"] = round(time.perf_counter() - started)
    row["max"] = result.micro_batch_max
    notes = []
    if result.micro_batch_max is None:
        notes.append("not even micro-batch 1 fits")
    elif batch.per_device:
        row["ratio"] = round(result.micro_batch_max / batch.per_device, 2)
    if result.capped:
        notes.append(f"capped at the batch per process, {result.cap}")
    if world > 1:
        notes.append(f"fsdp over {world} devices")
    row["note"] = "; ".join(notes)
    row["capped"] = result.capped
    return row


def paper_batches(paths: list[Path]) -> int:
    print("| recipe | device | per-device batch (paper) | estimate's largest | ratio | probe s | note |")
    print("|---|---|---:|---:|---:|---:|---|")
    refused = []
    for path in paths:
        row = paper_batch_row(path)
        largest = "-" if row["max"] is None else (f">= {row['max']}" if row.get("capped") else str(row["max"]))
        cells = [row["recipe"], row["device"], row["per_device"] or "-", largest,
                 "-" if row["ratio"] is None else row["ratio"], row["seconds"] or "-", row["note"]]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        stated = row["device"] != "-" and row["per_device"] and row["seconds"] is not None
        if stated and (row["max"] is None or row["max"] < row["per_device"]):
            refused.append(row["recipe"])
    if refused:
        print(f"the estimate refuses a batch a paper ran: {', '.join(refused)}", file=sys.stderr)
    return 1 if refused else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help="file name prefixes (default: every recipe in papers/)")
    parser.add_argument("--gpu", default="rtx4090", help="the consumer card to plan for (default rtx4090)")
    parser.add_argument("--headroom", type=float, default=0.1, help="as reproduce probe --headroom (default 0.1)")
    parser.add_argument("--paper-batches", action="store_true",
                        help="the estimate on each paper's own device against the per-device batch it ran")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paths = [p for p in sorted(PAPERS.glob("*.yaml")) if not args.recipes or p.stem.startswith(tuple(args.recipes))]
    if args.paper_batches:
        return paper_batches(paths)
    print("| recipe | model | --gpu | largest micro-batch (peak) | plan | probe s | note |")
    print("|---|---|---|---|---|---:|---|")
    for path in paths:
        recipe = load_recipe(path)
        gpus = [args.gpu]
        own = recipe.batch.device
        if own:
            try:
                gpus.append(lookup(own).name)
            except UserError:
                print(f"| {path.stem} | | {own} | | | | not in the GPU catalog |")
        model = model_text(recipe)
        for gpu in dict.fromkeys(gpus):
            row = [path.stem, model, *probe_row(path, recipe, gpu, args.headroom)]
            print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
