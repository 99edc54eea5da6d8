"""The papers against the estimate: does the `estimate` meter accept each paper's per-device batch on its device?

    python bench/papers_estimate.py                    # every recipe in papers/ (about 10 minutes on 2 cores)
    python bench/papers_estimate.py --only nanogpt     # recipes whose file name contains a word
    python bench/papers_estimate.py --json out.json

Every shipped recipe that states its device (`batch.device`) and its per-device batch (`batch.per_device`)
is evidence: that batch fitted there. For each, the estimate meter plans for the paper's own device
(`--gpu DEVICE --headroom 0`, the same sharding over the paper's number of devices when the recipe says
`batch.sharding: fsdp`, one process otherwise) and its largest micro-batch must be at least the paper's.
Prints the Markdown table of the README (paper, device, per-device batch, the estimate's maximum, the ratio,
seconds) and exits 1 when a row that states both does not accept its batch. A TPU is not a GPU the
estimate can model: such rows say so instead of a number. Rows without a stated device get none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from reproduce.errors import UserError  # noqa: E402
from reproduce.probe.catalog import lookup  # noqa: E402
from reproduce.probe.runner import ProbeOptions, run_probe  # noqa: E402
from reproduce.recipe import load_recipe  # noqa: E402


def row(path: Path) -> dict:
    recipe = load_recipe(path)
    batch = recipe.batch
    title = recipe.paper.title if recipe.paper else path.stem
    found = {"recipe": path.name, "paper": title, "device": batch.device, "per_device": batch.per_device,
             "sharding": batch.sharding, "devices": batch.devices, "max": None, "ratio": None, "seconds": None,
             "note": ""}
    if recipe.data.available:
        found["note"] = "runs on this machine (not a paper's hardware)"
        return found
    if batch.device is None:
        found["note"] = "device not stated in the paper"
        return found
    try:
        lookup(batch.device)
    except UserError as error:
        found["note"] = "TPU: not modelled (the estimate models CUDA GPUs)" if "TPU" in error.lines[0] else (
            error.lines[0])
        return found
    world = batch.devices if batch.sharding == "fsdp" and batch.devices else 1
    options = ProbeOptions(gpu=batch.device, meter="estimate", headroom=0.0, use_cache=False, time_steps=False)
    started = time.perf_counter()
    try:
        result = run_probe(recipe, str(path), options, world_size=world)
    except UserError as error:
        found["note"] = f"not probed: {error.lines[-1]}"
        return found
    found["seconds"] = round(time.perf_counter() - started, 1)
    found["max"] = result.micro_batch_max
    found["capped"] = result.capped
    found["trials"] = len(result.trials)
    if result.micro_batch_max is None:
        found["note"] = "not even micro-batch 1 fits"
    elif batch.per_device:
        found["ratio"] = round(result.micro_batch_max / batch.per_device, 2)
    if result.capped:
        found["note"] = f"capped at the batch per process ({result.cap})"
    if world > 1:
        found["note"] = (found["note"] + "; " if found["note"] else "") + f"fsdp over {world} devices"
    return found


def markdown(rows: list[dict]) -> str:
    lines = ["| paper (recipe) | device | per-device batch | estimate's max | ratio | s | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        maximum = "-" if r["max"] is None else (f">= {r['max']}" if r.get("capped") else str(r["max"]))
        lines.append(
            f"| {r['paper']} (`{r['recipe']}`) | {r['device'] or '-'} | {r['per_device'] or '-'} | {maximum} | "
            f"{r['ratio'] if r['ratio'] is not None else '-'} | {r['seconds'] or '-'} | {r['note']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--papers", type=Path, default=ROOT / "papers", help="folder of recipes")
    parser.add_argument("--only", nargs="*", default=None, help="recipes whose file name contains one of these")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)  # timings that repeat on a shared machine
    paths = sorted(args.papers.glob("*.yaml"))
    if args.only:
        paths = [p for p in paths if any(word in p.name for word in args.only)]
    rows = []
    started = time.perf_counter()
    for path in paths:
        rows.append(row(path))
        print(f"{path.name}: {rows[-1]['max']} ({rows[-1]['note'] or 'ok'})", file=sys.stderr, flush=True)
    print(markdown(rows))
    print(f"\n{len(rows)} recipes in {time.perf_counter() - started:.0f} s (torch {torch.__version__}, one thread)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    refused = [r for r in rows if r["device"] and r["per_device"] and r["ratio"] is not None and r["ratio"] < 1]
    refused += [r for r in rows if r["device"] and r["per_device"] and r["max"] is None and r["seconds"]]
    if refused:
        print("the estimate refuses a batch a paper ran: " + ", ".join(r["recipe"] for r in refused), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
