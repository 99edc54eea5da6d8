"""Activation checkpointing: what it saves and what it costs, measured.

    python bench/checkpointing.py            # a few minutes on 2 cores

1. The cpu meter (real CPU steps, tensors counted by the tracker): the peak of one training step (a window of two
   micro-batches, as the probe measures it) and the time of one micro-step (the best of 7), with and without
   checkpointing, for the built-in GPT (papers/pysource-gpt.yaml: 2 blocks, d 128, 64 tokens) and the digits MLP
   (papers/digits-mlp.yaml: checkpointed per layer).
2. The estimate meter on GPT-2 124M (gpt2-124m, bf16 autocast, 1,024 tokens, no dropout, A100 kernels): the bytes
   one more sequence adds (the slope between 2 and 4 sequences), with and without checkpointing, beside Korthikanti
   et al. 2022's count of a layer's saved activations (eq. 1, 16-bit: sbh(34 + 5as/h); 32sbh with flash attention
   and no dropout; 2sbh for a checkpointed layer's input).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from reproduce.hardware.catalog import lookup  # noqa: E402
from reproduce.plan.overlay import Change, overlay  # noqa: E402
from reproduce.plan.recipe import load_recipe, parse_recipe  # noqa: E402
from reproduce.probe.fake_step import run_fake_step  # noqa: E402
from reproduce.probe.gpu_like import GpuKind  # noqa: E402
from reproduce.probe.meters import CpuMeter  # noqa: E402
from reproduce.probe.workload import Workload  # noqa: E402
from reproduce.train.setup import build  # noqa: E402
from reproduce.train.step import optimizer_step  # noqa: E402

MiB = 2**20
REPEATS = 7


def cpu_meter(path: str, micro_batch: int) -> None:
    """Peaks measured once each; the micro-step timed in rounds alternating without and with (the load of a shared
    machine moves both alike), the best of each kept."""
    setups, peaks = {}, {}
    for on in (False, True):
        recipe = overlay(load_recipe(ROOT / path), [Change("model.activation_checkpointing", on)], path)
        workload = Workload(recipe).prepare()
        meter = CpuMeter(workload, 1024 * MiB, 0.0, time_steps=False)
        peaks[on] = meter.measure(micro_batch).peak_bytes
        setup = build(workload.plan, torch.device("cpu"), data=workload.data)
        window = meter.window(micro_batch, torch.device("cpu"), setup.dtype)
        optimizer_step(setup, window)  # warm-up
        setups[on] = (setup, window)
    best = {False: float("inf"), True: float("inf")}
    for _ in range(REPEATS):
        for on, (setup, window) in setups.items():
            tick = time.perf_counter()
            optimizer_step(setup, window)
            best[on] = min(best[on], (time.perf_counter() - tick) / len(window))
    for on in (False, True):
        print(f"| {path} | {micro_batch} | {'yes' if on else 'no'} | {peaks[on] / MiB:.2f} | {best[on] * 1e3:.1f} |",
              flush=True)


def gpt2_recipe(checkpointing: bool):
    return parse_recipe({
        "batch": {"effective": 491520, "unit": "tokens", "sequence_length": 1024},
        "task": "language-modeling",
        "model": {"builtin": "gpt2-124m", "activation_checkpointing": checkpointing},
        "data": {"name": "openwebtext", "available": False},
        "optimizer": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total": {"steps": 10}}, "precision": "bf16",
    }, source="bench")


def gpt2_estimate() -> None:
    s, h, a, layers = 1024, 768, 12, 12
    full = s * h * (34 + 5 * a * s / h) * layers  # eq. 1 with dropout and the s x s scores kept
    flash = 32 * s * h * layers  # no dropout, flash attention: no s x s tensors
    inputs = 2 * s * h * layers  # a checkpointed layer keeps its 16-bit input only
    print(f"Korthikanti et al. eq. 1, 12 layers, one sequence of 1,024: {full / MiB:.1f} MiB with dropout and the "
          f"scores; {flash / MiB:.1f} MiB without (flash, no dropout); checkpointed: the inputs {inputs / MiB:.1f} MiB "
          f"+ one layer recomputed {flash / layers / MiB:.1f} MiB")
    gpu = GpuKind(lookup("a100-40gb").capability)
    print("| checkpointing | MiB a sequence (estimate, slope 2 -> 4) | activations at 2 sequences (MiB) | s |")
    print("|---|---:|---:|---:|")
    for on in (False, True):
        workload = Workload(gpt2_recipe(on)).prepare()
        started = time.perf_counter()
        peaks, activations = [], []
        for size in (2, 4):
            result = run_fake_step(workload.plan, workload.data.info,
                                   [workload.batch(size), workload.batch(size)], gpu)
            peaks.append(result.peak)
            activations.append(result.step.activations)
        slope = (peaks[1] - peaks[0]) / 2
        print(f"| {'yes' if on else 'no'} | {slope / MiB:.1f} | {activations[0] / MiB:.1f} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    print("| recipe | micro-batch | checkpointing | peak MiB (cpu meter) | ms a micro-step (best of 7) |")
    print("|---|---:|---|---:|---:|")
    cpu_meter("papers/pysource-gpt.yaml", 16)
    cpu_meter("papers/digits-mlp.yaml", 32)
    cpu_meter("papers/digits-mlp.yaml", 256)
    if "--cpu-only" not in sys.argv:
        gpt2_estimate()


if __name__ == "__main__":
    main()
