"""Benchmark: `reproduce`'s micro-batch search against the peers' searches, on the same meter and budgets.

    python bench/probe_bench.py            # all workloads, about 3-5 minutes on 2 CPU cores
    python bench/probe_bench.py --only mlp

Every strategy runs real trials through the same meter: `CpuMeter` (the recipe's real model, AdamW or
SGD, a warm-up step and a measured step on real data, tensors counted by the tracker and the budget
enforced as `torch.OutOfMemoryError`). Every strategy sees the same verdict for a size: it fails when its
step runs out of memory or peaks over the limit (budget less 10% headroom). The peers only see pass or
fail; ours also sees the measured peak. Re-implemented faithfully, each from its source:

- Lightning `BatchSizeFinder`, mode "power": `lightning/pytorch/tuner/batch_size_scaling.py`,
  `_run_power_scaling` (Lightning-AI/pytorch-lightning @ 0cd4522): start at `init_val=2`, double after
  each success, halve after the first failure and stop; `max_trials=25`. It returns the size it would try
  next, so when it stops on `max_trials` or the size limit it may return a size it never measured.
- Lightning `BatchSizeFinder`, mode "binsearch": `_run_binary_scaling` (same file): double until a
  failure, then bisect between the last success and the failure; then, since Lightning PR #21163
  (`margin=0.05`, "reduce the found batch size to int(found_batch_size * (1 - margin))"), the found size
  is cut by 5%. Both modes stop growing at `max_val` (PR #21163; here the per-rank batch, the cap of
  every strategy). `_adjust_batch_size`'s dataset-length check is left out: trials here cycle through
  the data, so every size is a full batch (with it, binsearch retries a size past the dataset forever).
- Accelerate `find_executable_batch_size` (`accelerate/utils/memory.py`): start at
  `starting_batch_size=128`, multiply by 0.9 after each out-of-memory error (PR #3684, v1.9.0; it halved
  before), return the first size that runs. It only goes down.
- Exhaustive: every size from 1 up to the first that fails (the ground truth: peaks grow with the size).
- reproduce: `reproduce.probe.search.search` (safe jump, fitted line, confirmed bracket).

Threads: torch runs on one thread here so that a shared, loaded 2-core machine gives repeatable times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from reproduce.plan.recipe import parse_recipe  # noqa: E402
from reproduce.probe.meters import CpuMeter  # noqa: E402
from reproduce.probe.search import search  # noqa: E402
from reproduce.probe.workload import Workload  # noqa: E402

MiB = 2**20
HEADROOM = 0.1
CAP = 4096  # the per-rank batch: large, so that it does not decide any case here
_CLASSIFY = {"task": "classification", "data": {"builtin": "digits"}, "schedule": {"total": {"steps": 100}}}
WORKLOADS = {
    "mlp": (
        {**_CLASSIFY, "batch": {"effective": CAP, "unit": "samples"},
         "model": {"builtin": "mlp", "kwargs": {"hidden": 128}}, "optimizer": {"name": "adamw", "lr": 1e-3}},
        (1 * MiB, 2 * MiB, 3 * MiB),
    ),
    "cnn": (
        {**_CLASSIFY, "batch": {"effective": CAP, "unit": "samples"},
         "model": {"builtin": "cnn-gn", "kwargs": {"channels": 32}},
         "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        (4 * MiB, 8 * MiB, 16 * MiB),
    ),
    "gpt": (
        {"task": "language-modeling", "batch": {"effective": CAP * 64, "unit": "tokens", "sequence_length": 64},
         "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 4, "dim": 128}},
         "data": {"builtin": "pysource", "kwargs": {"max_bytes": 300_000}},
         "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "no_decay": ["1d"]},
         "schedule": {"total": {"steps": 100}}, "clip_grad_norm": 1.0},
        (32 * MiB, 64 * MiB, 96 * MiB),
    ),
}


class Counted:
    """fits(b) -> bool for the peers, counting trials and remembering which sizes were measured."""

    def __init__(self, meter: CpuMeter):
        self.meter, self.sizes = meter, []

    def __call__(self, size: int) -> bool:
        self.sizes.append(size)
        return self.meter.measure(size).fits


def _adjust(size: int, new: int, max_val: int) -> tuple[int, bool]:
    """`_adjust_batch_size`: the new size (at most max_val, PR #21163) and whether it changed."""
    new = min(new, max_val)
    return new, new != size


def lightning_power(fits: Callable[[int], bool], max_val: int, init_val: int = 2, max_trials: int = 25) -> int:
    def adjust(size: int, new: int) -> tuple[int, bool]:
        return _adjust(size, new, max_val)

    new_size, any_success = init_val, False
    for _ in range(max_trials):
        if fits(new_size):
            new_size, changed = adjust(new_size, int(new_size * 2.0))
            if not changed:
                break
            any_success = True
        else:
            new_size, _ = adjust(new_size, int(new_size * 0.5))
            if any_success:
                break
    return new_size


def lightning_binsearch(fits: Callable[[int], bool], max_val: int, init_val: int = 2, max_trials: int = 25,
                        margin: float = 0.05) -> int:
    def adjust(size: int, new: int) -> tuple[int, bool]:
        return _adjust(size, new, max_val)

    low, high, count, new_size = 1, None, 0, init_val
    while True:
        if fits(new_size):
            count += 1
            if count > max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size, changed = adjust(new_size, (high + low) // 2)
            else:
                new_size, changed = adjust(new_size, int(new_size * 2.0))
            if not changed:
                break
        else:
            high = new_size
            new_size, _ = adjust(new_size, (high + low) // 2)
            if high - low <= 1:
                break
    return int(new_size * (1 - margin))


def accelerate_find_executable(fits: Callable[[int], bool], starting_batch_size: int = 128) -> int | None:
    batch_size = starting_batch_size
    while True:
        if batch_size == 0:
            return None  # "No executable batch size found, reached zero."
        if fits(batch_size):
            return batch_size
        batch_size = int(batch_size * 0.9)


def exhaustive(fits: Callable[[int], bool], cap: int) -> int:
    size = 0
    while size < cap and fits(size + 1):
        size += 1
    return size


def run_case(meter: CpuMeter) -> list[dict]:
    rows = []
    strategies = {
        "exhaustive (truth)": lambda f: exhaustive(f, CAP),
        "reproduce": None,
        "Lightning power": lambda f: lightning_power(f, CAP),
        "Lightning binsearch": lambda f: lightning_binsearch(f, CAP),
        "Accelerate": accelerate_find_executable,
    }
    for name, strategy in strategies.items():
        started = time.perf_counter()
        if strategy is None:
            result = search(meter.measure, meter.limit_bytes, CAP)
            found, sizes = result.micro_batch_max, [t.micro_batch for t in result.trials]
        else:
            counted = Counted(meter)
            found, sizes = strategy(counted), counted.sizes
        rows.append({"strategy": name, "found": found, "trials": len(sizes), "sizes": sizes,
                     "seconds": time.perf_counter() - started})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(WORKLOADS), action="append", help="Run only these workloads.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; cpu meter, headroom {HEADROOM:.0%}, cap {CAP}\n")
    print("| workload | budget | strategy | trials | wall s | found | true max | distance |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    summary: dict[str, list[dict]] = {}
    total = time.perf_counter()
    for name in args.only or list(WORKLOADS):
        recipe_data, budgets = WORKLOADS[name]
        workload = Workload(parse_recipe(recipe_data, source=name)).prepare()
        for budget in budgets:
            meter = CpuMeter(workload, budget, HEADROOM, time_steps=False)
            rows = run_case(meter)
            truth = rows[0]["found"]
            for row in rows:
                found = row["found"]
                if found is None:
                    distance = "none found"
                else:
                    distance = f"{found - truth:+d}" if found != truth else "0"
                    if found > truth:
                        distance += " (does not fit)"
                    elif found not in row["sizes"]:
                        distance += " (never measured)"
                row["distance"] = found - truth if found is not None else None
                summary.setdefault(row["strategy"], []).append(row)
                print(f"| {name} | {budget // MiB} MiB | {row['strategy']} | {row['trials']} | "
                      f"{row['seconds']:.2f} | {found} | {truth} | {distance} |", flush=True)
    print("\n| strategy | median trials | max trials | total wall s | exact | mean abs. distance |")
    print("|---|---:|---:|---:|---:|---:|")
    for strategy, rows in summary.items():
        exact = sum(r["distance"] == 0 for r in rows)
        distances = [abs(r["distance"]) for r in rows if r["distance"] is not None]
        print(f"| {strategy} | {statistics.median(r['trials'] for r in rows):g} | {max(r['trials'] for r in rows)} | "
              f"{sum(r['seconds'] for r in rows):.1f} | {exact}/{len(rows)} | "
              f"{statistics.mean(distances) if distances else float('nan'):.1f} |")
    print(f"\nbenchmark wall time: {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
    main()
