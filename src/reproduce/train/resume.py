"""Resuming a run: the state its checkpoint hands back, and what the run did before this call."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..observe.noise import NoiseScale
from ..observe.outputs import read_metrics
from ..observe.reference import DivergenceWatch
from ..plan.planner import Plan
from ..plan.segments import batch_phase
from ..plan.trained_with import changed_fields
from .checkpoint import kept_metrics, load_checkpoint
from .run_end import end_problem
from .setup import Setup


@dataclass
class Resumed:
    """Where a run starts: step 0 of a fresh run, or the step its checkpoint was written after."""

    seed: int  # the data order and dropout streams: the run's own on resume
    first_step: int = 0
    metrics: bytes | int | None = None  # metrics.jsonl at the checkpoint (or its length: `kept_metrics`)
    lowered: dict = field(default_factory=dict)  # sequence length -> the micro-batch an out-of-memory error set
    state: dict | None = None  # the checkpoint's (None for a fresh run)
    rebuild: str | None = None  # at the last step: the end of the run to write again, and why


def resume_run(plan: Plan, out: Path, setup: Setup, noise: NoiseScale | None, seed: int, asked_seed: int | None,
               total: int, max_steps: int | None, checkpoint: Path | None = None) -> Resumed:
    """Load `out`'s checkpoint (last.pt, or `checkpoint`: a gate's) into `setup` (and `noise`), and check the run
    has steps left to run."""
    state = load_checkpoint(setup, checkpoint or out / "checkpoints" / "last.pt",
                            lambda saved: check_same_plan(saved, plan, out))
    if noise is not None and state["extra"].get("noise_scale"):
        noise.load_state_dict(state["extra"]["noise_scale"])
    first_step, rebuild = state["step"], None
    saved_seed = state["extra"].get("seed", seed)
    if asked_seed is not None and asked_seed != saved_seed:
        raise UserError(f"the run in {out} was started with seed {saved_seed} (got {asked_seed})", field="seed")
    if first_step >= total:
        rebuild = end_problem(out, state) if first_step == total else None  # checked, not trusted (run_end.py)
        if rebuild is None:  # (a resume past its --max-steps never rewrites the run's end)
            raise UserError(already_run(out, first_step, total, max_steps, plan.optimizer_steps))
    # the run had lowered the micro-batch after running out of memory (by sequence length)
    lowered = {int(k) if k != "None" else None: v for k, v in state["extra"].get("lowered", {}).items()}
    saved_micro_batch = state.get("micro_batch")  # without extra["lowered"], the only trace of a lowered one
    if "lowered" not in state["extra"] and saved_micro_batch and batch_phase(plan.segments, 0) is None and (
            saved_micro_batch < plan.micro_batch and plan.per_rank_batch % saved_micro_batch == 0):
        lowered = {plan.recipe.batch.sequence_length: saved_micro_batch}
    return Resumed(saved_seed, first_step, kept_metrics(state), lowered, state, rebuild)


def check_same_plan(state: dict, plan: Plan, out: Path) -> None:
    """A resumed run trains the plan its checkpoint was trained with: one line naming every field that changes the
    computation and differs (plan/trained_with.py). A checkpoint written before it kept its plan is not checked."""
    recorded = state.get("extra", {}).get("plan")
    if not isinstance(recorded, str):
        return
    changed = changed_fields(recorded, plan)
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise UserError(f"{out / 'plan.yaml'} differs from the plan {out / 'checkpoints' / 'last.pt'} was trained "
                        f"with: {shown}; a resumed run trains its checkpoint's plan: put plan.yaml back as it was "
                        "(the micro-batch and the processes have their own options: `micro_batch_max`, "
                        "`nproc_per_node`), or start a new run with the new plan", field="resume")


def already_run(out: Path, first_step: int, total: int, max_steps: int | None, planned: int | None) -> str:
    """Why a resume has nothing to do; with --max-steps (counted from the start of the run), the value that goes on."""
    if max_steps is not None and planned is not None and first_step < planned:
        more = min(first_step + max_steps, planned)
        return (f"`max_steps`: {out} has already run {first_step} of {total} optimizer steps; `max_steps` counts "
                f"from the start of the run (of {planned} steps): to run {more - first_step} more, give "
                f"`max_steps` {more}")
    return f"`resume`: {out} has already run {first_step} of {total} optimizer steps; nothing to do"


def last_record(out: Path, state: dict | None, first_step: int) -> dict:
    """The record of the checkpoint's step (summary.json's `final` when a resume only writes the run's end again):
    kept in the checkpoint, or read from metrics.jsonl when the checkpoint has none."""
    if state is None:
        return {}
    if "last_record" in state["extra"]:
        return state["extra"]["last_record"]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and r.get("step") == first_step]
    return records[-1] if records else {}


def earlier_segments(out: Path, state: dict | None, first_step: int) -> tuple[dict, DivergenceWatch]:
    """What the run did before this call (seconds, samples, tokens; zeros for a fresh run) and its divergence
    watch, from the checkpoint, or from metrics.jsonl when it has no `run_totals` or `divergence`."""
    totals = {"seconds": 0.0, "samples": 0, "tokens": 0}
    if state is None:
        return totals, DivergenceWatch()
    extra = state["extra"]
    records = None
    if "run_totals" in extra:
        totals.update(extra["run_totals"])
    else:
        records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and r.get("step", 0) <= first_step]
        totals = {"seconds": sum(r.get("seconds", 0.0) for r in records),
                  "samples": sum(r.get("samples", 0) for r in records),
                  "tokens": sum(r.get("tokens", 0) for r in records)}
    if "divergence" in extra:
        watch = DivergenceWatch()
        watch.load_state_dict(extra["divergence"])
        return totals, watch
    if records is None:
        records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and r.get("step", 0) <= first_step]
    return totals, DivergenceWatch.from_records(records)
