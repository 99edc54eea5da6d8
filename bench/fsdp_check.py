"""The sharding arithmetic against FSDP2 itself: one rank's peak, estimated and allocated.

    python bench/fsdp_check.py                 # a few minutes on 2 cores
    python bench/fsdp_check.py --ranks 2 4     # fewer cases

The estimate meter never runs FSDP: it measures the unsharded step on fake tensors and computes one rank's
peak (probe/sharded_memory.py). Here the same step runs under `torch.distributed.fsdp.fully_shard` (per block, then
the root; `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` and no autocast, as `reproduce run`
shards; AdamW foreach; clipping) on real CPU tensors of rank 0 of a *fake* process group of W ranks (PyTorch's
`torch.testing._internal.distributed.fake_pg`: collectives that move no data, so one process allocates
exactly what one rank of W would). The tracker counts its tensors, following FSDP2's storage resizes too
(PyTorch's own FSDPMemTracker does the same but allows one forward per module, no accumulation window);
a warm-up step first, then the measured
step, with one micro-batch (reduced at once) or a window of two (the first under
`set_requires_gradient_sync(False)`, FSDP2's no_sync). The estimate is computed with the CPU's kernels
(`gpu=None`), so both sides run the same attention and dropout; only the sharding is modelled.
Prints a Markdown table: allocated, estimated, estimated / allocated (goal: at or just above 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from reproduce.models import build_model  # noqa: E402
from reproduce.plan.recipe import parse_recipe  # noqa: E402
from reproduce.plan.units import format_size  # noqa: E402
from reproduce.probe.fake_step import block_sizes, run_fake_step  # noqa: E402
from reproduce.probe.sharded_memory import Blocks, mixed_precision_step, sharded_peak  # noqa: E402
from reproduce.probe.tracker import MemoryTracker, rounded  # noqa: E402
from reproduce.probe.workload import Workload  # noqa: E402
from reproduce.train.distributed.fsdp import shard_units  # noqa: E402
from reproduce.train.losses import build_loss  # noqa: E402
from reproduce.train.optim.optimizers import build_optimizer  # noqa: E402

RECIPES = {
    "tiny": {  # the test's case (tests/torch/probe/test_sharded_memory.py runs it): seconds
        "batch": {"effective": 64 * 64, "unit": "tokens", "sequence_length": 64},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 128, "vocab_size": 512}},
        "data": {"name": "synthetic tokens", "available": False},
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "weight_decay": 0.1},
        "schedule": {"total": {"steps": 10}}, "clip_grad_norm": 1.0, "precision": "bf16",
    },
    "gpt-8x512": {
        "batch": {"effective": 64 * 128, "unit": "tokens", "sequence_length": 128},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 8, "heads": 8, "dim": 512, "vocab_size": 4096}},
        "data": {"name": "synthetic tokens", "available": False},
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "weight_decay": 0.1},
        "schedule": {"total": {"steps": 10}}, "clip_grad_norm": 1.0, "precision": "bf16",
    },
    "gpt-4x256-vocab32k": {  # most parameters in the root (embedding and tied head): what stays gathered
        "batch": {"effective": 64 * 128, "unit": "tokens", "sequence_length": 128},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 4, "heads": 4, "dim": 256, "vocab_size": 32000,
                                               "dropout": 0.1}},
        "data": {"name": "synthetic tokens", "available": False},
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "weight_decay": 0.1},
        "schedule": {"total": {"steps": 10}}, "clip_grad_norm": 1.0, "precision": "bf16",
    },
}


def fsdp_peak(recipe, workload: Workload, world: int, micro_batch: int, window: int) -> int:
    """Rank 0's peak tensor bytes in a real FSDP2 step over a fake process group of `world` ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore


    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        tracker = ResizeAwareTracker()
        with tracker:
            torch.manual_seed(0)
            model = build_model(recipe, workload.data.info)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in reversed(shard_units(model)):  # the units `reproduce run` shards (train/distributed/fsdp.py)
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            optimizer = build_optimizer(workload.plan, model)
            for group in optimizer.param_groups:
                group["foreach"] = True
            loss_fn = build_loss(recipe)
            batches = [workload.batch(micro_batch) for _ in range(window)]
            count = sum(loss_fn.count(target) for _, target in batches)
            for step in range(2):
                if step == 1:
                    tracker.reset_peak()
                for index, (inputs, target) in enumerate(batches):
                    model.set_requires_gradient_sync(index == window - 1)
                    loss = loss_fn(model(inputs), target) / count  # no autocast: the policy casts (train/setup.py)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del model, optimizer, batches, loss
        return tracker.peak
    finally:
        dist.destroy_process_group()


class ResizeAwareTracker(MemoryTracker):
    """The tracker, also following `UntypedStorage.resize_`: FSDP2 frees and re-allocates its all-gather
    outputs by resizing their storage, which no operator (so no dispatch mode) sees. PyTorch's own MemTracker
    patches the same method for the same reason."""

    def __enter__(self):
        original = self._original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            original(storage, size)
            key, charged = storage._cdata, rounded(size)
            known = tracker._sizes.get(key)
            if known is None:
                if charged:
                    weakref.finalize(storage, tracker._release, key)
                    tracker._sizes[key] = (charged, tracker.phase)
                    tracker.live += charged
                    tracker._move(charged, None, tracker.phase)
            else:
                tracker._sizes[key] = (charged, known[1])
                tracker.live += charged - known[0]
                tracker._move(known[0], known[1], None)
                tracker._move(charged, None, known[1])
            tracker.peak = max(tracker.peak, tracker.live)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._original
        return super().__exit__(*args)


def estimated(recipe, workload: Workload, world: int, micro_batch: int, window: int) -> int:
    """What the estimate meter computes for one rank (EstimateMeter.measure), with the CPU's kernels."""
    with torch.device("meta"):
        model = build_model(recipe, workload.data.info)
    root, sizes = block_sizes(model)
    blocks = Blocks(root=root, blocks=sizes)
    result = run_fake_step(workload.plan, workload.data.info,
                           [workload.batch(micro_batch) for _ in range(window)], gpu=None,
                           model=model.to(torch.bfloat16), autocast=False)
    step = mixed_precision_step(result.step, blocks, master_bytes=4, compute_bytes=2)
    return sharded_peak(step, blocks, world, result.compute_bytes, unsharded_window=window > 1).peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=[name for name in RECIPES if name != "tiny"],
                        choices=list(RECIPES))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | ranks | window | FSDP2 allocated | estimated | estimated / allocated | s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in args.models:
        recipe = parse_recipe(RECIPES[name], source=name)
        workload = Workload(recipe).prepare()
        for world in args.ranks:
            for window in (1, 2):
                started = time.perf_counter()
                real = fsdp_peak(recipe, workload, world, args.micro_batch, window)
                guess = estimated(recipe, workload, world, args.micro_batch, window)
                rows.append({"model": name, "ranks": world, "window": window, "allocated": real, "estimated": guess})
                print(f"| {name} | {world} | {window} x {args.micro_batch} | {format_size(real)} | "
                      f"{format_size(guess)} | {guess / real:.3f} | {time.perf_counter() - started:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
