"""The predicted time of every paper recipe on its own hardware, beside the time its paper or repository reports.

    python bench/predicted_times.py [--mfu 0.4] [recipes ...]

For each papers/*.yaml whose `batch.device` is a GPU of the catalog: the model FLOPs of one sample counted on
fake tensors (probe/flops.py) x the samples of the whole schedule, over `batch.devices` x the card's dense peak
for the recipe's precision x the assumed MFU (reproduce/throughput/predicted_time.py). A recipe that does not state its
device count gets GPU-hours (one device) instead. The reported figures are quoted with their source in `REPORTED`;
the ratio is predicted / reported (above 1: the prediction is slower than the paper was, i.e. the paper ran
at a higher MFU than assumed).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from reproduce.errors import UserError
from reproduce.hardware.catalog import lookup
from reproduce.hardware.peaks import on_card, peaks_of, precision_key
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.probe.flops import recipe_flops
from reproduce.throughput.cost import format_duration
from reproduce.throughput.predicted_time import DEFAULT_MFU, predicted_seconds, total_samples

# (seconds, or GPU-hours for a recipe without a device count; what was said; where)
REPORTED = {
    "goyal2017-resnet50": (3600, "1 hour on 256 x P100", "Goyal et al. 2017, title and sec. 5"),
    "llmc-gpt2-124m": (90 * 60, "90 minutes on 8 x A100 80GB", "llm.c discussion #481 (Karpathy 2024)"),
    "nanogpt-gpt2-124m": (4 * 86400, "about 4 days on 8 x A100 40GB", "nanoGPT README"),
    "nanogpt-shakespeare-char": (3 * 60, "about 3 minutes on 1 A100", "nanoGPT README"),
    "touvron2023-llama-7b": (82432 * 3600, "82,432 GPU-hours (A100-80GB)", "Touvron et al. 2023, Table 15"),
    "taori2023-alpaca-7b": (3 * 3600, "3 hours on 8 x A100 80GB (the recipe: 4)", "Stanford Alpaca blog post"),
}

# total training compute the paper states, in PF-days (1e15 FLOP/s for a day), beside the FLOPs counted here
REPORTED_COMPUTE = {"brown2020-gpt3-small": (2.60, "Brown et al. 2020, Table D.1")}
PF_DAY = 1e15 * 86400


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes", nargs="*")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = sorted(Path("papers").glob("*.yaml"))
    if args.recipes:
        paths = [p for p in paths if any(name in p.stem for name in args.recipes)]
    print(f"| recipe | hardware | precision | FLOPs / sample | samples | PF-days | predicted (MFU {args.mfu:.0%}) "
          "| reported | ratio | count s |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    for path in paths:
        recipe = load_recipe(path)
        device, devices = recipe.batch.device, recipe.batch.devices
        if not device:
            continue
        try:
            gpu = lookup(device)
        except UserError as error:
            print(f"| {path.stem} | {devices or '?'} x {device} | | | | | - | {error.lines[-1][7:60]} | | |")
            continue
        plan = make_plan(recipe, recipe.batch.per_device or 1, devices or 1)
        if plan.optimizer_steps is None:
            print(f"| {path.stem} | {devices or '?'} x {gpu.name} | | | | | - | steps unknown | | |")
            continue
        started = time.perf_counter()
        flops = recipe_flops(recipe)
        counted = time.perf_counter() - started
        key = precision_key(recipe.precision, flops.convolution_share > 0.5)
        key = on_card(key, gpu.capability)  # no TF32 before Ampere
        peaks = peaks_of(gpu.name)
        peak = peaks.flops(key) if peaks else None
        samples = round(total_samples(plan))  # batch phases and ramps: each stretch's own batch
        seconds = predicted_seconds(1, samples * flops.per_sample, devices or 1, peak, args.mfu)
        reported = REPORTED.get(path.stem)
        if seconds is None:
            shown = "unknown peak"
        elif devices:
            shown = format_duration(seconds)
        else:
            shown = f"{seconds / 3600:,.0f} GPU-hours"
        ratio = f"{seconds / reported[0]:.2f}" if reported and seconds else ""
        said = f"{reported[1]} ({reported[2]})" if reported else ""
        compute = samples * flops.per_sample / PF_DAY
        if path.stem in REPORTED_COMPUTE:
            stated, where = REPORTED_COMPUTE[path.stem]
            said += f"{'; ' if said else ''}{stated:g} PF-days of compute ({where}): FLOPs ratio {compute / stated:.2f}"
        print(f"| {path.stem} | {devices or '?'} x {gpu.name} | {key} | {flops.per_sample:.3g} | {samples:,} "
              f"| {compute:.3g} | {shown} | {said} | {ratio} | {counted:.0f} |", flush=True)


if __name__ == "__main__":
    main()
