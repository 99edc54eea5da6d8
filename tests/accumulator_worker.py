"""`reproduce.Accumulator` in a plain PyTorch loop, and the one-pass large-batch loop it must equal: a tiny
language model in float64 on token sequences of unequal lengths (padding targets -100), so the windows' token counts
differ between micro-batches and ranks, and the epoch ends in a partial window.

Run by tests/torch/test_accumulate.py in-process (one rank), and under torchrun with two processes (gloo, DDP):

    python -m torch.distributed.run --nproc-per-node=2 --standalone tests/accumulator_worker.py OUT.pt

Rank 0 saves each window's accumulated gradient, the final weights and the gradient reductions DDP ran to OUT.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import reproduce

VOCAB, WIDTH, LENGTH = 11, 6, 7
SEQUENCES = 22  # windows of 8: 8, 8 and a partial last window of 6
WINDOW = 8
MICRO_BATCH = 3
LR, CLIP = 0.5, 0.05  # the clip binds: the accumulated gradient's norm must be the large batch's


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (float64, seeded) and the sequences: targets after each one's own length are -100."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (SEQUENCES,), generator=generator)
    targets = torch.roll(tokens, -1, dims=1)
    targets[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    torch.manual_seed(0)
    return TinyLM().double(), tokens, targets


def summed_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


def tokens_of(targets: torch.Tensor) -> int:
    return int((targets != -100).sum())


def optimizer_of(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = KeepGradients(model.parameters(), lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class KeepGradients(torch.optim.SGD):
    """SGD that keeps a copy of each step's gradient (after clipping) before stepping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:  # Lightning's: the last micro-batch's forward and backward, its hooks, the clip
            with torch.enable_grad():
                loss = closure()
        self.kept.append([p.grad.detach().clone() for group in self.param_groups for p in group["params"]])
        super().step()
        return loss


def windows() -> list[torch.Tensor]:
    """Each optimizer step's sequence indices, in order: the last window is partial."""
    return list(torch.split(torch.arange(SEQUENCES), WINDOW))


def one_pass() -> tuple[list[list[torch.Tensor]], dict]:
    """The plain large-batch loop: one forward over each window, the mean loss over its tokens, clip, step."""
    model, tokens, targets = model_and_data()
    optimizer, scheduler = optimizer_of(model)
    for indices in windows():
        loss = summed_loss(model, tokens[indices], targets[indices]) / tokens_of(targets[indices])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return optimizer.kept, model.state_dict()


def accumulated(rank: int = 0, world_size: int = 1, wrap=None) -> tuple[list[list[torch.Tensor]], dict]:
    """The same windows with the library's window: this rank's share of each, in micro-batches of MICRO_BATCH."""
    model, tokens, targets = model_and_data()
    optimizer, scheduler = optimizer_of(model)
    trained = wrap(model) if wrap else model
    acc = reproduce.Accumulator(trained, optimizer, scheduler=scheduler, clip_grad_norm=CLIP)
    for indices in windows():
        share = torch.tensor_split(indices, world_size)[rank]
        micro_batches = list(torch.split(share, MICRO_BATCH))
        with acc.window([tokens_of(targets[m]) for m in micro_batches]) as window:
            for m in micro_batches:
                window.backward(summed_loss(trained, tokens[m], targets[m]))
    return optimizer.kept, model.state_dict()


def main(out: str) -> None:
    """Twice: DDP as users wrap it (its default hook averages the ranks' gradients), and DDP with a hook that sums
    them and counts the reductions (as `reproduce run` does)."""
    torch.distributed.init_process_group("gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    reductions = []

    def summing(state, bucket):  # every gradient reduction DDP runs, counted
        reductions.append(bucket.index())
        future = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
        return future.then(lambda done: done.value()[0])

    def with_hook(model: nn.Module) -> nn.Module:
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, summing)
        return ddp

    averaged = accumulated(rank, world_size, nn.parallel.DistributedDataParallel)
    summed = accumulated(rank, world_size, with_hook)
    if rank == 0:
        torch.save({"averaged": averaged, "summed": summed, "reductions": reductions}, out)
    torch.distributed.barrier()  # both ranks done before either tears gloo down (else a rank may abort at exit)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(sys.argv[1])
