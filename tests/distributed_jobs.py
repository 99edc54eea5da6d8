"""Several training runs in one torchrun launch (each launch costs seconds of start-up): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/distributed_jobs.py JOBS.json RESULTS_DIR`.

Each job is `{"name", "recipe", "micro_batch", "dtype", "max_steps", "resume", "checkpoint_every", "out",
"tracker"}` (`out`: the run's folder, default its name, so a later job can resume it); `tracker` (optional)
runs the job on one rank under the CPU memory tracker (`reproduce.probe.tracker.MemoryTracker`): `{"rank": R}`
measures that rank's peak, `{"rank": R, "between": [A, B]}` sets a budget half-way between the peaks jobs A and
B measured, so that rank (and only it) runs out of memory exactly as a GPU would. Every rank writes
RESULTS_DIR/rank-R.json: per job, the measured peak, the seconds taken and, for a run that stopped, its message.
A job whose run stops (TrainingStopped) ends the launch: its process group is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from reproduce.data import build_data
from reproduce.errors import TrainingStopped
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.tracker import MemoryTracker
from reproduce.train.trainer import RunRequest, train


def main(jobs_path: str, results: str) -> None:
    rank = int(os.environ["RANK"])
    jobs = json.loads(Path(jobs_path).read_text())
    done: dict[str, dict] = {}
    out = Path(results)
    for job in jobs:
        recipe = parse_recipe(job["recipe"])
        data = build_data(recipe)
        plan = make_plan(recipe, micro_batch_max=job["micro_batch"], world_size=int(os.environ["WORLD_SIZE"]),
                        dataset_size=len(data.train))
        tracker = job.get("tracker") or {}
        mine = tracker.get("rank") == rank
        budget = None
        if mine and "between" in tracker:
            low, high = (done[name]["peak"] for name in tracker["between"])
            budget = (low + high) // 2
        started = time.perf_counter()
        record: dict = {"budget": budget}
        try:
            with MemoryTracker(budget) if mine else contextlib.nullcontext() as measured:
                train(plan, RunRequest(out / job.get("out", job["name"]), device="cpu", max_steps=job.get("max_steps"),
                                       resume=job.get("resume", False), checkpoint_every=job.get("checkpoint_every")),
                      data=data, dtype=getattr(torch, job.get("dtype", "float32")))
            if mine:
                record["peak"] = measured.peak
        except TrainingStopped as error:
            record["stopped"] = str(error)
        record["seconds"] = round(time.perf_counter() - started, 3)
        done[job["name"]] = record
        (out / f"rank-{rank}.json").write_text(json.dumps(done, indent=1))
        if "stopped" in record:
            return


if __name__ == "__main__":
    main(*sys.argv[1:3])
