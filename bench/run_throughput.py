"""Throughput of `reproduce run` against a hand-written minimal accumulation loop, side by side.

    python bench/run_throughput.py [--repeats 7] [--steps-mlp 600] [--steps-gpt 20]

Same model, data, batch arithmetic, seed and optimizer; the runs alternate (ours, minimal, ours without the
noise scale, ...) so machine noise hits them alike; the overhead is the median of each repeat's own (with its
quartiles). Goal: under 3%. `reproduce run` here includes everything it does for real: metrics.jsonl per step,
the gradient noise scale (its default; the last column runs with --no-noise-scale), checkpoints, model.pt and
summary.json (evaluation off in both loops).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from reproduce.data import build_data
from reproduce.data.batches import fetch
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import Evaluation, load_recipe
from reproduce.train.trainer import RunRequest, train
from reproduce.train.windows import epoch_order

CASES = {"mlp": ("papers/digits-mlp.yaml", 32), "gpt": ("papers/pysource-gpt.yaml", 16)}


def minimal_loop(plan, data, steps: int) -> float:
    """The loop a careful user would write by hand; returns samples/s."""
    recipe = plan.recipe
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, data.info)
    spec = recipe.optimizer
    if spec.name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=spec.betas,
                                      weight_decay=spec.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=spec.momentum,
                                    weight_decay=spec.weight_decay)
    train_set, batch, micro = data.train, plan.effective_batch, plan.micro_batch
    language = recipe.task == "language-modeling"
    model.train()
    started, samples = time.perf_counter(), 0
    orders = {}
    for step in range(steps):
        epoch, position = divmod(step, plan.steps_per_epoch)
        if epoch not in orders:  # one permutation per epoch
            orders = {epoch: epoch_order(plan, len(train_set), epoch, recipe.seed)}
        order = orders[epoch][position * batch:(position + 1) * batch]
        for indices in torch.split(order, micro):
            inputs, target = fetch(train_set, indices)
            output = model(inputs)
            if language:
                loss = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum") / target.numel() / (
                    batch // micro)
            else:
                loss = F.cross_entropy(output, target) / (batch // micro)
            loss.backward()
            samples += len(target)
        if recipe.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return samples / (time.perf_counter() - started)


def ours(plan, data, steps: int, noise_scale: bool = True) -> float:
    with tempfile.TemporaryDirectory() as folder:
        summary = train(plan, RunRequest(Path(folder) / "run",
                                         device="cpu", max_steps=steps, no_noise_scale=not noise_scale),
                        data=data)
    return summary["samples"] / summary["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps-mlp", type=int, default=600)
    parser.add_argument("--steps-gpt", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # timings repeat on a shared 2-core machine
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} alternating repeats")
    print(f"{'case':6} {'arithmetic':22} {'steps':>5} {'ours samples/s':>15} {'minimal samples/s':>18} {'overhead':>9} "
          f"{'ours, --no-noise-scale':>23} {'overhead':>9}")  # overhead: median (quartiles) of the repeats' own
    for name, (path, micro) in CASES.items():
        # training throughput only: no evaluation passes in either loop
        recipe = load_recipe(path).model_copy(update={"evaluation": Evaluation(at_end=False)})
        data = build_data(recipe)
        plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(data.train))
        steps = args.steps_mlp if name == "mlp" else args.steps_gpt
        ours(plan, data, 2)  # warm-up: first-call allocations, thread pools
        minimal_loop(plan, data, 2)
        rates_ours, rates_minimal, rates_quiet = [], [], []
        for _ in range(args.repeats):
            rates_ours.append(ours(plan, data, steps))
            rates_minimal.append(minimal_loop(plan, data, steps))
            rates_quiet.append(ours(plan, data, steps, noise_scale=False))
        mine, base = statistics.median(rates_ours), statistics.median(rates_minimal)
        quiet = statistics.median(rates_quiet)
        print(f"{name:6} {plan.arithmetic:22} {steps:5d} {mine:15.0f} {base:18.0f} "
              f"{overhead(rates_ours, rates_minimal)} {quiet:23.0f} {overhead(rates_quiet, rates_minimal)}")


def overhead(ours_rates: list[float], minimal_rates: list[float]) -> str:
    """The median of each repeat's own overhead (the two runs of a repeat are neighbours in time, so a busy spell
    of the machine hits both), with the quartiles: how much slower than the minimal loop."""
    ratios = [100 * (1 - a / b) for a, b in zip(ours_rates, minimal_rates, strict=True)]
    low, mid, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{mid:+.1f}% ({low:+.1f}..{high:+.1f})"


if __name__ == "__main__":
    main()
