"""Several processes under torchrun (`reproduce run --nproc-per-node K` re-executes itself under
`python -m torch.distributed.run`; an external torchrun is recognised by RANK, WORLD_SIZE, LOCAL_RANK); NCCL on
CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...errors import UserError
from ...plan.launch import torchrun_command  # noqa: F401  (what `reproduce run --nproc-per-node` launches)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    distributed: bool = field(init=False)  # several processes
    is_main: bool = field(init=False)  # rank 0, the one that writes

    def __post_init__(self) -> None:
        object.__setattr__(self, "distributed", self.size > 1)
        object.__setattr__(self, "is_main", self.rank == 0)


def world_from_env() -> World:
    """The process's place in a torchrun job (a single process outside one)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return World()
    return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def init(world: World, device: torch.device) -> torch.device:
    """Join the process group (once) and return this rank's device."""
    if not world.distributed:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # a long timeout: the other ranks wait in the next collective while rank 0 evaluates
        timeout = datetime.timedelta(hours=2)
        store, _, _ = next(dist.rendezvous("env://", world.rank, world.size, timeout=timeout))
        # torchrun --max-restarts keeps its store across the group's restarts: a restarted rank that read the last
        # attempt's keys (gloo's addresses of processes now gone) failed to connect in 2 of 4 tries here; each
        # attempt takes keys of its own
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                store=dist.PrefixStore(f"reproduce-attempt-{attempt}", store), rank=world.rank,
                                world_size=world.size)
    return device


def plan_fingerprint(plan, seed: int) -> int:
    """What every node must agree on, as a number: the recipe, split, schedule and seed (not the
    recipe's path, nor a throughput policy's timings)."""
    shown = {"recipe": plan.recipe.model_dump(mode="json"), "seed": seed,
             **{key: getattr(plan, key) for key in ("micro_batch", "accumulation_steps", "world_size",
                                                    "effective_batch", "lr", "optimizer_steps", "policy")}}
    digest = hashlib.sha256(json.dumps(shown, sort_keys=True, default=str).encode()).hexdigest()
    return int(digest[:15], 16)  # fits an int64


def check_same_plan(world: World, fingerprint: int, device: torch.device) -> None:
    """Every rank runs rank 0's plan: a node with another recipe, micro-batch or seed is refused by
    the whole job, naming that node (torchrun's GROUP_RANK)."""
    if not world.distributed:
        return
    mine = torch.tensor([fingerprint, int(os.environ.get("GROUP_RANK", 0))], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(everyone, mine)
    odd = [(rank, int(pair[1])) for rank, pair in enumerate(everyone) if int(pair[0]) != int(everyone[0][0])]
    if odd:
        rank, node = odd[0]
        raise UserError(f"plan: node {node} (rank {rank}) was started with another plan than rank 0's (node "
                        f"{int(everyone[0][1])}): a different recipe, micro-batch, seed or batch split; start every "
                        "node with the same command")


def barrier(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.barrier()


def reduced(world: World, value: float, op: dist.ReduceOp, device: torch.device, dtype: torch.dtype = torch.int64
            ) -> float:
    """`value` reduced by `op` over every rank (every rank gets the same answer); NCCL reduces CUDA tensors only."""
    if not world.distributed:
        return value
    tensor = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def all_min(world: World, value: int, device: torch.device) -> int:
    """The smallest `value` over all ranks (every rank agrees on one micro-batch, so none runs out of memory)."""
    return int(reduced(world, value, dist.ReduceOp.MIN, device))


def any_rank(world: World, flag: bool, device: torch.device) -> bool:
    """Whether `flag` is true on any rank."""
    return bool(reduced(world, int(flag), dist.ReduceOp.MAX, device))


def abandon(world: World) -> None:
    """Leave the process group when this rank stops alone, so the others' pending collectives fail at once
    instead of waiting."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


PEER_FAILURE_WORDS = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL")


def peer_failed(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank left (gloo raises a plain RuntimeError)."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(word in str(error) for word in PEER_FAILURE_WORDS)
    )


class SyncCounter:
    """A DDP communication hook: all-reduce the gradient buckets as a SUM (each loss is already divided
    by the window's global count; DDP's default would average, dividing by the world size once too often), and count
    the synchronisations at bucket 0: metrics.jsonl's `grad_syncs`, 1 per step with `no_sync`. FSDP2 sums itself
    (fsdp.py) and calls `fsdp_hook` once per round."""

    def __init__(self) -> None:
        self.rounds = 0

    def hook(self, state, bucket):
        if bucket.index() == 0:
            self.rounds += 1
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda done: done.value()[0])

    def fsdp_hook(self, reduced: torch.Tensor) -> None:
        """Called by FSDP2 after one module's reduce-scatter (`set_all_reduce_hook` on one module): one round."""
        self.rounds += 1

    def take(self) -> int:
        rounds, self.rounds = self.rounds, 0
        return rounds
