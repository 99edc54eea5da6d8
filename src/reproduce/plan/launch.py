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
        raise UserError(f"--nnodes: expected a number of machines N or an elastic range MIN:MAX (got {text!r})")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise UserError(f"--nnodes: the range {text} has MIN above MAX")
    return low, high


def torchrun_command(
    run_args: list[str], nproc_per_node: int, nnodes: int | str = 1, node_rank: int = 0,
    rdzv_endpoint: str | None = None, python: str | None = None, max_restarts: int | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m reproduce run ...`: what `reproduce run --nproc-per-node` launches
    and what `reproduce plan --emit torchrun` prints. `max_restarts`: torchrun restarts the whole group after a
    failed process that many times (the run then continues by itself, `--auto-resume`)."""
    command = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if str(nnodes) == "1" and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}"]
    if max_restarts is not None:
        command.append(f"--max-restarts={max_restarts}")
    return [*command, "-m", "reproduce", "run", *run_args]
