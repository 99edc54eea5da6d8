"""What `reproduce run --log-to` costs the training loop: milliseconds per optimizer step spent in each tracker.

    python bench/trackers.py [--steps 100] [--repeats 3]

The digits MLP (papers/digits-mlp.yaml, 32 x 8 x 1 = 256) trained for --steps optimizer steps once per tracker
(none, tensorboard, wandb offline, mlflow in the run folder) per round, the trackers in turn; for each, the time
the training thread spent in the trackers' `step` (the tracker's log call and trackers.json), its
`start` (opening the tracker's run) and `finish` (artifacts, closing; MLflow waits there for its queue), and
the run's wall time. The median over --repeats rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from reproduce.observe.trackers import Trackers
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.train.reporter import Reporters
from reproduce.train.trainer import RunRequest, SilentReporter, train

ROOT = Path(__file__).resolve().parents[1]


class Timed(Trackers):
    def __init__(self, *args):
        super().__init__(*args)
        self.spent = {"start": 0.0, "step": [], "finish": 0.0}

    def start(self, start):
        began = time.perf_counter()
        lines = super().start(start)
        self.spent["start"] = time.perf_counter() - began
        return lines

    def step(self, record):
        began = time.perf_counter()
        lines = super().step(record)
        self.spent["step"].append(time.perf_counter() - began)
        return lines

    def finish(self, summary):
        began = time.perf_counter()
        lines = super().finish(summary)
        self.spent["finish"] = time.perf_counter() - began
        return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["WANDB_MODE"] = "offline"
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    torch.set_num_threads(1)
    recipe = ROOT / "papers" / "digits-mlp.yaml"
    plan = make_plan(load_recipe(recipe), 32, dataset_size=1437, recipe_path=str(recipe))
    names = ["none", "tensorboard", "wandb", "mlflow"]
    found: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.repeats):
            for name in names:
                out = Path(folder) / f"{name}-{round_}"
                reporter = Timed([] if name == "none" else [name], out)
                began = time.perf_counter()
                with reporter:
                    train(plan, RunRequest(out, device="cpu", max_steps=args.steps),
                          reporter=Reporters(reporter, SilentReporter()))
                wall = time.perf_counter() - began
                steps = reporter.spent["step"]
                found[name].append((1000 * statistics.median(steps), 1000 * max(steps), reporter.spent["start"],
                                    reporter.spent["finish"], wall))
    print(f"{args.steps} optimizer steps of {plan.arithmetic}; median of {args.repeats} rounds")
    print("| tracker | per step, median ms | per step, worst ms | opening s | finishing s | run wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        columns = list(zip(*found[name], strict=True))
        median, worst, start, finish, wall = (statistics.median(column) for column in columns)
        print(f"| {name} | {median:.2f} | {worst:.1f} | {start:.2f} | {finish:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
