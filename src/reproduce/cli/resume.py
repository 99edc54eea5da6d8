"""The command that continues an interrupted run, `reproduce run OUT/plan.yaml --out OUT --resume`, with every option
that shapes the run, so that pasted as printed it goes on with the same run."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from ..errors import UserError
from ..plan.planfile import load_plan
from ..storage.lock import LAUNCHER_ENV  # torchrun's options, for the resume command its processes print


def launcher_args(nproc_per_node: int, nnodes: int | str, node_rank: int, rdzv_endpoint: str | None) -> list[str]:
    args = ["--nproc-per-node", str(nproc_per_node)]
    if str(nnodes) != "1":
        args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if rdzv_endpoint is not None:
        args += ["--rdzv-endpoint", rdzv_endpoint]
    return args


def launcher_of_this_job(world_size: int) -> list[str]:
    """torchrun's options for the resume command: as `--nproc-per-node` launched this job, else (torchrun started
    by hand) from the variables torchrun sets."""
    given = os.environ.get(LAUNCHER_ENV)
    if given is not None:
        return shlex.split(given)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return launcher_args(local, max(1, world_size // local), int(os.environ.get("GROUP_RANK", 0)), None)


def continue_command(out: Path, launcher: list[str], args: list[str]) -> str:
    """The command that continues this run after a signal, with every option that shapes it."""
    return shlex.join(["reproduce", "run", str(out / "plan.yaml"), "--out", str(out), "--resume", *launcher, *args])


def folder_state(out: Path, max_steps: int | None) -> tuple[str, str]:
    """Where the run in `out` stands for --auto-resume, and a few words on it: `new`, `started` (plan.yaml, no
    checkpoint: start again), `unfinished` (resume) or `finished` (judged from the last checkpoint, never from a
    summary.json that may be damaged)."""
    if not (out / "plan.yaml").is_file():
        return "new", "no run there"
    if not (out / "checkpoints" / "last.pt").is_file():
        try:  # (nothing to check it against)
            summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = {}
        summary = summary if isinstance(summary, dict) else {}
        steps, planned = summary.get("steps"), summary.get("planned_steps") or summary.get("steps")
        if isinstance(steps, int) and isinstance(planned, int) and steps >= (
                planned if max_steps is None else min(max_steps, planned)):
            return "finished", f"{steps} of {planned} optimizer steps run"
        return "started", "its plan.yaml but no checkpoint yet"
    from ..train.resume import finished_state  # (torch: only for a folder with a checkpoint)

    try:
        planned = load_plan(out / "plan.yaml").optimizer_steps
    except UserError:  # the resume says what is wrong with it
        planned = None
    return finished_state(out, max_steps, planned)
