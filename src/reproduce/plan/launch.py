"""The torchrun command line that runs `reproduce run` on several processes: pure, no torch, so the launcher
(`reproduce run --nproc-per-node`) and the export (`reproduce plan --emit torchrun`) build it one way."""

from __future__ import annotations

import sys


def torchrun_command(
    run_args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
    python: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m reproduce run ...`: what `reproduce run --nproc-per-node` launches
    and what `reproduce plan --emit torchrun` prints."""
    command = [python or sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and rdzv_endpoint is None:
        command.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need a rendezvous endpoint")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={rdzv_endpoint}"]
    return [*command, "-m", "reproduce", "run", *run_args]
