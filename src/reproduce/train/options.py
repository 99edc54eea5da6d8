"""`RunRequest`: what `reproduce run` was asked, the one value of its options from the command line to
the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..plan.overlay import Change


def option(default: object = None, *, torchrun: bool = True, resume: bool = False) -> Any:
    """A field of RunRequest. `torchrun`: each torchrun process is given it again; `resume`: the command that
    continues the run repeats it."""
    return field(default=default, metadata={"torchrun": torchrun, "resume": resume})


@dataclass(frozen=True)
class RunRequest:
    """One field per option, named as the option's parameter (`from_gate` is `--from`, `overrides`
    `--set`; alias options are `changes`); a field at its default was not given. A library caller:
    `train(plan, RunRequest(out, device="cpu"))`."""

    out: Path
    source: Path | None = None  # the plan or recipe file (None: a library caller's plan)
    max_steps: int | None = option(resume=True)  # stop after this optimizer step, counted from the run's start
    micro_batch_max: int | None = option(resume=True)
    workers: int | None = option(resume=True)  # DataLoader processes; None: `data.loader.default_workers`
    device: str = option("auto", resume=True)  # "auto", "cpu", "cuda", "cuda:1", ...
    seed: int | None = option(resume=True)  # None: the recipe's (on resume: the run's own)
    checkpoint_every: int | None = option(resume=True)  # optimizer steps; None: every few minutes of wall time
    log_to: tuple[str, ...] = option((), resume=True)
    skip_nonfinite: bool = option(False, resume=True)  # skip a step whose loss or gradient is not finite
    no_noise_scale: bool = option(False, resume=True)  # do not measure the gradient noise scale (observe/noise.py)
    stop_on_divergence: bool = option(False, resume=True)  # stop at the divergence warning instead of going on
    merged: bool = option(False, resume=True)  # also write merged/: LoRA's adapters merged into the base
    world_size: int = option(1, torchrun=False)
    policy: str = option("exact")
    resume: bool = option(False)  # continue the run in `out` from its checkpoint
    auto_resume: bool = option(False)
    max_restarts: int | None = option(torchrun=False)
    force: bool = option(False)  # replace another run's outputs in `out`
    nproc_per_node: int | None = option(torchrun=False)
    nnodes: str = option("1", torchrun=False)
    node_rank: int = option(0, torchrun=False)
    rdzv_endpoint: str | None = option(torchrun=False)
    memory: str | None = option()
    gpu: str | None = option()
    meter: str = option("auto")
    headroom: float = option(0.1)
    no_cache: bool = option(False)
    changes: tuple[Change, ...] = option(())  # the recipe fields its options set (data.path: --data, ...)
    overrides: tuple[str, ...] = option(())  # --set FIELD.PATH=VALUE
    accept_gate: tuple[str, ...] = option(())  # gates whose miss goes on (train/gates.py)
    from_gate: str | None = option()  # --from: with resume, the gate whose kept checkpoint the run starts from
    reference: tuple[str, ...] = option((), resume=True)  # earlier runs' curves (observe/reference.py)

    def given(self, which: str) -> dict[str, object]:
        """The fields given (not at their default) that `which` ("torchrun" or "resume") repeats."""
        given = {}
        for item in fields(self):
            value = getattr(self, item.name)
            at_default = value is None or value is False or value == () or (
                type(value) is type(item.default) and value == item.default)
            if item.metadata.get(which) and item.name != "changes" and not at_default:
                given[item.name] = value
        return given
