"""A `train` call's run: what it holds while it runs (`Run`, updated by each step); its start (`start_run`): the
plan checked against the world, the model and data built, the checkpoint loaded on --resume, plan.yaml written, the
notes and the start reported; each step's metrics record (`step_record`); and its end (`finish_run`: model.pt, the
adapter and merged model, the loss plot, summary.json), each written whole."""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..data import training_set
from ..data.batches import DataClock, LazyMicroBatch
from ..data.loader import LoaderWatch, MicroBatchStream, default_workers, fetch_seeded
from ..data.packing import Grouped, Grouping, grouping_of, sample_lengths
from ..errors import Interrupted, UserError
from ..models import count_parameters
from ..models.hf import check_packed
from ..models.varlen import runs_varlen
from ..models.weights import check_merged, peft_model, save_adapter, save_merged
from ..observe.noise import NoiseScale, not_measured_reason, summarise
from ..observe.outputs import MetricsLog, plot_metrics, read_metrics
from ..observe.rates import StepRates
from ..observe.reference import DivergenceWatch
from ..plan.gates import planned_gates
from ..plan.planfile import plan_to_yaml
from ..plan.planner import Plan
from ..plan.reported import compare_reported
from ..plan.segments import batch_phases, length_sizes
from ..storage import signals
from ..storage.files import WriteFailed, replace_folder, write_atomic, write_torch_file
from .distributed import processes as distributed
from .distributed.processes import World
from .gates import resume_source, start_gates
from .optim.optimizers import check_plateau
from .options import RunRequest
from .reporter import Reporter, StepRecord, run_end, run_start
from .resume import Resumed, earlier_segments, full_model_state, kept_summary, resume_run
from .setup import Setup, build, resolve_device
from .step import StepResult
from .windows import StepBatch, grouping_line, micro_batch_at, padding_over, step_epoch, window

if TYPE_CHECKING:
    from ..data import Datasets

COUNTERS = ("samples", "tokens", "partial_windows", "skipped_nonfinite", "out_of_memory")  # this call's, summed


@dataclass(kw_only=True)
class Run:
    """A run in progress; what it is made of. Its plan and world are its setup's."""

    out: Path
    request: RunRequest
    reporter: Reporter
    setup: Setup
    train_set: Any
    size: int  # the training set's samples
    total: int  # the optimizer step this call stops after
    resumed: Resumed
    noise: NoiseScale | None
    metrics: MetricsLog
    rates: StepRates
    noise_scale_skipped_because: str | None  # why the run cannot measure it; None: it can, or was told not to
    totals_before_resume: dict  # seconds, samples and tokens of the calls before this one (zeros for a fresh run)
    divergence: DivergenceWatch
    started: float = field(default_factory=time.perf_counter)  # at the first step
    last_checkpoint: float = field(default_factory=time.perf_counter)  # at the last checkpoint (or the start)
    waited: float = 0.0  # seconds the steps waited for data
    counters: dict = field(default_factory=functools.partial(dict.fromkeys, COUNTERS, 0))
    last_record: dict = field(default_factory=dict)
    stream: MicroBatchStream | None = None
    grouping: Grouping | None = None  # data.packing sorted / packed (data/packing.py)
    lengths: torch.Tensor | None = None  # each sample's input tokens, when the data has them (text)
    summary: dict | None = None  # summary.json as computed at the last step (kept in its checkpoint)
    gates: Any = None  # the recipe's gates as the run checks them (train/gates.py); None without gates
    reference: Any = None  # the reference runs' curve (observe/reference.py); None without
    continue_with: str = ""  # the command an interrupted run prints to go on (`train`'s)

    plan: Plan = field(init=False)  # the setup's
    world: World = field(init=False)  # the setup's
    seed: int = field(init=False)  # the resumed run's (data order and dropout)
    lowered: dict = field(init=False)  # sequence length -> the micro-batch an out-of-memory error lowered it to
    workers: int = field(init=False)  # DataLoader processes: as asked, or one per free core for data read from files
    watch: LoaderWatch = field(init=False)  # the data loader's watch: a warning when the steps wait for data

    def __post_init__(self) -> None:
        self.plan, self.world = self.setup.plan, self.setup.world
        self.seed, self.lowered = self.resumed.seed, self.resumed.lowered
        self.workers = default_workers(self.train_set) if self.request.workers is None else self.request.workers
        self.watch = LoaderWatch(self.workers)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoints" / "last.pt"

    def last_checkpoint_note(self, good: bool = False) -> str:
        """`the last (good) checkpoint is PATH`, or that there is none yet (a stop before the first checkpoint)."""
        if self.checkpoint_path.is_file():
            return f"the last {'good ' if good else ''}checkpoint is {self.checkpoint_path}"
        return "no checkpoint was written yet"

    def micro_batch(self, step: int) -> int:
        """Step `step`'s micro-batch: its batch phase's, or as lowered after running out of memory."""
        return micro_batch_at(self.plan, step, self.lowered)

    def windows(self, step: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's micro-batches of `step` and whether the window is partial (the loop's and the
        loader's)."""
        return window(self.plan, self.size, step, self.seed, self.world.rank, self.micro_batch(step), self.grouping)

    def open_stream(self, step: int) -> None:
        self.stream = MicroBatchStream(self.train_set, lambda at: self.windows(at)[0], step, self.total,
                                       seed=self.seed, workers=self.workers,
                                       pin_memory=self.setup.device.type == "cuda")

    def micro_batches(self, step: int, indices: list, clock: DataClock) -> list[LazyMicroBatch]:
        """The window's micro-batches, fetched from the stream as the step loads them."""
        take = functools.partial(self.stream.take, step)
        # (a micro-batch fetched here with the loader's draws at `step`, to count its targets)
        drawn = functools.partial(fetch_seeded, self.train_set, seed=self.seed, step=step)
        return [LazyMicroBatch(self.train_set, i, self.setup.device, self.setup.dtype, take, clock, step, self.seed,
                               drawn) for i in indices]


def start_run(plan: Plan, request: RunRequest, world: World, data: Datasets | None, reporter: Reporter,
              dtype: torch.dtype, continue_with: str) -> Run:
    """The run, built (see the module's docstring)."""
    out = Path(request.out)
    if world.size != plan.world_size:
        raise UserError(f"plan: world_size is {plan.world_size}, but this job has {world.size} process(es)")
    seed = plan.recipe.seed if request.seed is None else request.seed
    target_device = resolve_device(request.device)
    if world.distributed:  # this rank's device in the process group; every rank runs rank 0's plan
        target_device = distributed.init(world, target_device)
        distributed.check_same_plan(world, distributed.plan_fingerprint(plan, seed), target_device)
        distributed.barrier(world)  # every rank has looked at --out before rank 0 writes to it
    setup = build(plan, target_device, dtype, seed, data, world)
    if request.merged:  # a model with nothing to merge: one line before any step
        check_merged(setup.unwrapped_model, plan.recipe, setup.sharded)
    check_plateau(plan, setup.data)
    # batch phases of other sequence lengths read the same data cut at their length (data.training_set)
    train_set = training_set(plan.recipe, setup.data.train, list(length_sizes(plan.segments)))
    size = check_training_set(plan, train_set)
    train_set, grouping, lengths = group_training_set(plan, setup, train_set)
    max_steps = request.max_steps
    total = plan.optimizer_steps if max_steps is None else min(max_steps, plan.optimizer_steps)
    noise = NoiseScale(setup) if not request.no_noise_scale and not setup.sharded else None
    checkpoint = resume_source(out, request.from_gate, planned_gates(plan)) if request.from_gate else None
    resumed = resume_run(plan, out, setup, noise, seed, request.seed, total, max_steps, checkpoint) if (
        request.resume) else Resumed(seed)
    rates = StepRates(plan, setup, world.size)
    if plan.recipe.model.factory is not None:  # counted before anything is written: a forward whose output no loss
        rates.count()  # takes is refused there (built-ins and Hugging Face models are counted at the first step)
    rates.counted_length = int(lengths.max()) if lengths is not None and len(lengths) else None
    if world.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / "plan.yaml", plan_to_yaml(plan).encode("utf-8"))
        except OSError as error:
            raise WriteFailed(out / "plan.yaml", error) from None
    metrics = MetricsLog(out / "metrics.jsonl", resumed.metrics, enabled=world.is_main)
    if metrics.repaired:
        reporter.message(f"note: {metrics.repaired}")
    if resumed.rebuild:
        reporter.message(f"note: the run has run all {total} steps, but {resumed.rebuild}: writing its end again "
                         f"from {out / 'checkpoints' / 'last.pt'}")
    for note in [*setup.notes, *rates.notes]:
        reporter.message(f"note: {note}")
    # each segment's micro-batches per rank, as the run takes them (a micro-batch lowered after running out of memory)
    accumulations = [-(-(segment.effective_batch // plan.world_size)
                       // micro_batch_at(plan, segment.start_step, resumed.lowered)) for segment in plan.segments]
    noise_skipped = (not_measured_reason(world.size, max(accumulations), setup.sharded)
                     if not request.no_noise_scale else None)
    if noise_skipped:
        reporter.message(f"note: noise scale not measured: {noise_skipped}")
    if grouping is not None:  # the way this run groups, and what it pads (data/packing.py)
        reporter.message(grouping_line(plan, grouping, resumed.seed, resumed.first_step))
    signals.fault_at("start")  # (the tests' exact point: set up, plan.yaml written, no step yet)
    parameters = count_parameters(setup.unwrapped_model)
    reporter.start(run_start(plan, total, resumed.first_step, parameters))  # the start's lines, as data
    # (a resume at the last step: its record is the end's `final`)
    before_resume, divergence, last = earlier_segments(out, resumed.state, resumed.first_step)
    setup.model.train()
    # (its clocks start now: checkpoints every K steps when asked, else every CHECKPOINT_SECONDS, and at the end)
    run = Run(out=out, request=request, reporter=reporter, setup=setup, train_set=train_set, size=size,
              total=total, resumed=resumed, noise=noise, metrics=metrics, rates=rates,
              noise_scale_skipped_because=noise_skipped, totals_before_resume=before_resume, divergence=divergence,
              grouping=grouping, lengths=lengths, continue_with=continue_with, last_record=last)
    start_gates(run)  # the recipe's gates (train/gates.py): a gate the run paused at is checked again here
    return run


def group_training_set(plan: Plan, setup, train_set) -> tuple:
    """data.packing sorted / packed: the training set grouped, the grouping, and each sample's
    input tokens (kept for text without grouping too, for the padding the metrics count)."""
    grouping = grouping_of(plan.recipe, train_set, plan.micro_batch, varlen=runs_varlen(setup.unwrapped_model))
    if grouping is None:
        lengths = None
        if plan.recipe.task == "language-modeling" and (hasattr(train_set, "input_lengths")
                                                          or isinstance(train_set, (list, tuple))):
            with contextlib.suppress(UserError):  # not token sequences: no padding to count
                lengths = sample_lengths(train_set)
        return train_set, None, lengths
    if grouping.way == "packed":  # attention confined to each sample, or one line before any step
        with setup.autocast():  # (as the steps run it: a bf16 base under autocast)
            check_packed(setup.unwrapped_model, setup.device)
    return Grouped(train_set, grouping), grouping, grouping.lengths


def check_training_set(plan: Plan, train_set) -> int:
    """The training set's size, when it is the one the plan was made for and its epoch holds an optimizer step."""
    size = len(train_set)
    sizes = train_set.sizes() if hasattr(train_set, "sizes") else {plan.recipe.batch.sequence_length: size}
    if sizes != length_sizes(plan.segments):
        raise UserError(f"plan: the phases' dataset sizes {length_sizes(plan.segments)} do not match the training "
                        f"set's {sizes} (samples by sequence length)" if batch_phases(plan.segments) else
                        f"plan: dataset_size {plan.dataset_size} does not match the training set's {size} items")
    short = [s for s in plan.segments if not s.steps_per_epoch and s.steps != 0]
    if short:
        raise UserError(
            f"data: the epoch ({short[0].dataset_size} {plan.unit}) is shorter than one optimizer step "
            f"({short[0].effective_batch}) with drop_last: no step would run; lower the batch or set "
            "data.drop_last: false"
        )
    return size


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
        signals.fault_at("end")
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
