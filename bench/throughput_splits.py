"""Every exact split of a recipe, timed, against the split `--policy throughput` chose.

    python bench/throughput_splits.py [--rounds 2] [--repeats 5] [cases ...]     # cases: gpt, mlp

For each case: the exact splits m x N = the recipe's batch (m <= the cap given below), each timed as the probe
and the policy time it (probe/timing.py: the recipe's real training step, a window of two micro-batches, the
median of `--repeats` steps), in `--rounds` interleaved rounds (every split once per round, so the machine's
load hits them alike; the median over rounds is kept). Then `--policy throughput` itself (throughput_plan.py,
no probe: it times the sizes its search picks) and where its choice stands: within 10% of the best measured
is the goal. One torch thread, as the other benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reproduce.probe.timing import time_micro_step
from reproduce.probe.workload import Workload
from reproduce.recipe import load_recipe
from reproduce.throughput import exact_splits
from reproduce.throughput_plan import throughput_plan

CASES = {"gpt": ("papers/pysource-gpt.yaml", 64), "mlp": ("papers/digits-mlp.yaml", 256)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.cases:
        path, cap = CASES[name]
        recipe = load_recipe(path)
        workload = Workload(recipe).prepare()
        per_rank = recipe.batch.sequences
        splits = exact_splits(per_rank, cap)
        seconds: dict[int, list[float]] = {m: [] for m in splits}
        started = time.perf_counter()
        for _ in range(args.rounds):
            for m in splits:
                seconds[m].append(time_micro_step(workload, torch.device("cpu"), m, cap, args.repeats)[0])
        exhaustive = time.perf_counter() - started
        rate = {m: m / statistics.median(values) for m, values in seconds.items()}
        best = max(rate, key=rate.get)
        started = time.perf_counter()
        chosen = throughput_plan(recipe, path, cap, 1, len(workload.data["train"]), None, data=workload.data)
        policy = time.perf_counter() - started
        decision = chosen.throughput
        timed = [c["micro_batch"] for c in decision["candidates"]]
        print(f"\n### {name}: {path}, batch {per_rank}, micro-batch <= {cap}; all {len(splits)} splits in "
              f"{exhaustive:.0f} s, the policy in {policy:.0f} s (timed {timed})\n")
        print("| micro x accum | samples/s (median of rounds) | % of best | policy |")
        print("|---|---:|---:|---|")
        for m in splits:
            mark = "chosen" if m == chosen.micro_batch else ("timed" if m in timed else "")
            print(f"| {m} x {per_rank // m} | {rate[m]:,.1f} | {rate[m] / rate[best]:.0%} | {mark} |")
        share = rate[chosen.micro_batch] / rate[best]
        print(f"\nchosen {chosen.micro_batch} x {chosen.accumulation_steps}: {share:.0%} of the best measured "
              f"({best} x {per_rank // best}); {'within' if share >= 0.9 else 'NOT within'} 10%. "
              f"Reason: {decision['reason']}")


if __name__ == "__main__":
    main()
