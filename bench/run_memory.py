"""Memory of one accumulated optimizer step (m x N) against one micro-batch step alone, on the CPU tracker.

    python bench/run_memory.py

Accumulation should cost no memory beyond one micro-batch: gradients are summed in place, and each
micro-batch's activations are freed by its backward pass. Goal: the accumulated step's peak within 5% of
the single micro-batch step's. Both steps are `reproduce.train.trainer.optimizer_step` on a model built by
`trainer.build`, after one warm-up step (so the optimizer state exists in both), with the window's
micro-batches fetched as `reproduce run`'s loop fetches them (`LazyMicroBatch`: targets counted first, each
micro-batch's inputs loaded onto the device just before its forward).
Memory is counted by `reproduce.probe.tracker.MemoryTracker`: live tensor storage, 512 B blocks, with the
parameters, optimizer state and inputs that exist before the step charged too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from reproduce.data import build_data  # noqa: E402
from reproduce.data.batches import LazyMicroBatch  # noqa: E402
from reproduce.plan.planner import make_plan  # noqa: E402
from reproduce.plan.recipe import load_recipe  # noqa: E402
from reproduce.plan.units import format_size  # noqa: E402
from reproduce.probe.tracker import MemoryTracker  # noqa: E402
from reproduce.train.setup import build  # noqa: E402
from reproduce.train.step import optimizer_step  # noqa: E402
from reproduce.train.windows import window  # noqa: E402

CASES = {"mlp": ("papers/digits-mlp.yaml", 32), "gpt": ("papers/pysource-gpt.yaml", 16)}  # m: the recipes' own
GOAL = 0.05


def state_tensors(setup) -> list[torch.Tensor]:
    model = setup.unwrapped_model
    state = [t for s in setup.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *state]


def step_peak(setup, train_set, indices: list[torch.Tensor]) -> tuple[int, int]:
    """The peak of one optimizer step over `indices` (its micro-batches), and the bytes of one micro-batch."""
    tracker = MemoryTracker()
    with tracker:
        tracker.charge(state_tensors(setup))
        state = tracker.live
        first = LazyMicroBatch(train_set, indices[0], setup.device, setup.dtype).load()
        inputs = tracker.live - state
        del first
        tracker.reset_peak()
        optimizer_step(setup, [LazyMicroBatch(train_set, i, setup.device, setup.dtype) for i in indices])
    return tracker.peak, inputs


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; tracked tensor bytes (512 B blocks), CPU\n")
    print("| recipe | m x N | one micro-batch step | accumulated step (m x N) | difference | "
          "one micro-batch's inputs | gradients (1x parameters) | goal (5%) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name, (path, micro) in CASES.items():
        recipe = load_recipe(ROOT / path)
        data = build_data(recipe)
        train_set = data.train
        plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(train_set))
        setup = build(plan, torch.device("cpu"), data=data)
        indices, _ = window(plan, len(train_set), 0, recipe.seed)
        optimizer_step(setup, [LazyMicroBatch(train_set, i, setup.device, setup.dtype) for i in indices])  # warm-up
        single, _ = step_peak(setup, train_set, indices[:1])
        accumulated, inputs = step_peak(setup, train_set, indices)
        difference = accumulated / single - 1
        gradients = sum(-(-p.untyped_storage().nbytes() // 512) * 512 for p in setup.unwrapped_model.parameters())
        print(f"| {name} ({path}) | {plan.micro_batch} x {plan.accumulation_steps} | "
              f"{format_size(single)} | {format_size(accumulated)} | {difference:+.2%} | {format_size(inputs)} | "
              f"{format_size(gradients)} | {'met' if difference <= GOAL else 'NOT met'} |", flush=True)


if __name__ == "__main__":
    main()
