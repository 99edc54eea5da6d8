"""The command that continues an interrupted run: `reproduce run OUT/plan.yaml --out OUT --resume` with every option
that shapes the run (--max-steps, --micro-batch-max, --data, --eval-data, --workers, torchrun's ...), so that pasting
it as printed goes on with the same run."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from ..errors import UserError
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
    by hand) from the variables torchrun sets (a multi-node job then also needs its --rdzv-endpoint)."""
    given = os.environ.get(LAUNCHER_ENV)
    if given is not None:
        return shlex.split(given)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return launcher_args(local, max(1, world_size // local), int(os.environ.get("GROUP_RANK", 0)), None)


def absolute(path: str | None) -> str | None:
    return str(Path(path).expanduser().absolute()) if path is not None else None


def continue_command(out: Path, launcher: list[str], args: list[str]) -> str:
    """The command that continues this run after a signal, with every option that shapes it (pasted, it goes on to
    the same --max-steps, on the same data, workers and processes)."""
    return shlex.join(["reproduce", "run", str(out / "plan.yaml"), "--out", str(out), "--resume", *launcher, *args])


def folder_state(out: Path, max_steps: int | None) -> tuple[str, str]:
    """Where the run in `out` stands, for --auto-resume, with a few words on it: `new` (no run there), `started`
    (its plan.yaml, no checkpoint yet: it starts again), `unfinished` (a checkpoint: it resumes) or `finished`
    (summary.json has reached --max-steps, else the plan's last step: nothing to do)."""
    if not (out / "plan.yaml").is_file():
        return "new", "no run there"
    summary_path = out / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        planned = summary.get("planned_steps") or summary["steps"]
        target = min(max_steps, planned) if max_steps is not None else planned
        if summary["steps"] >= target:
            return "finished", f"{summary['steps']} of {planned} optimizer steps run"
    if (out / "checkpoints" / "last.pt").is_file():
        return "unfinished", "a checkpoint to continue from"
    return "started", "its plan.yaml but no checkpoint yet"


def auto_resume_flags(resume: bool, force: bool, max_restarts: int | None, launching: bool) -> None:
    """--auto-resume chooses between starting and --resume itself; --max-restarts is torchrun's (it implies
    --auto-resume, so a restarted group continues)."""
    if resume or force:
        raise UserError(f"--auto-resume: it decides between starting and resuming by itself; without "
                        f"{'--resume' if resume else '--force'}")
    if max_restarts is not None and not launching:
        raise UserError("--max-restarts: torchrun restarts the processes it launched; give --nproc-per-node "
                        "(or run torchrun --max-restarts yourself, with --auto-resume)")
