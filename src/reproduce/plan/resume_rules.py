"""The resume rules: what a run continued with `reproduce run --resume` keeps from the run it continues, and how a
plan is re-derived for another number of processes, a smaller micro-batch or the data's size. Values in, values
out; a request that would change the run raises UserError naming the option. Pure Python, no torch."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .packing import kept_grouping
from .planner import Plan, make_plan
from .recipe import FileData
from .segments import PerLength
from .weightfiles import data_fingerprint, fingerprint_of, inspect


def replan(saved: Plan, world_size: int, micro_batch: int | None, dataset_size: PerLength,
           source: Path | str) -> Plan:
    """The same effective batch and schedule on another number of processes, or with a smaller micro-batch (a
    resumed run that ran out of memory; None: keep the plan's), or with the dataset's size when the plan was made
    without it: N and the steps per epoch are re-derived. With batch phases each sequence
    length keeps its own micro-batch, lowered to `micro_batch` where that is smaller."""
    cap = micro_batch or saved.micro_batch
    per_length = {s.sequence_length: min(s.micro_batch, micro_batch or s.micro_batch) for s in saved.segments}
    micro = per_length if len(per_length) > 1 else cap  # one micro-batch per sequence length the plan reads
    again = make_plan(kept_grouping(saved.recipe), micro, world_size, saved.policy, dataset_size=dataset_size,
                      recipe_path=saved.recipe_path, weights=saved.weights, data_fingerprint=saved.data_fingerprint)

    def kept(p: Plan) -> dict[str, object]:
        """What a re-derived plan must keep of the saved one; made without the data, its steps were not known,
        only its batches."""
        if saved.dataset_size is None:
            return {"effective_batch": p.effective_batch, "segments": [s.effective_batch for s in p.segments]}
        return {"effective_batch": p.effective_batch, "steps_per_epoch": p.steps_per_epoch,
                "optimizer_steps": p.optimizer_steps, "warmup_steps": p.warmup_steps,
                "decay_milestones": p.schedule.decay_milestones,
                "segments": [(s.start_step, s.steps, s.effective_batch) for s in p.segments]}

    # what the saved plan could not know (made without the data: `reproduce plan --out`) comes from the data now
    if any(value is not None and kept(again)[field] != value for field, value in kept(saved).items()):
        raise UserError(
            f"{source}: world_size: the plan ({saved.arithmetic}"  # (a schedule never known: no `None steps`)
            f"{f', {saved.optimizer_steps} steps' if saved.optimizer_steps is not None else ''}) cannot be kept "
            f"on {world_size} processes with micro-batch {cap}; plan again for {world_size}"
        )
    return again


def check_resumed_weights(saved: Plan, out: Path) -> None:
    """A resumed run continues from the weights it started from, with the content the fingerprint in its plan.yaml
    says."""
    ran = saved.recipe.model.weights
    if saved.weights is None or ran is None:
        return
    if not Path(ran).exists():
        raise UserError(f"`resume`: the run in {out} started from the weights {ran}, which are no longer there")
    now = fingerprint_of(inspect(ran))
    if now != saved.weights.fingerprint:
        raise UserError(f"`resume`: the weights {ran} changed since the run in {out} started (fingerprint "
                        f"{saved.weights.fingerprint} in its plan.yaml, {now} now); resume it with the weights it "
                        "started from, or start a new run")


def check_resumed_data(saved: Plan, out: Path) -> None:
    """A resumed run reads the data files it started on, unchanged since (the fingerprint in its plan.yaml)."""
    data = saved.recipe.data
    if saved.data_fingerprint is None or not isinstance(data, FileData):
        return
    now = data_fingerprint(data.files)
    if now != saved.data_fingerprint:
        raise UserError(f"`resume`: the data {data.path} changed since the run in {out} started (fingerprint "
                        f"{saved.data_fingerprint} in its plan.yaml, {now} now); resume it on the data it started "
                        "on, or start a new run")
