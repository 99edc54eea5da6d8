"""Resuming a run: the state its checkpoint hands back, and what the run did before this call; and a finished
run's end, checked against its last checkpoint rather than trusted.

The last checkpoint of a run is written after its last step, before its end (model.pt, loss.svg, summary.json), and
holds what that end is made of: the model, metrics.jsonl (`metrics`) and summary.json itself (`extra["summary"]`,
computed there: trainer.checkpoint_or_stop). So `end_problem` can tell whether the end on disk is the run's, file by
file (cut, garbled, `{}`, valid JSON with other content, another model), and a resume at the last step writes what
differs again, byte for byte what the uninterrupted run wrote (finish.finish_run). A checkpoint written before it
kept the summary gets the older check (`outputs.missing_final_outputs`: present, of its step, whole).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..observe.noise import NoiseScale
from ..observe.outputs import loss_document, missing_final_outputs, read_metrics
from ..observe.reference import DivergenceWatch
from ..plan.planfile import changed_fields
from ..plan.planner import Plan
from ..storage.files import check_torch_file
from .checkpoint import kept_metrics, load_checkpoint, read_torch_file
from .setup import Setup

END_FIELDS = ("adapter", "merged", "plot")  # what finish_run adds to the checkpoint's summary: paths under --out


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
        rebuild = end_problem(out, state) if first_step == total else None  # checked, not trusted
        if rebuild is None:  # (a resume past its --max-steps never rewrites the run's end)
            raise UserError(already_run(out, first_step, total, max_steps, plan.optimizer_steps))
    # the run had lowered the micro-batch after running out of memory (by sequence length)
    lowered = {int(k) if k != "None" else None: v for k, v in state["extra"].get("lowered", {}).items()}
    saved_micro_batch = state.get("micro_batch")  # without extra["lowered"], the only trace of a lowered one
    if "lowered" not in state["extra"] and saved_micro_batch and not plan.has_phases and (
            saved_micro_batch < plan.micro_batch and plan.per_rank_batch % saved_micro_batch == 0):
        lowered = {plan.recipe.batch.sequence_length: saved_micro_batch}
    return Resumed(saved_seed, first_step, kept_metrics(state), lowered, state, rebuild)


def check_same_plan(state: dict, plan: Plan, out: Path) -> None:
    """A resumed run trains the plan its checkpoint was trained with: one line naming every field that changes the
    computation and differs (plan/planfile.py). A checkpoint written before it kept its plan is not checked."""
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


def kept_summary(state: dict | None) -> dict | None:
    """summary.json as the run's last checkpoint computed it (without the END_FIELDS), or None when it has none."""
    kept = (state or {}).get("extra", {}).get("summary")
    return json.loads(kept) if isinstance(kept, str) else None


def end_problem(out: Path, state: dict) -> str | None:
    """What of the end of the finished run in `out` differs from what its last checkpoint (`state`) says it is, in a
    few words naming the file; None when it is all the run's."""
    step, summary = state["step"], kept_summary(state)
    metrics, kept = out / "metrics.jsonl", kept_metrics(state)
    if isinstance(kept, bytes):
        held = metrics.read_bytes() if metrics.is_file() else None
        if held != kept:
            return f"{metrics} is " + ("missing" if held is None else "not the run's: the checkpoint's copy differs")
    if summary is None:
        problem = missing_final_outputs(out, step)
        return problem if problem is not None else _model_problem(out, state)
    path = out / "summary.json"
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as error:
        return f"{path} is damaged: {str(error).splitlines()[0]}"
    if not isinstance(written, dict) or _canonical({k: v for k, v in written.items() if k not in END_FIELDS}) != (
            _canonical(summary)):
        return f"{path} is not the run's: it differs from the summary its checkpoint holds"
    problem = _model_problem(out, state)
    if problem:
        return problem
    plot = written.get("plot")
    if isinstance(plot, str) and plot.endswith(".svg"):
        svg = out / Path(plot).name
        if not svg.is_file():
            return f"{svg} is missing"
        if isinstance(kept, bytes) and svg.read_bytes() != loss_document(kept).encode("utf-8"):
            return f"{svg} is not the run's loss plot: it differs from the plot of the checkpoint's metrics"
    return next((f"{out / name} is missing" for name in ("adapter", "merged")
                 if written.get(name) and not (out / name).exists()), None)


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _model_problem(out: Path, state: dict) -> str | None:
    """model.pt damaged, or holding other weights than the checkpoint's model (a sharded run's checkpoint holds none:
    then its seal alone is checked)."""
    model = out / "model.pt"
    if not model.is_file():
        return f"{model} is missing"
    damaged = check_torch_file(model)
    if damaged:
        return f"{model} is {damaged}"
    expected = state.get("model")
    if expected is None:
        return None
    try:
        held = read_torch_file(model, "model.pt")
    except UserError as error:
        return str(error)
    same = held.keys() == expected.keys() and all(_same_tensor(held[k], expected[k]) for k in expected)
    return None if same else f"{model} holds other weights than the run's last checkpoint"


def _same_tensor(a: object, b: object) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:  # bitwise (a NaN is its own bits)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return torch.equal(a, b)


def finished_state(out: Path, max_steps: int | None, planned: int | None) -> tuple[str, str]:
    """For --auto-resume, from the run's last checkpoint (never its summary.json): `finished` (it ran to --max-steps,
    else the plan's last step, and its end is the run's), or `unfinished` (steps to run, an end to write again, or a
    checkpoint the resume must judge), with a few words."""
    try:
        state = read_torch_file(out / "checkpoints" / "last.pt", "`resume`")
        step = int(state["step"])
    except (UserError, KeyError, TypeError, ValueError):
        return "unfinished", "a checkpoint to continue from"
    total = planned if max_steps is None or planned is None else min(max_steps, planned)
    if total is None or step < total:
        return "unfinished", "a checkpoint to continue from"
    if step == total:
        problem = end_problem(out, state)
        if problem is not None:
            return "unfinished", f"a finished run whose end is not whole ({problem})"
    return "finished", f"{step} of {planned} optimizer steps run"
