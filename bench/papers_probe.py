"""Plan and probe every shipped paper: with --gpu rtx4090, and with --gpu set to the paper's own device.

    python bench/papers_probe.py                         # every papers/*.yaml, estimate meter (minutes)
    python bench/papers_probe.py goyal2017 nanogpt       # recipes whose file name starts with one of these
    python bench/papers_probe.py --gpu a100-80gb --headroom 0

Each row is what `reproduce plan papers/X.yaml --gpu NAME` does (the probe, then the plan), run in this process
through the same functions: the largest micro-batch the estimate meter finds, the plan made from it, and the
seconds the probe took; or the one-line error the command would print (exit code 2). The paper's own device is
`batch.device` looked up in the GPU catalog; a device the catalog does not hold (a TPU, a GPU named without its
memory) is listed as such. The probe cache is not used (every figure is measured now). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from reproduce.cli.plan import Policy, plan_and_probe
from reproduce.errors import UserError
from reproduce.models import build_model, count_parameters
from reproduce.probe.catalog import lookup
from reproduce.probe.runner import ProbeOptions
from reproduce.probe.workload import synthetic_data
from reproduce.recipe import load_recipe
from reproduce.units import format_count, format_size

PAPERS = Path(__file__).resolve().parent.parent / "papers"


def model_text(recipe) -> str:
    if recipe.model.builtin is None:
        return "-"
    info = synthetic_data(recipe)["info"] if not recipe.data.available else None
    with torch.device("meta"):
        total, trainable = count_parameters(build_model(recipe, info))
    text = f"{recipe.model.builtin} {format_count(total)}"
    return text + (f" ({format_count(trainable)} trainable)" if trainable != total else "")


def probe_row(path: Path, recipe, gpu: str, headroom: float) -> list[str]:
    options = ProbeOptions(gpu=gpu, meter="estimate", headroom=headroom, use_cache=False)
    started = time.perf_counter()
    try:
        the_plan, result = plan_and_probe(recipe, str(path), None, 1, Policy.exact, probe=options, quiet=True)
    except UserError as error:
        return [gpu, "-", "-", f"{time.perf_counter() - started:.0f}", f"error: {error.lines[-1]}"]
    peak = f"{result.micro_batch_max} ({format_size(result.peak_bytes)})"
    return [gpu, peak, the_plan.arithmetic, f"{time.perf_counter() - started:.0f}", ""]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help="file name prefixes (default: every recipe in papers/)")
    parser.add_argument("--gpu", default="rtx4090", help="the consumer card to plan for (default rtx4090)")
    parser.add_argument("--headroom", type=float, default=0.1, help="as reproduce probe --headroom (default 0.1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paths = [p for p in sorted(PAPERS.glob("*.yaml")) if not args.recipes or p.stem.startswith(tuple(args.recipes))]
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
