"""The torchrun command line that runs `reproduce run` on several processes: pure, no torch, so the launcher
(`reproduce run --nproc-per-node`) and the exports (`reproduce plan --emit torchrun`, `--emit slurm`) build it one
way."""

from __future__ import annotations

import sys

from ..errors import UserError


def node_range(nnodes: int | str) -> tuple[int, int]:
    """`--nnodes N` or torchrun's elastic `MIN:MAX` as (MIN, MAX); bad text is one line naming the option."""
    text = str(nnodes)
    parts = text.split(":")
    if len(parts) > 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UserError(f"expected a number of machines N or an elastic range MIN:MAX (got {text!r})", field="nnodes")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise UserError(f"the range {text} has MIN above MAX", field="nnodes")
    return low, high


GPUS_PER_NODE = 8  # the usual server: a plan's processes fill nodes of 8 (fewer when 8 does not divide them)


def node_split(world_size: int, per_node: int = GPUS_PER_NODE) -> tuple[int, int]:
    """(nodes, processes per node) for `world_size` processes: full nodes of the largest count up to `per_node` that
    divides it (12 -> 2 x 6, 32 -> 4 x 8, 5 -> 1 x 5)."""
    most = max(count for count in range(1, min(per_node, world_size) + 1) if world_size % count == 0)
    return world_size // most, most


def torchrun_command(
    run_args: list[str], nproc_per_node: int, nnodes: int | str = 1, node_rank: int | None = 0,
    rdzv_endpoint: str | None = None, python: str | None = None, max_restarts: int | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m reproduce run ...`, as `run --nproc-per-node` launches it and `plan
    --emit torchrun` prints it. `max_restarts`: whole-group restarts after a failed process (the run resumes itself,
    `--auto-resume`); `node_rank` None is left out (the c10d rendezvous ranks nodes as they join)."""
    command = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint")
        command += [f"--nnodes={nnodes}", *([f"--node-rank={node_rank}"] if node_rank is not None else []),
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if rdzv_id is not None:
            command.append(f"--rdzv-id={rdzv_id}")
    if max_restarts is not None:
        command.append(f"--max-restarts={max_restarts}")
    return [*command, "-m", "reproduce", "run", *run_args]
