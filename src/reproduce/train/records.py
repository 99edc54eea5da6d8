"""What a run writes besides its checkpoints: each step's metrics record, and its end (model.pt, the
adapter and merged model, the loss plot, summary.json), each written whole.
"""

from __future__ import annotations

import json
import signal
import time

import torch

from ..data.batches import DataClock
from ..errors import Interrupted
from ..models.weights import peft_model, save_adapter, save_merged
from ..observe.noise import summarise
from ..observe.outputs import plot_metrics, read_metrics
from ..plan.reported import compare_reported
from ..storage import faults, signals
from ..storage.files import replace_folder, write_atomic, write_torch_file
from .distributed import processes as distributed
from .reporter import StepRecord, run_end
from .resume import full_model_state, kept_summary
from .run_state import Run
from .step import StepResult
from .windows import StepBatch, padding_over, step_epoch


def step_record(run: Run, step: int, batch: StepBatch, lr: float, result: StepResult, accumulation: int,
                partial: bool, tick: float, clock: DataClock) -> StepRecord:
    """Step `step`'s record (its evaluation and gates come after), saying the loader's warnings."""
    world, main = run.world, run.world.is_main
    record = StepRecord(
        step=step + 1, epoch=round(step_epoch(run.plan, step), 6), lr=lr, loss=result.loss,
        grad_norm=result.grad_norm, samples=result.samples, tokens=result.tokens, items=result.count,
        micro_batch=run.micro_batch(step), accumulation_steps=accumulation, micro_batches=accumulation,
        world_size=world.size, partial=partial, skipped=not result.finite,
        seconds=round(time.perf_counter() - tick, 6), data_seconds=round(clock.seconds, 6),
        peak_memory_bytes=(int(torch.cuda.max_memory_allocated(run.setup.device))
                           if run.setup.device.type == "cuda" else None))
    if run.lengths is not None:  # input tokens, and those computed with padding, over every rank (data/packing.py)
        _, useful, computed = padding_over(run.plan, range(step, step + 1), run.seed, run.lengths, run.grouping,
                                           run.micro_batch(step))
        record.padding = {"useful_tokens": useful, "padded_tokens": computed}
    if batch.phase is not None:  # before the rates: a phase's tokens per second are at its own length
        record.phase = {"phase": batch.phase + 1, "effective_batch": batch.effective_batch,
                        "sequence_length": batch.sequence_length}
    record.rates = run.rates.fields(record.line(),
                                    say=lambda note: run.reporter.message(f"note: {note}") if main else None)
    slow_loader = run.watch.update(step + 1, clock.seconds, record.seconds)
    if slow_loader and main:
        run.reporter.message(slow_loader)
    record.grad_syncs = result.grad_syncs
    record.noise = result.noise or {}
    return record


def run_summary(run: Run, elapsed: float) -> dict:
    """summary.json: the whole run (every call before a resume too), then what this call ran."""
    plan, counters, before, divergence = run.plan, run.counters, run.totals_before_resume, run.divergence
    whole = {key: before[key] + (elapsed if key == "seconds" else counters[key]) for key in before}
    summary = {
        "steps": run.total,
        "planned_steps": plan.optimizer_steps,
        "resumed_from_step": run.resumed.first_step,
        "arithmetic": plan.arithmetic,
        "exact": plan.exact,
        "world_size": run.world.size,
        "final": run.last_record,
        "seconds": round(whole["seconds"], 3),  # the whole run: every segment before a resume too
        "samples_per_second": round(whole["samples"] / whole["seconds"], 2) if whole["seconds"] > 0 else None,
        # what this call ran (the whole run unless it resumed)
        "this_call": {"steps": run.total - run.resumed.first_step, "samples": counters["samples"],
                      "tokens": counters["tokens"], "seconds": round(elapsed, 3),
                      "samples_per_second": round(counters["samples"] / elapsed, 2) if elapsed > 0 else None},
        "workers": run.workers,
        "data_seconds": round(run.waited, 3),
        "data_share": round(run.waited / elapsed, 4) if elapsed > 0 else None,
        "window_policy": "drop_last" if plan.recipe.data.drop_last else "partial windows normalised by their items",
        **counters,
        "samples": whole["samples"],
        "tokens": whole["tokens"],
        "divergence": divergence.diverged,
        "reported": compare_reported(plan.recipe, run.last_record, run.total, plan.optimizer_steps),
        "data": run.setup.data.info,
        "notes": run.setup.notes,
    }
    if run.gates is not None:  # each gate at its step and what the run measured there (train/gates.py)
        summary["gates"] = run.gates.summary()
    if run.reference is not None:  # the curve against the reference runs' (observe/reference.py)
        summary["reference"] = run.reference.summary()
    if plan.batchnorm is not None:  # the BatchNorm choice and the BN batch it gave, against the paper's
        summary["batchnorm"] = plan.batchnorm.model_dump(include={"mode", "paper_mode", "layers", "run_batch",
                                                             "paper_batch", "micro_batch", "processes"})
    if run.world.is_main:  # from metrics.jsonl, read once: the steps before a resume count too
        records = read_metrics(run.out / "metrics.jsonl")
        if not run.request.no_noise_scale:
            summary["noise_scale"] = summarise(records, run.total, plan.recipe.task,
                                               reason=run.noise_scale_skipped_because, warmup_steps=plan.warmup_steps,
                                               diverged=divergence.diverged,
                                               train_size=run.noise.population if run.noise else None)
        summary["throughput"] = run.rates.summary(records)  # medians of each step's rates
        padded = sum(r.get("padded_tokens", 0) for r in records if "step" in r and "event" not in r)
        if padded:
            useful = sum(r.get("useful_tokens", 0) for r in records if "step" in r and "event" not in r)
            summary["packing"] = run.plan.recipe.data.packing or "none"
            summary["padding_fraction"] = round(1 - useful / padded, 6)
    return summary


def finish_run(run: Run) -> dict:
    """The run's end (rank 0 writes) and the reporter's last word. A signal meanwhile lets the file being
    written finish, then stops before the next (`stop_in_end`); a resume writes the end again."""
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
    """After a signal while the end is written: stop before `next_file`, with the command that writes
    it again."""
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
    """adapter/ with LoRA and merged/ with --merged (models/weights.py): summary.json's `adapter` and
    `merged`. `model_state`: model.pt's, the adapters' source."""
    model, recipe, written = run.setup.unwrapped_model, run.plan.recipe, {}
    if peft_model(model) is not None:  # each folder built beside its place, then put there (storage/files.py)
        replace_folder(run.out / "adapter", lambda folder: save_adapter(model, folder, recipe, model_state))
        written["adapter"] = str(run.out / "adapter")
    if run.request.merged:  # (after adapter/: on a quantised base, merged from it)
        replace_folder(run.out / "merged", lambda folder: save_merged(model, folder, recipe, run.out / "adapter"))
        written["merged"] = str(run.out / "merged")
    return written
