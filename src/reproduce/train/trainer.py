"""The training run: the plan's optimizer steps (`step.optimizer_step` over `windows.window`), checkpoints,
metrics, signals and out-of-memory handling; its start is `run_state.start_run`, its end `run_state.finish_run`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..accumulate import AgreedOutOfMemory, OptimizerStepOutOfMemory, free_memory, smaller_micro_batch
from ..data.batches import DataClock
from ..data.loader import cpu_share, default_workers
from ..errors import Interrupted, TrainingStopped
from ..observe.outputs import check_out_dir, read_metrics, run_outputs
from ..plan.planfile import as_record
from ..plan.planner import Plan
from ..plan.sharding import check_sharding
from ..storage import lock, signals
from ..storage.aside import Previous, setting_aside, settle
from ..storage.files import WriteFailed
from .distributed import processes as distributed
from .distributed.processes import World
from .evaluation import evaluate_after, evaluation_due
from .gates import after_checkpoint, check_gates, tell_gates
from .optim.optimizers import step_plateau
from .options import RunRequest
from .reporter import Reporter, SilentReporter, StepRecord
from .resume import save_checkpoint
from .run_state import Run, finish_run, run_summary, start_run, step_record
from .step import StepResult, optimizer_step
from .windows import StepBatch, step_batch

if TYPE_CHECKING:
    from ..data import Datasets

__all__ = ["Reporter", "RunRequest", "SilentReporter", "read_metrics", "train"]

CHECKPOINT_SECONDS = 300.0


def train(plan: Plan, request: RunRequest, *, data: Datasets | None = None, reporter: Reporter | None = None,
          dtype: torch.dtype = torch.float32) -> dict:
    """Run `plan`, writing plan.yaml, metrics.jsonl, checkpoints/last.pt, model.pt and summary.json to
    `request.out` (taken, settled and checked here: the library's entry). `data`: None builds the recipe's;
    `reporter`: None is silent; an interrupted run prints its plan.yaml resumed."""
    world, out, reporter = distributed.world_from_env(), Path(request.out), reporter or SilentReporter()
    owner = lock.owns_the_run(world.distributed, world.rank)
    with lock.hold(out) if owner else contextlib.nullcontext():
        note = settle(out, run_outputs(out)) if owner else None  # what a killed --force left
        if note:
            reporter.message(f"note: {note}")
        check_sharding(plan.recipe, world.size)
        check_out_dir(out, request.resume, request.force)
        return train_checked(plan, request, world, data=data, reporter=reporter, dtype=dtype)


def train_checked(plan: Plan, request: RunRequest, world: World, *, data: Datasets | None = None,
                  reporter: Reporter | None = None, dtype: torch.dtype = torch.float32,
                  continue_with: str | None = None) -> dict:
    """Run `plan` in `request.out`, which the caller holds and has checked. Under torchrun rank 0 alone
    writes; a rank that leaves with an error leaves the process group, so the others' collectives fail at once."""
    out = Path(request.out)
    continue_with = continue_with or f"reproduce run {out / 'plan.yaml'} --out {out} --resume"
    checkpoint = out / "checkpoints" / "last.pt"
    try:
        # --force: the previous run's outputs stay aside until this run's first checkpoint, and come back if it
        # fails or is stopped before then (storage/aside.py)
        with setting_aside(out, run_outputs(out), not request.resume and world.is_main,
                           committed=checkpoint.is_file) as previous:
            run = start_run(plan, request, world, data, reporter or SilentReporter(), dtype, continue_with)
            _train_steps(run, previous)
        return finish_run(run)
    except BaseException as error:
        distributed.abandon(world)
        if isinstance(error, WriteFailed):  # one line: a full disk stops with exit code 3 and the command that goes on
            raise error.said(continue_with if checkpoint.is_file() else None) from None
        if isinstance(error, RuntimeError) and world.distributed and distributed.peer_failed(error):
            stopped = TrainingStopped(
                f"rank {world.rank}: a collective with the other ranks failed ({str(error).splitlines()[0]}): "
                "another rank stopped, and its message says why"
            )
            stopped.peer = True  # type: ignore[attr-defined]  (a launcher says another rank's ending first)
            raise stopped from None
        raise


def _train_steps(run: Run, previous: Previous | None) -> None:
    plan, request = run.plan, run.request
    # SIGINT / SIGTERM set a flag: the loop finishes its optimizer step, checkpoints, and stops
    setup, stop, restore = run.setup, contextlib.ExitStack(), cpu_compute(run)
    try:
        stop.enter_context(signals.guard())
        stop.enter_context(signals.deferred())
        run.open_stream(run.resumed.first_step)
        for step in range(run.resumed.first_step, run.total):
            tick = time.perf_counter()
            # step s's random draws (dropout) come from (seed, s, rank) alone, so a resume draws what the whole run
            # did (torch.manual_seed also visits every backend: ~100x slower)
            seed = (run.seed * 1_000_003 + step * 4_099 + setup.world.rank * 7_919_993) % (2**63 - 1)
            torch.default_generator.manual_seed(seed)
            if setup.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            lr = setup.optimizer.param_groups[0]["lr"]
            clock = DataClock()
            batch = step_batch(plan, step)  # with batch phases: this step's N and sequence length
            if batch.phase is not None:  # say where a phase starts; the noise scale gets its own training set's size
                if step == run.resumed.first_step or plan.segments[batch.phase].start_step == step:
                    run.reporter.message(
                        f"step {step + 1}: batch {batch.effective_batch} = micro {batch.micro_batch} x accumulation "
                        f"{batch.accumulation_steps} x world {plan.world_size}"
                        + (f", sequence length {batch.sequence_length}" if batch.sequence_length else ""))
                if run.noise is not None:
                    run.noise.dataset_size = plan.segments[batch.phase].dataset_size or run.size
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
                # the error and the failed window's frames are gone with the except block; its micro-batches too
                del micro_batches
                recover_from_out_of_memory(run, step, batch, agreed)
            count_step(run, step, result, partial, clock)
            record = step_record(run, step, batch, lr, result, len(micro_batches), partial, tick, clock)
            diverging = watch_divergence(run, step, result)
            done = step + 1 == run.total
            if evaluation_due(setup, step + 1, done):  # the eval split's metrics, and the plateau decay's step
                evaluate_into(run, step, record, done)
            gates = check_gates(run, step, record)  # the gates at this step (train/gates.py)
            run.last_record = record.line()
            run.metrics.write(run.last_record)
            run.reporter.step(record)
            tell_gates(run, gates)
            if diverging and request.stop_on_divergence:  # its step logged; the checkpoint before it kept
                raise TrainingStopped(f"{diverging}; stopped (`stop_on_divergence`); {run.last_checkpoint_note()}")
            checkpoint_or_stop(run, step, done, gate=bool(gates))
            if previous is not None and run.checkpoint_path.is_file():  # a checkpoint of its own: the previous go
                previous.started()
                previous = None
            after_checkpoint(run, gates)  # each gate's checkpoint kept; a pause gate stops here, exit status 4
    finally:
        if run.stream is not None:
            run.stream.close()
        stop.close()
        run.metrics.close()
        if run.noise is not None:
            run.noise.close()
        restore()


def cpu_compute(run: Run) -> Callable[[], None]:
    """Set the CPU's compute for the run; returns what sets it back."""
    # denormal floats (late in training) make CPU operations ~100x slower: a digits run 3.5 s flushed, 72 s not
    flush_denormals = run.setup.device.type == "cpu" and torch.set_flush_denormal(True)
    data_workers = default_workers(run.train_set)
    # the compute threads get the cores the default loader workers leave (OpenMP threads on busy cores spin: a 5 ms
    # step took 0.9 s); by the data, not --workers, so runs with other worker counts stay bitwise equal
    threads = torch.get_num_threads()
    if run.setup.device.type == "cpu" and data_workers:
        torch.set_num_threads(max(1, min(threads, cpu_share() - data_workers)))

    def restore() -> None:
        if flush_denormals:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads)

    return restore


def optimizer_step_out_of_memory(run: Run, step: int, error: OptimizerStepOutOfMemory) -> str:
    then = (f"`resume` from {run.checkpoint_path}" if run.checkpoint_path.is_file() else
            "start the run again (no checkpoint was written yet)")
    return (f"out of memory in the optimizer step itself at optimizer step {step + 1}, after the window's gradients "
            f"were accumulated ({error}); lower `micro_batch_max` or free memory, then {then}")


def recover_from_out_of_memory(run: Run, step: int, batch: StepBatch, agreed: bool) -> None:
    """After an out-of-memory error in a window: free what is left, halve the micro-batch
    (the effective batch stays exact) and reopen the stream at `step`; with several ranks only when all agreed."""
    setup, plan, micro_batch = run.setup, run.plan, run.micro_batch(step)
    run.stream.close()  # its prefetched micro-batches are of the old size
    free_memory(setup.optimizer, setup.device)
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
                                                       " (the run goes on; `stop_on_divergence` stops it)"))
    return diverging


def evaluate_into(run: Run, step: int, record: StepRecord, done: bool) -> None:
    """The evaluation after `step` into its record (train/evaluation.py); a plateau decay's new LR reported."""
    evaluation = evaluate_after(run, step)
    record.evaluation.update({**evaluation, **step_plateau(run.setup, evaluation, step + 1)})
    if "plateau_lr" in record.evaluation and not done:
        run.reporter.message(f"step {step + 1}: {run.plan.recipe.schedule.decay.metric} has not improved: plateau "
                             f"decay, lr -> {record.evaluation['plateau_lr']:.6g} from step {step + 2}")


def checkpoint_or_stop(run: Run, step: int, done: bool, gate: bool = False) -> None:
    """Checkpoint when due (every K steps or CHECKPOINT_SECONDS, at the end, at a gate, or on a
    signal); after a signal, stop with the command that continues the run."""
    setup, request = run.setup, run.request
    due = (step + 1) % request.checkpoint_every == 0 if request.checkpoint_every else (
        time.perf_counter() - run.last_checkpoint >= CHECKPOINT_SECONDS)
    received = None if done else signals.pending()
    if not done and run.world.distributed:  # all ranks stop, and save (a sharded one needs them all), after one step
        flags = torch.tensor([received or 0, int(due)], dtype=torch.int64, device=setup.device)  # NCCL: CUDA only
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        received, due = int(flags[0]) or None, bool(flags[1])
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
        extra["plan"] = as_record(run.plan)  # a resume refuses another plan (plan/planfile.py)
        if run.summary is not None:
            extra["summary"] = json.dumps(run.summary)  # (train/resume.py)
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
            signals.EXIT_CODES[received],
        )


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
