"""Data loading: samples/s of the loader alone and of `reproduce run`, for 0, 1 and 2 DataLoader workers.

    python bench/data_loader.py [--steps 20] [--repeats 5] [--image-size 64] [--folder DIR]

Two on-disk formats, made here by `reproduce.data.samples` (nothing downloaded):
- `imagefolder`: scikit-learn's 1,797 digits as PNG files of --image-size pixels in class folders, read with
  ImageNet's training transforms (RandomResizedCrop to 32, flip, normalise), a small GroupNorm CNN;
- `tokens`: the standard library's sources as a uint16 token file (BPE, 512 ids), sequences of 64 tokens,
  a small GPT (2 layers, d 128).
For each, and each worker count: the loader alone (`data.loader.MicroBatchStream`, every micro-batch of
--steps windows taken as the run takes them; the first window, which starts the workers, left out), then
`reproduce run`'s `train` for --steps optimizer steps: samples/s and the share of the run's time spent
waiting for data (`data_seconds`). The median of --repeats rounds, each running every worker count in
turn (machine noise hits them alike). The training process uses one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from reproduce.data import build_data, samples
from reproduce.data.loader import MicroBatchStream
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.trainer import RunRequest, train
from reproduce.train.windows import window

WORKERS = (0, 1, 2)


def recipes(folder: Path) -> dict:
    schedule = {"total": {"steps": 1000}}
    return {
        "imagefolder": ({
            "batch": {"effective": 256}, "task": "classification",
            "model": {"builtin": "cnn-gn", "kwargs": {"channels": 16}},
            "data": {"format": "imagefolder", "path": str(folder / "images" / "train"), "augment": "imagenet",
                     "image_size": 32, "channels": 1},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "schedule": schedule,
            "evaluation": {"at_end": False},
        }, 64),
        "tokens": ({
            "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 64}, "task": "language-modeling",
            "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 4, "dim": 128, "vocab_size": 512}},
            "data": {"format": "tokens", "path": str(folder / "tokens" / "train.bin")},
            "optimizer": {"name": "adamw", "lr": 2e-3}, "schedule": schedule, "evaluation": {"at_end": False},
        }, 16),
    }


def loader_alone(plan, data, steps: int, workers: int) -> float:
    """Samples/s of taking every micro-batch of `steps` windows from the stream, as the run takes them."""
    train_set, size, seed = data.train, len(data.train), plan.recipe.seed

    def windows(step: int) -> list[torch.Tensor]:
        return window(plan, size, step, seed)[0]

    stream = MicroBatchStream(train_set, windows, 0, steps + 1, seed=seed, workers=workers, pin_memory=False)
    taken = 0
    for step in range(steps + 1):
        if step == 1:  # the first window started the workers
            started, taken = time.perf_counter(), 0
        for indices in windows(step):
            inputs, _ = stream.take(step, indices)
            taken += len(inputs)
    elapsed = time.perf_counter() - started
    stream.close()
    return taken / elapsed


def run(plan, data, steps: int, workers: int) -> tuple[float, float]:
    """(samples/s, share of the time spent waiting for data) of `reproduce run` for `steps` optimizer steps."""
    with tempfile.TemporaryDirectory() as folder:
        summary = train(plan, RunRequest(Path(folder) / "run",
                                         device="cpu", max_steps=steps, workers=workers, checkpoint_every=10**6),
                        data=data)
    return summary["samples"] / summary["seconds"], summary["data_share"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--folder", type=Path, help="where to write the data (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the training process; each DataLoader worker uses one thread too
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or Path(scratch)
        if not (folder / "images").is_dir():
            samples.write_images(folder / "images", args.image_size)
        if not (folder / "tokens").is_dir():
            samples.write_tokens(folder / "tokens", max_bytes=2_000_000)
        print(f"torch {torch.__version__}, 1 training thread, median of {args.repeats}, {args.steps} steps; data in "
              f"{folder}")
        print("| format | plan | workers | loader alone samples/s | run samples/s | run waiting for data |")
        print("|---|---|---:|---:|---:|---:|")
        for name, (recipe, micro) in recipes(folder).items():
            spec = parse_recipe(recipe)
            data = build_data(spec)
            plan = make_plan(spec, micro_batch_max=micro, dataset_size=len(data.train))
            run(plan, data, 2, 0)  # warm-up: first-call allocations
            alone, runs = {w: [] for w in WORKERS}, {w: [] for w in WORKERS}
            for _ in range(args.repeats):  # alternating, so the machine's noise hits every worker count alike
                for workers in WORKERS:
                    alone[workers].append(loader_alone(plan, data, args.steps, workers))
                    runs[workers].append(run(plan, data, args.steps, workers))
            for workers in WORKERS:
                rate = statistics.median(r[0] for r in runs[workers])
                share = statistics.median(r[1] for r in runs[workers])
                print(f"| {name} | {plan.arithmetic} | {workers} | {statistics.median(alone[workers]):,.0f} | "
                      f"{rate:,.0f} | {share:.1%} |", flush=True)


if __name__ == "__main__":
    main()
