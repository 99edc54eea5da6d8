"""The training run: the plan's optimizer steps, checkpoints, metrics, signals and out-of-memory handling.

Each optimizer step is `step.optimizer_step` over the window `windows.window` gives it; everything a run
needs is built by `setup.build`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.batches import DataClock
from ..data.lengths import training_set
from ..data.loader import cpu_share, default_workers
from ..data.packing import Grouped, grouping_of, sample_lengths
from ..errors import Interrupted, TrainingStopped, UserError
from ..models import count_parameters
from ..models.hf import check_packed
from ..models.trained import check_merged, peft_model, save_adapter, save_merged
from ..models.varlen import runs_varlen
from ..observe.noise import NoiseScale, not_measured_reason
from ..observe.outputs import MetricsLog, check_out_dir, plot_metrics, read_metrics, run_outputs
from ..observe.rates import StepRates
from ..plan import trained_with
from ..plan.gates import planned_gates
from ..plan.planfile import plan_to_yaml
from ..plan.planner import Plan
from ..plan.segments import batch_phases, length_sizes
from ..plan.sharding import check_sharding
from ..storage import faults, lock, signals
from ..storage.aside import Previous, setting_aside, settle
from ..storage.files import WriteFailed, replace_folder, write_text, write_torch_file
from .checkpoint import full_model_state, save_checkpoint
from .distributed import processes as distributed
from .distributed.processes import World
from .evaluation import evaluate_step, evaluation_due
from .gates import after_checkpoint, check_gates, resume_source, start_gates, tell_gates
from .optim.plateau import check_plateau
from .options import RunRequest
from .records import run_summary, step_record
from .reporter import Reporter, SilentReporter, run_end, run_start
from .resume import Resumed, earlier_segments, last_record, resume_run
from .run_end import kept_summary
from .run_state import Run
from .setup import build, resolve_device
from .step import AgreedOutOfMemory, OptimizerStepOutOfMemory, StepResult, optimizer_step
from .windows import StepBatch, grouping_line, micro_batch_at, smaller_micro_batch, step_batch

if TYPE_CHECKING:
    from ..data import Datasets

__all__ = ["Reporter", "RunRequest", "SilentReporter", "StopSignals", "read_metrics", "train"]

CHECKPOINT_SECONDS = 300.0


class StopSignals:
    """SIGINT / SIGTERM set a flag; the loop finishes its optimizer step, checkpoints, and stops. The handlers are
    the command's (storage/signals.py: deferred here), or installed for the loop alone (a library caller)."""

    EXIT_CODES = signals.EXIT_CODES

    def __init__(self) -> None:
        self.sections: list = []

    @property
    def received(self) -> int | None:
        return signals.pending()

    def __enter__(self) -> StopSignals:
        self.sections = [signals.guard(), signals.deferred()]
        for section in self.sections:
            section.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for section in reversed(self.sections):
            section.__exit__(None, None, None)
        self.sections = []

    def agreed(self, world: World, device: torch.device, due: bool = False) -> tuple[int | None, bool]:
        """The signal any rank received, and whether any rank's checkpoint is due: all ranks stop, and save (a
        sharded checkpoint needs every rank), after the same step."""
        if not world.distributed:
            return self.received, due
        flags = torch.tensor([self.received or 0, int(due)], dtype=torch.int64, device=device)  # NCCL: CUDA only
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return int(flags[0]) or None, bool(flags[1])


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 4_099 + rank * 7_919_993) % (2**63 - 1)


def seed_step(device: torch.device, value: int) -> None:
    """Seed the generators this run draws from (torch.manual_seed also visits every backend: ~100x slower)."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)


def train(plan: Plan, request: RunRequest, *, data: Datasets | None = None, reporter: Reporter | None = None,
          dtype: torch.dtype = torch.float32, continue_with: str | None = None) -> dict:
    """Run `plan`, writing plan.yaml, metrics.jsonl, checkpoints/last.pt, model.pt and summary.json to `request.out`.

    `request` (train/options.py): the run's options as `reproduce run` was given them (device, max_steps, resume,
    seed, workers, ...). `data`: the datasets (None: built from the recipe); `reporter`: None is silent;
    `continue_with`: the command an interrupted run prints to go on (None: its plan.yaml resumed).
    The library's entry: `request.out` taken (storage/lock.py), settled and checked here, then `train_checked`.
    """
    world, out, reporter = distributed.world_from_env(), Path(request.out), reporter or SilentReporter()
    owner = lock.owns_the_run(world.distributed, world.rank)
    with lock.hold(out) if owner else contextlib.nullcontext():
        note = settle(out, run_outputs(out)) if owner else None  # what a killed --force left
        if note:
            reporter.message(f"note: {note}")
        check_sharding(plan.recipe, world.size)
        check_out_dir(out, request.resume, request.force)
        return train_checked(plan, request, world, data=data, reporter=reporter, dtype=dtype,
                             continue_with=continue_with)


def train_checked(plan: Plan, request: RunRequest, world: World, *, data: Datasets | None = None,
                  reporter: Reporter | None = None, dtype: torch.dtype = torch.float32,
                  continue_with: str | None = None) -> dict:
    """Run `plan` in `request.out`, which the caller holds, has settled and checked (`train`, or `reproduce run`).

    Under torchrun every rank trains its share of each window; rank 0 alone writes. A rank that
    leaves with an error leaves the process group too, so the other ranks' collectives fail at once and they stop
    with a message of their own instead of waiting for it.
    """
    out = Path(request.out)
    continue_with = continue_with or f"reproduce run {out / 'plan.yaml'} --out {out} --resume"
    try:
        return _train(plan, request, world, data, reporter or SilentReporter(), dtype, continue_with)
    except WriteFailed as error:  # one line: a full disk stops with exit code 3 and the command that goes on
        distributed.abandon(world)
        checkpoint = (out / "checkpoints" / "last.pt").is_file()
        raise error.said(continue_with if checkpoint else None) from None
    except RuntimeError as error:
        if world.distributed and distributed.peer_failed(error):
            distributed.abandon(world)
            stopped = TrainingStopped(
                f"rank {world.rank}: a collective with the other ranks failed ({str(error).splitlines()[0]}): "
                "another rank stopped, and its message says why"
            )
            stopped.peer = True  # type: ignore[attr-defined]  (a launcher says another rank's ending first)
            raise stopped from None
        distributed.abandon(world)
        raise
    except BaseException:
        distributed.abandon(world)
        raise


def _train(plan: Plan, request: RunRequest, world: World, data: Datasets | None, reporter: Reporter,
           dtype: torch.dtype, continue_with: str) -> dict:
    # --force: the previous run's outputs stay aside until this run's first checkpoint, and come back if anything
    # fails or a signal stops it before then; a new run stopped by a signal while starting leaves the folder as it
    # found it (storage/aside.py)
    out = Path(request.out)
    checkpoint = out / "checkpoints" / "last.pt"
    with setting_aside(out, run_outputs(out), not request.resume and world.is_main,
                       committed=checkpoint.is_file) as previous:
        # the model and data, the resumed state, the run folder
        run = start_run(plan, request, world, data, reporter, dtype, continue_with)
        _train_steps(run, previous)
    return finish_run(run)


def _train_steps(run: Run, previous: Previous | None) -> None:
    plan, request = run.plan, run.request
    setup, stop, restore = run.setup, StopSignals(), cpu_compute(run)
    try:
        stop.__enter__()
        run.open_stream(run.resumed.first_step)
        for step in range(run.resumed.first_step, run.total):
            tick = time.perf_counter()
            # Dropout and other random draws of step s come from (seed, s, rank) alone: a resumed run draws what
            # the uninterrupted one did, and ranks draw independently of each other.
            seed_step(setup.device, step_seed(run.seed, step, setup.rank))
            lr = setup.optimizer.param_groups[0]["lr"]
            clock = DataClock()
            batch = step_batch(plan, step)  # with batch phases: this step's N and sequence length
            start_batch_phase(run, step, batch)
            while True:  # until the window fits: each out-of-memory error halves the micro-batch
                indices, partial = run.windows(step)
                micro_batches = run.micro_batches(step, indices, clock)
                try:
                    result = optimizer_step(setup, micro_batches, run.noise)
                    break
                except OptimizerStepOutOfMemory as error:
                    raise TrainingStopped(optimizer_step_out_of_memory(run, step, error)) from None
                except torch.OutOfMemoryError as error:
                    agreed = not run.world.distributed or isinstance(error, AgreedOutOfMemory)
                # The error is gone with its except block, and with it the failed window's frames (activations,
                # inputs); its micro-batches go too before the memory is freed.
                del micro_batches
                recover_from_out_of_memory(run, step, batch, agreed)
            count_step(run, step, result, partial, clock)
            record = step_record(run, step, batch, lr, result, len(micro_batches), partial, tick, clock)
            diverging = watch_divergence(run, step, result)
            done = step + 1 == run.total
            if evaluation_due(setup, step + 1, done):  # the eval split's metrics, and the plateau decay's step
                evaluate_into(run, step, record, done)
            gates = check_gates(run, step, record)  # the gates at this step (train/gates.py)
            run.metrics.write(record)
            run.last_record = record
            run.reporter.step(record)
            tell_gates(run, gates)
            if diverging and request.stop_on_divergence:  # its step logged; the checkpoint before it kept
                raise TrainingStopped(f"{diverging}; stopped (--stop-on-divergence); {run.last_checkpoint_note()}")
            checkpoint_or_stop(run, stop, step, done, gate=bool(gates))
            if previous is not None and run.checkpoint_path.is_file():  # a checkpoint of its own: the previous go
                previous.started()
                previous = None
            after_checkpoint(run, gates)  # each gate's checkpoint kept; a pause gate stops here, exit status 4
    finally:
        close_run(run, stop, restore)


def start_run(plan: Plan, request: RunRequest, world: World, data: Datasets | None, reporter: Reporter,
              dtype: torch.dtype, continue_with: str) -> Run:
    """Check the plan against the world; build the model and data; load the checkpoint on --resume; write
    plan.yaml; report the notes and the start."""
    out = Path(request.out)
    if world.size != plan.world_size:
        raise UserError(f"plan: world_size is {plan.world_size}, but this job has {world.size} process(es)")
    seed = plan.recipe.seed if request.seed is None else request.seed
    target_device = distributed.init(world, resolve_device(request.device))
    distributed.check_same_plan(world, distributed.plan_fingerprint(plan, seed), target_device)
    distributed.barrier(world)  # every rank has looked at --out before rank 0 writes to it
    setup = build(plan, target_device, dtype, seed, data, world)
    if request.merged:  # a model with nothing to merge: one line before any step
        check_merged(setup.unwrapped_model, plan.recipe, setup.sharded)
    check_plateau(plan, setup.data)
    # batch phases of other sequence lengths read the same data cut at their length (data/lengths.py)
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
            write_text(out / "plan.yaml", plan_to_yaml(plan))
        except OSError as error:
            raise WriteFailed(out / "plan.yaml", error) from None
    metrics = MetricsLog(out / "metrics.jsonl", resumed.metrics, enabled=world.is_main)
    if metrics.repaired:
        reporter.message(f"note: {metrics.repaired}")
    if resumed.rebuild:
        reporter.message(f"note: the run has run all {total} steps, but {resumed.rebuild}: writing its end again "
                         f"from {out / 'checkpoints' / 'last.pt'}")
    for note in setup.notes:
        reporter.message(f"note: {note}")
    for note in rates.notes:
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
    faults.at("start")  # (the tests' exact point: set up, plan.yaml written, no step yet)
    parameters = count_parameters(setup.unwrapped_model)
    reporter.start(run_start(plan, total, resumed.first_step, parameters))  # the start's lines, as data
    before_resume, divergence = earlier_segments(out, resumed.state, resumed.first_step)
    setup.model.train()
    # (its clocks start now: checkpoints every K steps when asked, else every CHECKPOINT_SECONDS, and at the end)
    run = Run(out=out, request=request, reporter=reporter, setup=setup, train_set=train_set, size=size,
              total=total, resumed=resumed, noise=noise, metrics=metrics, rates=rates,
              noise_scale_skipped_because=noise_skipped, totals_before_resume=before_resume, divergence=divergence,
              grouping=grouping, lengths=lengths, continue_with=continue_with)
    run.last_record = last_record(out, resumed.state, resumed.first_step)  # (a resume at the last step: the end's)
    start_gates(run)  # the recipe's gates (train/gates.py): a gate the run paused at is checked again here
    return run


def group_training_set(plan: Plan, setup, train_set) -> tuple:
    """data.packing sorted / packed: the training set as those micro-batches collate it, the grouping, and each
    sample's input tokens (also kept for text with `none`, for the padding the metrics count)."""
    grouping = grouping_of(plan.recipe, train_set, plan.micro_batch, varlen=runs_varlen(setup.unwrapped_model))
    if grouping is None:
        lengths = None
        if plan.recipe.task == "language-modeling" and (hasattr(train_set, "input_lengths")
                                                          or isinstance(train_set, (list, tuple))):
            try:
                lengths = sample_lengths(train_set)
            except UserError:  # not token sequences: no padding to count
                lengths = None
        return train_set, None, lengths
    if grouping.way == "packed":  # attention confined to each sample, or one line before any step
        with setup.autocast():  # (as the steps run it: a bf16 base under autocast)
            check_packed(setup.unwrapped_model, setup.device)
    return Grouped(train_set, grouping), grouping, grouping.lengths


def cpu_compute(run: Run) -> Callable[[], None]:
    """Set the CPU's compute for the run; returns what sets it back."""
    # On a CPU, values below float32's normal range (late in training, in momentum and gradients) make every
    # operation on them ~100x slower; flushing them to zero cost a digits run 3.5 s instead of 72 s.
    flush_denormals = run.setup.device.type == "cpu" and torch.set_flush_denormal(True)
    data_workers = default_workers(run.train_set)
    # Training on the CPU from files read by loader workers: the compute threads get the cores the default workers
    # leave. OpenMP threads that outnumber free cores spin against each other: the digits MLP's 5 ms step took
    # 0.9 s beside one worker decoding PNGs on 2 cores. The count follows the data, not --workers, so runs with
    # different worker counts (a resume with fewer) compute with the same threads and stay bitwise equal.
    threads = torch.get_num_threads()
    if run.setup.device.type == "cpu" and data_workers:
        torch.set_num_threads(max(1, min(threads, cpu_share() - data_workers)))

    def restore() -> None:
        if flush_denormals:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads)

    return restore


def start_batch_phase(run: Run, step: int, batch: StepBatch) -> None:
    """With batch phases: say where a phase starts, and give the noise scale its training set's size."""
    plan = run.plan
    if batch.phase is not None and (step == run.resumed.first_step or plan.segments[batch.phase].start_step == step):
        run.reporter.message(f"step {step + 1}: batch {batch.effective_batch} = micro {batch.micro_batch} x "
                             f"accumulation {batch.accumulation_steps} x world {plan.world_size}"
                             + (f", sequence length {batch.sequence_length}" if batch.sequence_length else ""))
    if run.noise is not None and batch.phase is not None:  # each sequence length's own training set
        run.noise.dataset_size = plan.segments[batch.phase].dataset_size or run.size


def optimizer_step_out_of_memory(run: Run, step: int, error: OptimizerStepOutOfMemory) -> str:
    then = (f"--resume from {run.checkpoint_path}" if run.checkpoint_path.is_file() else
            "start the run again (no checkpoint was written yet)")
    return (f"out of memory in the optimizer step itself at optimizer step {step + 1}, after the window's gradients "
            f"were accumulated ({error}); lower --micro-batch-max or free memory, then {then}")


def recover_from_out_of_memory(run: Run, step: int, batch: StepBatch, agreed: bool) -> None:
    """After an out-of-memory error in a window: free what is left, halve the micro-batch and double N (the
    effective batch stays exact), and reopen the stream at `step`. Under several processes only when every rank
    agreed (the vote in step.optimizer_step); a rank alone stops."""
    setup, plan, micro_batch = run.setup, run.plan, run.micro_batch(step)
    run.stream.close()  # its prefetched micro-batches are of the old size
    setup.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    if not agreed:  # this rank alone: it stops, and leaves the process group (see train)
        raise TrainingStopped(out_of_memory_alone(setup, step, micro_batch, run.out))
    per_rank_batch = batch.effective_batch // plan.world_size  # this step's (batch phases)
    smaller = smaller_micro_batch(per_rank_batch, micro_batch)
    if smaller is None:
        raise TrainingStopped(
            f"out of memory at optimizer step {step + 1} with micro-batch {micro_batch}: no smaller micro-batch "
            f"keeps the effective batch exact; {run.last_checkpoint_note(good=True)}"
        )
    run.counters["out_of_memory"] += 1
    run.metrics.write({"event": "out_of_memory", "step": step + 1, "micro_batch": smaller,
                       "accumulation_steps": per_rank_batch // smaller, "was": micro_batch})
    run.reporter.message(
        f"out of memory at step {step + 1}: micro-batch {micro_batch} -> {smaller}, accumulation "
        f"{per_rank_batch // micro_batch} -> {per_rank_batch // smaller}; redoing the window"
    )
    run.lowered[batch.sequence_length] = smaller
    run.open_stream(step)


def count_step(run: Run, step: int, result: StepResult, partial: bool, clock: DataClock) -> None:
    """Add the step to the run's counters; a non-finite step stops the run unless it is skipped."""
    if not result.finite:
        if not run.request.skip_nonfinite and not run.setup.scaler:
            raise TrainingStopped(
                f"non-finite loss or gradient at optimizer step {step + 1} (loss {result.loss}, "
                f"grad norm {result.grad_norm}); {run.last_checkpoint_note(good=True)}"
            )
        run.counters["skipped_nonfinite"] += 1
    run.counters["samples"] += result.samples
    run.counters["tokens"] += result.tokens
    run.counters["partial_windows"] += partial
    run.waited += clock.seconds


def watch_divergence(run: Run, step: int, result: StepResult) -> str | None:
    """The divergence watch's warning at this step, reported by rank 0."""
    diverging = run.divergence.update(step + 1, result.loss)
    if diverging and run.world.is_main:
        run.reporter.message(f"warning: {diverging}" + ("" if run.request.stop_on_divergence else
                                                       " (the run goes on; --stop-on-divergence stops it)"))
    return diverging


def evaluate_into(run: Run, step: int, record: dict, done: bool) -> None:
    """The evaluation after `step` into its record (train/evaluation.py); a plateau decay's new LR reported."""
    record.update(evaluate_step(run.setup, step + 1, run.micro_batch(step), run.workers, run.world.is_main))
    if "plateau_lr" in record and not done:
        run.reporter.message(f"step {step + 1}: {run.plan.recipe.schedule.decay.metric} has not improved: plateau "
                             f"decay, lr -> {record['plateau_lr']:.6g} from step {step + 2}")


def checkpoint_or_stop(run: Run, stop: StopSignals, step: int, done: bool, gate: bool = False) -> None:
    """Write the checkpoint when due (every K steps, every CHECKPOINT_SECONDS, at the end, at a gate, or on a signal
    any rank received); after a signal, stop with the command that continues the run."""
    setup, request = run.setup, run.request
    due = (step + 1) % request.checkpoint_every == 0 if request.checkpoint_every else (
        time.perf_counter() - run.last_checkpoint >= CHECKPOINT_SECONDS)
    received, due = stop.agreed(run.world, setup.device, due) if not done else (None, due)
    if due or done or received or gate:
        now = time.perf_counter()
        if done:  # summary.json, kept in the last checkpoint: a lost or damaged end is written again as it was
            run.summary = run_summary(run, now - run.started)
        extra = {"seed": run.seed, "micro_batch": run.micro_batch(step),
                 "lowered": {str(length): value for length, value in run.lowered.items()}}
        if run.noise is not None:
            extra["noise_scale"] = run.noise.state_dict()
        extra["run_totals"] = {"seconds": run.totals_before_resume["seconds"] + now - run.started,
                               "samples": run.totals_before_resume["samples"] + run.counters["samples"],
                               "tokens": run.totals_before_resume["tokens"] + run.counters["tokens"]}
        extra["divergence"] = run.divergence.state_dict()
        extra["last_record"] = run.last_record
        extra["plan"] = trained_with.as_record(run.plan)  # a resume refuses another plan (plan/trained_with.py)
        if run.summary is not None:
            extra["summary"] = json.dumps(run.summary)  # (train/run_end.py)
        if run.gates is not None:
            extra["gates"] = run.gates.state_dict()
        save_checkpoint(setup, run.checkpoint_path, step + 1, bytes(run.metrics.kept), extra)
        run.last_checkpoint = time.perf_counter()
    if received:
        distributed.barrier(run.world)
        signals.take()
        raise Interrupted(
            f"{signal.Signals(received).name} after optimizer step {step + 1} of {run.total}; checkpoint "
            f"written to {run.checkpoint_path}. Continue with: "
            + run.continue_with,
            StopSignals.EXIT_CODES[received],
        )


def close_run(run: Run, stop: StopSignals, restore: Callable[[], None]) -> None:
    if run.stream is not None:
        run.stream.close()
    stop.__exit__()
    run.metrics.close()
    if run.noise is not None:
        run.noise.close()
    restore()


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
            write_text(run.out / "summary.json", json.dumps(summary, indent=2) + "\n")
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
        StopSignals.EXIT_CODES[received],
    )


def save_trained(run: Run, model_state: dict) -> dict:
    """adapter/ (peft's save_pretrained) with LoRA, and merged/ with --merged (models/trained.py): summary.json's
    `adapter` and `merged`, the folders' paths. `model_state`: model.pt's (FSDP: gathered), the adapters' source."""
    model, recipe, written = run.setup.unwrapped_model, run.plan.recipe, {}
    if peft_model(model) is not None:  # each folder built beside its place, then put there (storage/files.py)
        replace_folder(run.out / "adapter", lambda folder: save_adapter(model, folder, recipe, model_state))
        written["adapter"] = str(run.out / "adapter")
    if run.request.merged:  # (after adapter/: on a quantised base, merged from it)
        replace_folder(run.out / "merged", lambda folder: save_merged(model, folder, recipe, run.out / "adapter"))
        written["merged"] = str(run.out / "merged")
    return written


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


def out_of_memory_alone(setup, step: int, micro_batch: int, out: Path) -> str:
    """Why this rank stops alone, and how to continue with a smaller micro-batch."""
    if setup.sharded:
        why = "FSDP gathers parameters in every forward and backward, so the other ranks wait in those collectives"
    elif setup.model.will_sync_module_buffers():
        why = "DDP broadcasts the model's buffers (BatchNorm statistics) in every forward"
    else:
        why = "it was the window's last micro-batch, whose gradients DDP reduces over the ranks"
    smaller = smaller_micro_batch(setup.plan.per_rank_batch, micro_batch)
    how = (f"; continue with a smaller micro-batch, launched as before: reproduce run {out / 'plan.yaml'} --out {out} "
           f"--resume --micro-batch-max {smaller}") if smaller else ""
    return (
        f"out of memory on rank {setup.world.rank} at optimizer step {step + 1} with micro-batch {micro_batch}; the "
        f"ranks cannot agree on a smaller one there ({why}), so the run stops; the last good checkpoint is "
        f"{out / 'checkpoints' / 'last.pt'}{how}"
    )
