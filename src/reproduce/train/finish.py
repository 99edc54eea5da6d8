"""The end of a finished training run (trainer.train's last part): model.pt, the LoRA adapter (and merged
model), the loss plot and summary.json, each written whole, and the reporter's last word."""

from __future__ import annotations

import json
import signal
import time

import torch

from ..errors import Interrupted
from ..models.weights import peft_model, save_adapter, save_merged
from ..observe.outputs import plot_metrics
from ..storage import faults, signals
from ..storage.files import replace_folder, write_atomic, write_torch_file
from .checkpoint import full_model_state
from .distributed import processes as distributed
from .records import run_summary
from .reporter import run_end
from .resume import kept_summary
from .run_state import Run


def finish_run(run: Run) -> dict:
    """summary.json and model.pt (rank 0), the LoRA adapter (and merged model) as users load them, the loss plot, and
    the reporter's last word. A signal meanwhile lets the file being written finish, then stops before the next one
    (`stop_in_end`): the checkpoint of the last step is whole, and the resume writes the end again."""
    # as the last checkpoint holds it (a resume that writes the end again: the uninterrupted run's, byte for byte)
    summary = run.summary if run.summary is not None else kept_summary(run.resumed.state) if (
        run.resumed.rebuild) else None
    summary = summary if summary is not None else run_summary(run, time.perf_counter() - run.started)
    with signals.deferred():
        faults.at("end")
        model_state = full_model_state(run.setup)  # FSDP: gathered from every rank's shards
        if run.world.is_main:  # each written whole or not at all; summary.json last, as it names the others
            stop_in_end(run, "model.pt")
            write_torch_file(run.out / "model.pt", lambda handle: torch.save(model_state, handle))
            stop_in_end(run, "adapter/" if peft_model(run.setup.unwrapped_model) is not None else "loss.svg")
            summary.update(save_trained(run, model_state))
            stop_in_end(run, "loss.svg")
            summary["plot"] = plot_metrics(run.out / "metrics.jsonl", run.out / "loss.svg")
            stop_in_end(run, "summary.json")
            write_atomic(run.out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    distributed.barrier(run.world)
    run.reporter.finish(run_end(summary, run.out, run.request.skip_nonfinite))  # the end's lines, as data
    return summary


def stop_in_end(run: Run, next_file: str) -> None:
    """After a signal while the run's end is written: stop before `next_file`, with the command that writes the end
    again from the last checkpoint (a resume at the last step)."""
    received = signals.take()
    if received is None:
        return
    out = run.out
    raise Interrupted(
        f"{signal.Signals(received).name} while the run's end was written, before {out / next_file}; the checkpoint "
        f"after optimizer step {run.total} of {run.total} is whole, and a resume writes the end again. Continue "
        "with: " + run.continue_with,
        signals.EXIT_CODES[received],
    )


def save_trained(run: Run, model_state: dict) -> dict:
    """adapter/ (peft's save_pretrained) with LoRA, and merged/ with --merged (models/weights.py): summary.json's
    `adapter` and `merged`, the folders' paths. `model_state`: model.pt's (FSDP: gathered), the adapters' source."""
    model, recipe, written = run.setup.unwrapped_model, run.plan.recipe, {}
    if peft_model(model) is not None:  # each folder built beside its place, then put there (storage/files.py)
        replace_folder(run.out / "adapter", lambda folder: save_adapter(model, folder, recipe, model_state))
        written["adapter"] = str(run.out / "adapter")
    if run.request.merged:  # (after adapter/: on a quantised base, merged from it)
        replace_folder(run.out / "merged", lambda folder: save_merged(model, folder, recipe, run.out / "adapter"))
        written["merged"] = str(run.out / "merged")
    return written
