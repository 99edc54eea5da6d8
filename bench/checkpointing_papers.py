"""The largest micro-batch with and without activation checkpointing, for every paper recipe on its own device.

    PYTHONPATH=src python bench/checkpointing_papers.py            # every papers/*.yaml naming a catalogued GPU
    PYTHONPATH=src python bench/checkpointing_papers.py nanogpt    # recipes whose file name starts with one of these

The estimate meter on the paper's own device (`batch.device` looked up in the GPU catalog; `--headroom 0`; with
`batch.sharding: fsdp`, sharded over the paper's number of devices), each probe capped at the batch per process
(">= N (cap)"); no cache. Prints a Markdown table; recipes whose device is not a catalogued GPU are listed as such.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from reproduce.errors import UserError
from reproduce.hardware.catalog import lookup
from reproduce.plan.overlay import Change, overlay
from reproduce.plan.recipe import load_recipe
from reproduce.probe.runner import ProbeOptions, run_probe

PAPERS = Path(__file__).resolve().parent.parent / "papers"


def largest(recipe, device: str, world_size: int) -> tuple[str, float]:
    options = ProbeOptions(gpu=device, meter="estimate", headroom=0.0, use_cache=False)
    started = time.perf_counter()
    try:
        result = run_probe(recipe, options=options, world_size=world_size)
    except UserError as error:
        return f"error: {error.lines[-1]}", time.perf_counter() - started
    found = result.micro_batch_max
    shown = "does not fit" if found is None else (f">= {found} (cap)" if result.capped else str(found))
    return shown, time.perf_counter() - started


def main(prefixes: list[str]) -> None:
    torch.set_num_threads(1)
    print("| recipe | device | world | without | with checkpointing | probe s |")
    print("|---|---|---:|---:|---:|---:|")
    for path in sorted(PAPERS.glob("*.yaml")):
        if prefixes and not path.stem.startswith(tuple(prefixes)):
            continue
        recipe = load_recipe(path)
        batch = recipe.batch
        if batch.device is None:
            continue
        try:
            gpu = lookup(batch.device)
        except UserError:
            print(f"| {path.stem} | {batch.device} | | | | | (not a catalogued GPU)", flush=True)
            continue
        world = batch.devices if batch.sharding == "fsdp" and batch.devices else 1
        without, first = largest(recipe, gpu.name, world)
        checkpointing = overlay(recipe, [Change("model.activation_checkpointing", True)], str(path))
        checkpointed, second = largest(checkpointing, gpu.name, world)
        print(f"| {path.stem} | {gpu.name} | {world} | {without} | {checkpointed} | {first + second:.0f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
