"""A short run, whole process: `reproduce run` against a hand-written accumulation loop (bench/startup_loop.py).

    python bench/startup.py [--pairs 4] [--steps 40] [--warmup 1]

Each is a fresh Python process on the digits MLP (papers/digits-mlp.yaml, 32 x 8 x 1 = 256 samples a step, --steps
optimizer steps, the CPU, one torch thread each unless --threads): `python -m reproduce run papers/digits-mlp.yaml
--micro-batch-max 32 --max-steps 40 --device cpu --out ...` with everything it does by default (plan.yaml,
metrics.jsonl, noise scale, evaluation at the end, checkpoint, model.pt, loss.svg, summary.json), and the loop (the
same data, model, optimizer, schedule, an evaluation at the end, model.pt). The two alternate, which goes first
alternating too, so the machine's load hits both alike; --warmup pairs first (not counted) fill the file cache.
`reproduce` leaves its objects to the OS at exit instead of CPython's last collection (about 1 s of CPU with torch
loaded); --loop-freezes makes the loop do the same, to see what is left of `reproduce`'s own cost. Per process: wall
time, and CPU time (user + system of the child, resource.getrusage(RUSAGE_CHILDREN)); the time its optimizer steps
took (summary.json's `seconds`; the loop prints its own). The ratios are ours over the loop's, the median of the
pairs' own ratios.
Goal: whole-process ratio under 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], threads: int) -> tuple[float, float, str]:
    """Wall and CPU seconds of one child process, and its stdout. `threads`: its OMP_NUM_THREADS (one by default:
    two OpenMP threads on a shared two-core machine spin against the other jobs, and step times vary 5x)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)})
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, done.stdout


def ours(steps: int, out: Path, threads: int) -> dict:
    wall, cpu, _ = timed([sys.executable, "-m", "reproduce", "run", "papers/digits-mlp.yaml", "--micro-batch-max",
                          "32", "--max-steps", str(steps), "--device", "cpu", "--out", str(out)], threads)
    steps_seconds = json.loads((out / "summary.json").read_text())["seconds"]
    return {"wall": wall, "cpu": cpu, "steps": steps_seconds}


def loop(steps: int, out: Path, threads: int, freeze: bool = False) -> dict:
    wall, cpu, stdout = timed([sys.executable, str(ROOT / "bench" / "startup_loop.py"), "--steps", str(steps),
                               "--out", str(out), *(["--freeze-at-exit"] if freeze else [])], threads)
    return {"wall": wall, "cpu": cpu, "steps": float(re.search(r"steps ([0-9.]+)s", stdout).group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=1, help="pairs run first and not counted")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both processes")
    parser.add_argument("--loop-freezes", action="store_true",
                        help="the loop skips the interpreter's last garbage collection too, as reproduce does")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.warmup + args.pairs):
            first, second = (ours, loop) if index % 2 == 0 else (loop, ours)
            results = {run.__name__: run(args.steps, Path(folder) / f"{run.__name__}-{index}", args.threads,
                                         **({"freeze": True} if run is loop and args.loop_freezes else {}))
                       for run in (first, second)}
            if index >= args.warmup:
                rows.append(results)
                print(f"pair {index - args.warmup + 1}: ours {results['ours']['wall']:.2f} s wall, "
                      f"{results['ours']['cpu']:.2f} s CPU ({results['ours']['steps']:.2f} s in the steps); loop "
                      f"{results['loop']['wall']:.2f} s wall, {results['loop']['cpu']:.2f} s CPU "
                      f"({results['loop']['steps']:.2f} s in the steps)", flush=True)
    median = statistics.median
    print(f"\n{args.pairs} pairs, {args.steps} optimizer steps each, medians:")
    print("| | reproduce run | hand-written loop | ratio (median of the pairs') |")
    print("|---|---:|---:|---:|")
    for key, label in (("wall", "wall s"), ("cpu", "CPU s"), ("steps", "in the optimizer steps s")):
        ratio = median(row["ours"][key] / row["loop"][key] for row in rows)
        print(f"| {label} | {median(row['ours'][key] for row in rows):.2f} | "
              f"{median(row['loop'][key] for row in rows):.2f} | {ratio:.3f} |")
    outside = [row[who]["wall"] - row[who]["steps"] for row in rows for who in ("ours", "loop")]
    print(f"| wall s outside the steps | {median(outside[0::2]):.2f} | {median(outside[1::2]):.2f} | |")
    cpu, wall = (median(row["ours"][key] / row["loop"][key] for row in rows) for key in ("cpu", "wall"))
    print(f"goal (whole process under 1.05x): CPU {'met' if cpu < 1.05 else 'NOT met'} ({cpu:.3f}), "
          f"wall {'met' if wall < 1.05 else 'NOT met'} ({wall:.3f})")


if __name__ == "__main__":
    main()
