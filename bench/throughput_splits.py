"""`--policy throughput`, run 5 times, against every exact split run for real by `reproduce run`.

    python bench/throughput_splits.py [--policy-runs 5] [--rounds 5] [--steps-gpt 16] [--steps-mlp 60] [--keep FILE]
                                      [cases ...]

Cases: gpt (papers/pysource-gpt.yaml) and mlp (papers/digits-mlp.yaml), each planned with
`--meter cpu --memory 256MiB`. For each case:

- the truth: every exact split m x N = the recipe's batch (m <= the probe's largest micro-batch) trained for real by
  `reproduce run`'s trainer (train/trainer.py: `train`, the run's data stream, noise scale, metrics.jsonl), for
  `--steps-*` optimizer steps; a split's figure is the median of its steps' `seconds` after the first (the warm-up),
  and its final figure the median over `--rounds` interleaved rounds (every split once a round, so the machine's
  load hits them alike);
- the policy: `reproduce plan RECIPE --meter cpu --memory 256MiB --policy throughput --json`, a fresh process each
  time (the probe cached after the first; the splits timed anew each time), its runs interleaved with the rounds;
- the figure: how many of the policy's choices are within 10% of the fastest split measured (their rate at least
  90% of the best's). Goal: 5 of 5 on both cases.

One torch thread (OMP_NUM_THREADS=1 in the policy's processes too); the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reproduce.data import build_data
from reproduce.observe.outputs import read_metrics
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import Evaluation, load_recipe
from reproduce.throughput.splits import exact_splits
from reproduce.train.trainer import RunRequest, train

CASES = {"gpt": "papers/pysource-gpt.yaml", "mlp": "papers/digits-mlp.yaml"}
METER = ["--meter", "cpu", "--memory", "256MiB"]
WITHIN = 0.9  # a choice's rate over the fastest split's: at least this is within 10%


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def policy(path: str) -> tuple[dict, float]:
    """One `plan --policy throughput --json` in a fresh process: its decision, and the process's wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "reproduce", "plan", path, *METER, "--policy", "throughput", "--json"],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"reproduce plan failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout), time.perf_counter() - started


def real_run(recipe, data, micro_batch: int, steps: int, folder: Path) -> float:
    """Median seconds of one optimizer step of `reproduce run` at this split, its first step left out."""
    plan = make_plan(recipe, micro_batch_max=micro_batch, dataset_size=len(data.train))
    assert plan.micro_batch == micro_batch and plan.exact, plan.arithmetic
    out = folder / f"m{micro_batch}"
    train(plan, RunRequest(out, device="cpu", max_steps=steps, force=True), data=data)
    records = read_metrics(out / "metrics.jsonl")
    return statistics.median(r["seconds"] for r in records[1:])


def bench(name: str, path: str, args: argparse.Namespace, kept: dict) -> bool:
    recipe = load_recipe(path).model_copy(update={"evaluation": Evaluation(at_end=False)})  # training steps only
    data = build_data(recipe)
    per_rank = recipe.batch.sequences
    steps = args.steps_gpt if name == "gpt" else args.steps_mlp
    seq = recipe.batch.sequence_length
    print(f"\n### {name}: {path}, batch {per_rank} {f'sequences of {seq} tokens' if seq else 'samples'}\n")
    print(f"before: {load()}")
    choices: list[dict] = []
    seconds: dict[int, list[float]] = {}
    splits: list[int] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for i in range(max(args.rounds, args.policy_runs)):
            if i < args.policy_runs:
                summary, wall = policy(path)
                choices.append({**summary["throughput"], "wall": wall})
                if not splits:  # the probe's largest micro-batch bounds the exact splits
                    splits = exact_splits(per_rank, summary["micro_batch_max"])
                    seconds = {m: [] for m in splits}
            if i < args.rounds:
                order = splits[i % len(splits):] + splits[:i % len(splits)]
                for m in order:
                    seconds[m].append(real_run(recipe, data, m, steps, Path(folder)))
    print(f"after: {load()}; {time.perf_counter() - started:.0f} s in all\n")
    kept[name] = {"real_step_seconds": seconds, "policy": choices}
    step = {m: statistics.median(values) for m, values in seconds.items()}
    best = min(step, key=step.get)
    picked = [c["micro_batch"] for c in choices]
    print(f"Every exact split trained for real ({steps} optimizer steps each, the first left out; median over "
          f"{args.rounds} interleaved rounds), and how often the policy chose it in {len(choices)} runs:\n")
    print("| micro x accum | s / optimizer step (rounds) | samples/s | % of fastest | chosen |")
    print("|---|---:|---:|---:|---:|")
    for m in splits:
        rounds = ", ".join(f"{s:.3g}" for s in seconds[m])
        print(f"| {m} x {per_rank // m} | {step[m]:.4g} ({rounds}) | {per_rank / step[m]:,.1f} | "
              f"{step[best] / step[m]:.0%} | {picked.count(m) or ''} |")
    print("\n| policy run | chosen | % of fastest | within 10% | timed steps s (per split) | plan s | reason |")
    print("|---:|---|---:|---|---|---:|---|")
    within = 0
    for i, c in enumerate(choices, 1):
        share = step[best] / step[c["micro_batch"]]
        within += share >= WITHIN
        cost = c["cost"]
        low, high = cost["per_split_seconds"]
        print(f"| {i} | {c['micro_batch']} x {c['accumulation_steps']} | {share:.0%} | "
              f"{'yes' if share >= WITHIN else 'NO'} | {cost['seconds']:.3g} ({low:.2g}-{high:.2g}; bound "
              f"{cost['bound_seconds']:g}) | {c['wall']:.0f} | {c['reason']} |")
    print(f"\n{name}: {within} of {len(choices)} choices within 10% of the fastest measured ({best} x "
          f"{per_rank // best}, {per_rank / step[best]:,.1f} samples/s)")
    return within == len(choices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--policy-runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-gpt", type=int, default=16)
    parser.add_argument("--steps-mlp", type=int, default=60)
    parser.add_argument("--keep", type=Path, help="write every policy decision and real step time to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; {load()}")
    kept: dict = {}
    met = [bench(name, CASES[name], args, kept) for name in args.cases]
    if args.keep:
        args.keep.write_text(json.dumps(kept, indent=1), encoding="utf-8")
    raise SystemExit(0 if all(met) else 1)


if __name__ == "__main__":
    main()
