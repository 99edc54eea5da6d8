"""Why the estimate once refused nanoGPT's 12 sequences: GPT-2 124M counted as a CPU runs it and as a GPU does.

    python bench/estimate_gpt2.py        # about 3 minutes on 2 cores

GPT-2 124M (the `gpt2-124m` built-in: transformers' GPT-2), bf16 autocast, 1,024 tokens, AdamW, a window of
two micro-batches. For dropout 0 and 0.1 and for transformers' default GELU (`gelu_new`, a composite of
pow / tanh / mul) and the exact one-op GELU nanoGPT uses (`gelu`), the fake step is counted with the CPU's
kernels (`gpu=None`: the math attention path when there is dropout, 4-byte dropout noise, CPU autocast's
dtypes) and with an A100's (probe/gpu_like.py). Prints the bytes a sequence adds (the slope between 2 and 4
sequences) and the largest micro-batch on an A100-40GB with no headroom, from that line and the margin.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from reproduce.hardware.catalog import lookup  # noqa: E402
from reproduce.plan.recipe import parse_recipe  # noqa: E402
from reproduce.probe.fake_step import run_fake_step  # noqa: E402
from reproduce.probe.gpu_like import GpuKind  # noqa: E402
from reproduce.probe.meters import CUBLAS_WORKSPACE, ESTIMATE_MARGIN  # noqa: E402
from reproduce.probe.workload import Workload  # noqa: E402

GiB = 2**30


def recipe(dropout: float, activation: str):
    return parse_recipe({
        "batch": {"effective": 491520, "unit": "tokens", "sequence_length": 1024},
        "task": "language-modeling",
        "model": {"builtin": "gpt2-124m", "kwargs": {"dropout": dropout, "activation_function": activation}},
        "data": {"name": "openwebtext", "available": False},
        "optimizer": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "no_decay": ["1d"]},
        "schedule": {"total": {"steps": 10}}, "clip_grad_norm": 1.0, "precision": "bf16",
    }, source="bench")


def main() -> None:
    torch.set_num_threads(1)
    gpu = lookup("a100-40gb")
    fixed = CUBLAS_WORKSPACE + gpu.cublaslt_workspace
    print("| dropout | GELU | counted as on | GiB a sequence | largest on an A100-40GB (line) | attention | s |")
    print("|---:|---|---|---:|---:|---|---:|")
    for dropout in (0.1, 0.0):
        for activation in ("gelu_new", "gelu"):
            workload = Workload(recipe(dropout, activation)).prepare()
            for kind in (None, GpuKind(gpu.capability)):
                started = time.perf_counter()
                peaks, kernels = [], {}
                for size in (2, 4):
                    result = run_fake_step(workload.plan, workload.data.info,
                                           [workload.batch(size), workload.batch(size)], kind)
                    peaks.append(result.peak)
                    kernels = result.kernels
                slope = (peaks[1] - peaks[0]) / 2
                intercept = peaks[0] - 2 * slope
                tensors = (gpu.budget_bytes - fixed) / (1 + ESTIMATE_MARGIN)
                largest = math.floor((tensors - intercept) / slope)
                print(f"| {dropout} | {activation} | {'A100' if kind else 'CPU'} | {slope / GiB:.3f} | {largest} | "
                      f"{', '.join(f'{k} x{n}' for k, n in kernels.items()) or 'the CPU kernels'} | "
                      f"{time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
