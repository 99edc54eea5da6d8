"""The command that continues an interrupted run: `reproduce run OUT/plan.yaml --out OUT --resume` with every option
that shapes the run (--max-steps, --micro-batch-max, --data, --eval-data, --workers, torchrun's ...), so that pasting
it as printed goes on with the same run."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..storage.lock import LAUNCHER_ENV  # torchrun's options, for the resume command its processes print


def launcher_args(nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> list[str]:
    args = ["--nproc-per-node", str(nproc_per_node)]
    if nnodes > 1:
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


def continue_command(out: Path, values: dict[str, object], switches: dict[str, bool], launcher: list[str]) -> str:
    """The command that continues this run after a signal, with every option that shapes it (pasted, it goes on to
    the same --max-steps, on the same data, workers and processes)."""
    args = ["reproduce", "run", str(out / "plan.yaml"), "--out", str(out), "--resume", *launcher]
    for flag, value in values.items():
        if value is not None:
            args += [flag, str(value)]
    return shlex.join(args + [flag for flag, on in switches.items() if on])
