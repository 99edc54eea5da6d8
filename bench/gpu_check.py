"""GPU check: the real probe against the `estimate` meter, on a CUDA machine. Under 5 minutes.

    python bench/gpu_check.py                   # the card's free memory as the budget
    python bench/gpu_check.py --memory 16GiB    # a smaller budget, enforced with the memory fraction
    python bench/gpu_check.py --only gpt2-124m --json gpu_check.json

Not part of `make test` (CI has no GPU); run it by hand where there is one. For each model — the built-in
MLP and CNN on digits, the small GPT on Python's source, and a GPT-2-124M-sized model (12 layers, 12
heads, d 768, 1,024 tokens, vocabulary 50,304, bf16, synthetic tokens), and transformers' GPT-2 124M with
dropout 0.1 (attention with dropout, dropout masks and gelu_new's dtypes as the estimate counts them) — it prints:
- the `cuda` probe: largest micro-batch, its reserved (decides) and allocated peaks, trials, seconds;
- the `estimate` meter (fake tensors on the CPU device, same budget): its largest micro-batch;
- at every size the cuda probe measured to fit: estimate / reserved and tensors / allocated;
- the CUDA context and other processes' use (what `catalog.CONTEXT_BYTES` assumes is 512 MiB).
What to look for: estimate/reserved near or just above 1 (the estimate's margin covers the allocator and the
workspaces), the estimate's maximum at or below the measured one, and tensors/allocated near 1 (the
tracker sees what CUDA holds: with the attention kernels, dropout masks and autocast dtypes of this card,
probe/gpu_like.py, it should be within a few percent; a ratio well above 1 means the fake step still
counts something CUDA does not keep, well below 1 something CUDA keeps that it misses).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from reproduce.plan.recipe import parse_recipe  # noqa: E402
from reproduce.plan.units import format_size  # noqa: E402
from reproduce.probe.meters import EstimateMeter  # noqa: E402
from reproduce.probe.runner import ProbeOptions, run_probe  # noqa: E402
from reproduce.probe.search import search  # noqa: E402
from reproduce.probe.workload import Workload  # noqa: E402

_CLASSIFY = {"task": "classification", "data": {"builtin": "digits"}, "schedule": {"total": {"steps": 100}},
             "batch": {"effective": 65536, "unit": "samples"}}
MODELS = {
    "mlp": {**_CLASSIFY, "model": {"builtin": "mlp", "kwargs": {"hidden": 1024}},
            "optimizer": {"name": "adamw", "lr": 1e-3}},
    "cnn": {**_CLASSIFY, "model": {"builtin": "cnn-bn", "kwargs": {"channels": 64}, "norm_layers": ["batchnorm"]},
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    "gpt": {"task": "language-modeling", "batch": {"effective": 4096 * 256, "unit": "tokens", "sequence_length": 256},
            "model": {"builtin": "gpt", "kwargs": {"layers": 4, "heads": 4, "dim": 256}},
            "data": {"builtin": "pysource", "kwargs": {"max_bytes": 500_000}},
            "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"total": {"steps": 100}},
            "clip_grad_norm": 1.0, "precision": "bf16"},
    "gpt2-124m": {"task": "language-modeling",
                  "batch": {"effective": 491520, "unit": "tokens", "sequence_length": 1024},
                  "model": {"builtin": "gpt", "kwargs": {"layers": 12, "heads": 12, "dim": 768, "vocab_size": 50304}},
                  "data": {"name": "openwebtext (synthetic tokens here)", "available": False},
                  "optimizer": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                "no_decay": ["1d"]},
                  "schedule": {"total": {"steps": 100}}, "clip_grad_norm": 1.0, "precision": "bf16"},
    # transformers' GPT-2 (the gpt2-124m built-in) with dropout 0.1 and its composite gelu_new: what the estimate
    # counts as CUDA runs it (fused attention with dropout, 1-byte masks, gelu_new's fp32 intermediates under
    # autocast; probe/gpu_like.py) checked against the card
    "gpt2-124m-hf": {"task": "language-modeling",
                     "batch": {"effective": 491520, "unit": "tokens", "sequence_length": 1024},
                     "model": {"builtin": "gpt2-124m", "kwargs": {"dropout": 0.1}},
                     "data": {"name": "openwebtext (synthetic tokens here)", "available": False},
                     "optimizer": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                   "no_decay": ["1d"]},
                     "schedule": {"total": {"steps": 100}}, "clip_grad_norm": 1.0, "precision": "bf16"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", help="Budget per trial (default: the card's free memory).")
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--only", choices=list(MODELS), action="append")
    parser.add_argument("--json", type=Path, help="Also write the figures to this file.")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; run this on a machine with one")
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    print(f"{torch.cuda.get_device_name()}: {format_size(total)}, {format_size(free)} free; context and other "
          f"processes {format_size(context)}; torch {torch.__version__}\n")
    figures = {"device": torch.cuda.get_device_name(), "total_bytes": total, "context_bytes": context, "models": {}}
    started = time.perf_counter()
    for name in args.only or list(MODELS):
        recipe = parse_recipe(MODELS[name], source=name)
        workload = Workload(recipe).prepare()
        options = ProbeOptions(memory=args.memory, meter="cuda", headroom=args.headroom, use_cache=False)
        real = run_probe(recipe, name, options, data=workload.data)
        budget = real.budget_bytes
        meter = EstimateMeter(workload, budget, args.headroom, cap=real.cap,
                              capability=torch.cuda.get_device_capability())  # this card's attention kernels
        estimate = search(meter.measure, meter.limit_bytes, real.cap)
        print(f"## {name}: cuda max {real.micro_batch_max} ({len(real.trials)} trials, {real.seconds:.1f} s), "
              f"estimate max {estimate.micro_batch_max} ({len(estimate.trials)} trials, {estimate.seconds:.1f} s); "
              f"budget {format_size(budget)}, limit {format_size(real.limit_bytes)}")
        print("| micro-batch | reserved | allocated | estimate | estimate / reserved | tensors / allocated |")
        print("|---:|---:|---:|---:|---:|---:|")
        rows = []
        for trial in real.trials:
            if not trial.fits:
                continue
            guess = meter.measure(trial.micro_batch)
            if guess.peak_bytes is None:
                print(f"| {trial.micro_batch} | {format_size(trial.peak_bytes)} | {format_size(trial.tensor_bytes)} "
                      f"| over the budget | - | - |")
                continue
            rows.append({"micro_batch": trial.micro_batch, "reserved": trial.peak_bytes,
                         "allocated": trial.tensor_bytes, "estimate": guess.peak_bytes, "tensors": guess.tensor_bytes})
            print(f"| {trial.micro_batch} | {format_size(trial.peak_bytes)} | {format_size(trial.tensor_bytes)} | "
                  f"{format_size(guess.peak_bytes)} | {guess.peak_bytes / trial.peak_bytes:.3f} | "
                  f"{guess.tensor_bytes / trial.tensor_bytes:.3f} |")
        print()
        figures["models"][name] = {
            "cuda": real.model_dump(mode="json"), "estimate_max": estimate.micro_batch_max, "sizes": rows,
        }
    print(f"gpu_check wall time: {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
