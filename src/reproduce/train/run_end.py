"""The end of a finished run, checked against its last checkpoint rather than trusted.

The last checkpoint of a run is written after its last step, before its end (model.pt, loss.svg, summary.json), and
holds what that end is made of: the model, metrics.jsonl (`metrics`) and summary.json itself (`extra["summary"]`,
computed there: trainer.checkpoint_or_stop). So `end_problem` can tell whether the end on disk is the run's, file by
file (cut, garbled, `{}`, valid JSON with other content, another model), and a resume at the last step writes what
differs again, byte for byte what the uninterrupted run wrote (finish.finish_run). A checkpoint written before it
kept the summary gets the older check (`outputs.missing_final_outputs`: present, of its step, whole).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..observe.outputs import loss_document, missing_final_outputs
from ..storage.files import check_torch_file
from .checkpoint import kept_metrics, read_torch_file

END_FIELDS = ("adapter", "merged", "plot")  # what finish_run adds to the checkpoint's summary: paths under --out


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
