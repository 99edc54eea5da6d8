"""The training run: the plan's optimizer steps, checkpoints, metrics, signals and out-of-memory handling.

Each optimizer step is `step.optimizer_step` over the window `windows.window` gives it; everything a run
needs is built by `setup.build`.
"""

from __future__ import annotations

import functools
import gc
import json
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

import torch

from ..data.batches import DataClock, LazyMicroBatch
from ..data.lengths import training_set
from ..data.loader import LoaderWatch, MicroBatchStream, cpu_share, default_workers
from ..errors import Interrupted, TrainingStopped, UserError
from ..planfile import save_plan, write_text_atomic
from ..planner import Plan
from ..reported import compare_reported
from ..segments import batch_phase, batch_phases, length_sizes
from ..sharding import check_sharding
from . import distributed
from .checkpoint import full_model_state, load_checkpoint, save_checkpoint
from .distributed import World
from .divergence import DivergenceWatch
from .evaluation import evaluate_step, evaluation_due
from .noise import NoiseScale, not_measured_reason, summarise
from .options import RunOptions
from .outputs import MetricsLog, check_out_dir, plot_metrics, read_metrics, remove_outputs
from .plateau import check_plateau
from .rates import StepRates
from .setup import build, resolve_device
from .step import AgreedOutOfMemory, OptimizerStepOutOfMemory, optimizer_step
from .windows import micro_batch_at, smaller_micro_batch, step_batch, step_epoch, window

CHECKPOINT_SECONDS = 300.0


class Reporter(Protocol):
    def start(self, plan: Plan, total_steps: int, first_step: int) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


class SilentReporter:
    def start(self, plan: Plan, total_steps: int, first_step: int) -> None: ...
    def step(self, record: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def finish(self, summary: dict) -> None: ...


class StopSignals:
    """SIGINT / SIGTERM set a flag; the loop finishes its optimizer step, checkpoints, and stops."""

    EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.EXIT_CODES:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

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


def train(plan: Plan, out: str | Path, options: RunOptions | None = None) -> dict:
    """Run `plan`, writing plan.yaml, metrics.jsonl, checkpoints/last.pt, model.pt and summary.json to `out`.

    `options` (train/options.py): device, max_steps, resume, seed, data, workers, ...; None: `RunOptions()`.
    Under torchrun every rank trains its share of each window; rank 0 alone writes. A rank that
    leaves with an error leaves the process group too, so the other ranks' collectives fail at once and they stop
    with a message of their own instead of waiting for it.
    """
    world = distributed.world_from_env()
    try:
        return _train(plan, Path(out), options or RunOptions())
    except RuntimeError as error:
        if world.distributed and distributed.peer_failed(error):
            distributed.abandon(world)
            raise TrainingStopped(
                f"rank {world.rank}: a collective with the other ranks failed ({str(error).splitlines()[0]}): "
                "another rank stopped, and its message says why"
            ) from None
        distributed.abandon(world)
        raise
    except BaseException:
        distributed.abandon(world)
        raise


def _train(plan: Plan, out: Path, options: RunOptions) -> dict:
    device, max_steps, resume, force = options.device, options.max_steps, options.resume, options.force
    seed, checkpoint_every, skip_nonfinite, dtype = (options.seed, options.checkpoint_every, options.skip_nonfinite,
                                                     options.dtype)
    data, workers, noise_scale = options.data, options.workers, options.noise_scale
    continue_with, stop_on_divergence = options.continue_with, options.stop_on_divergence
    reporter = options.reporter or SilentReporter()
    world = distributed.world_from_env()
    if world.size != plan.world_size:
        raise UserError(f"plan: world_size is {plan.world_size}, but this job has {world.size} process(es)")
    check_sharding(plan.recipe, world.size)
    check_out_dir(out, resume, force)
    asked_seed, seed = seed, plan.recipe.seed if seed is None else seed
    target_device = distributed.init(world, resolve_device(device))
    distributed.barrier(world)  # every rank has looked at --out before rank 0 writes to it
    setup = build(plan, target_device, dtype, seed, data, world)
    check_plateau(plan, setup.data)
    # batch phases of other sequence lengths read the same data cut at their length (data/lengths.py)
    train_set = training_set(plan.recipe, setup.data["train"], list(length_sizes(plan.segments)))
    size = check_training_set(plan, train_set)
    total = plan.optimizer_steps if max_steps is None else min(max_steps, plan.optimizer_steps)
    checkpoint_path = out / "checkpoints" / "last.pt"
    first_step, metrics_offset = 0, 0
    lowered: dict = {}  # sequence length -> the micro-batch an out-of-memory error lowered it to
    noise = NoiseScale(setup) if noise_scale and not setup.sharded else None
    if resume:
        state = load_checkpoint(setup, checkpoint_path)
        if noise is not None and state["extra"].get("noise_scale"):
            noise.load_state_dict(state["extra"]["noise_scale"])
        first_step, metrics_offset = state["step"], state["metrics_offset"]
        saved_seed = state["extra"].get("seed", seed)
        if asked_seed is not None and asked_seed != saved_seed:
            raise UserError(f"--seed: the run in {out} was started with seed {saved_seed} (got {asked_seed})")
        seed = saved_seed  # the data order and dropout streams of the run being continued
        if first_step >= total:
            raise UserError(already_run(out, first_step, total, max_steps, plan.optimizer_steps))
        # the run had lowered the micro-batch after running out of memory (by sequence length)
        lowered = {int(k) if k != "None" else None: v for k, v in state["extra"].get("lowered", {}).items()}
        saved_micro_batch = state.get("micro_batch")  # all a checkpoint written before batch phases says
        if "lowered" not in state["extra"] and saved_micro_batch and batch_phase(plan.segments, 0) is None and (
                saved_micro_batch < plan.micro_batch and plan.per_rank_batch % saved_micro_batch == 0):
            lowered = {plan.recipe.batch.sequence_length: saved_micro_batch}
    main = world.is_main
    if main:
        if force and not resume:  # another run's outputs go, so nothing of it is mistaken for this one's
            remove_outputs(out)
        out.mkdir(parents=True, exist_ok=True)
        save_plan(plan, out / "plan.yaml")
    metrics = MetricsLog(out / "metrics.jsonl", metrics_offset, enabled=main)
    # Checkpoint every K steps when asked; otherwise every CHECKPOINT_SECONDS of wall time, and always at the end.
    last_checkpoint = time.perf_counter()
    for note in setup.notes:
        reporter.message(f"note: {note}")
    rates = StepRates(plan, setup, world.size)  # the model FLOPs of a sample, counted once (train/rates.py)
    for note in rates.notes:
        reporter.message(f"note: {note}")
    # each segment's micro-batches per rank, as the run takes them (a micro-batch lowered after running out of memory)
    accumulations = [-(-(segment.effective_batch // plan.world_size)
                       // micro_batch_at(plan, segment.start_step, lowered)) for segment in plan.segments]
    unmeasured = not_measured_reason(world.size, max(accumulations), setup.sharded) if noise_scale else None
    if unmeasured:
        reporter.message(f"note: noise scale not measured: {unmeasured}")
    reporter.start(plan, total, first_step)
    started = time.perf_counter()
    counters = {"samples": 0, "tokens": 0, "partial_windows": 0, "skipped_nonfinite": 0, "out_of_memory": 0}
    earlier, divergence = earlier_segments(out, state if resume else None, first_step)
    waited = 0.0  # seconds the steps waited for data
    last_record: dict = {}
    setup.model.train()
    stop = StopSignals()
    # On a CPU, values below float32's normal range (late in training, in momentum and gradients) make every
    # operation on them ~100x slower; flushing them to zero cost a digits run 3.5 s instead of 72 s.
    flush_denormals = setup.device.type == "cpu" and torch.set_flush_denormal(True)
    data_workers = default_workers(train_set)
    workers = data_workers if workers is None else workers
    # Training on the CPU from files read by loader workers: the compute threads get the cores the default workers
    # leave. OpenMP threads that outnumber free cores spin against each other: the digits MLP's 5 ms step took
    # 0.9 s beside one worker decoding PNGs on 2 cores. The count follows the data, not --workers, so runs with
    # different worker counts (a resume with fewer) compute with the same threads and stay bitwise equal.
    threads = torch.get_num_threads()
    if setup.device.type == "cpu" and data_workers:
        torch.set_num_threads(max(1, min(threads, cpu_share() - data_workers)))
    watch = LoaderWatch(workers)

    def windows(step: int) -> tuple[list[torch.Tensor], bool]:
        """This rank's micro-batches of `step`, and whether the window is partial: the loop and the loader's
        sampler both follow this one function (each step's micro-batch: its batch phase's, or as lowered after
        running out of memory)."""
        return window(plan, size, step, seed, setup.rank, micro_batch_at(plan, step, lowered))

    def open_stream(step: int) -> MicroBatchStream:
        return MicroBatchStream(train_set, lambda at: windows(at)[0], step, total, seed=seed,
                                workers=workers, pin_memory=setup.device.type == "cuda")

    stream = None
    try:
        stop.__enter__()
        stream = open_stream(first_step)
        for step in range(first_step, total):
            tick = time.perf_counter()
            # Dropout and other random draws of step s come from (seed, s, rank) alone: a resumed run draws what
            # the uninterrupted one did, and ranks draw independently of each other.
            seed_step(setup.device, step_seed(seed, step, setup.rank))
            lr = setup.optimizer.param_groups[0]["lr"]
            clock = DataClock()
            batch = step_batch(plan, step)  # with batch phases: this step's N and sequence length
            if batch.phase is not None and (step == first_step or plan.segments[batch.phase].start_step == step):
                reporter.message(f"step {step + 1}: batch {batch.effective_batch} = micro {batch.micro_batch} x "
                                 f"accumulation {batch.accumulation_steps} x world {plan.world_size}"
                                 + (f", sequence length {batch.sequence_length}" if batch.sequence_length else ""))
            micro_batch = micro_batch_at(plan, step, lowered)
            if noise is not None and batch.phase is not None:  # each sequence length's own training set
                noise.dataset_size = plan.segments[batch.phase].dataset_size or size
            while True:
                indices, partial = windows(step)
                take = functools.partial(stream.take, step)
                micro_batches = [LazyMicroBatch(train_set, i, setup.device, dtype, take, clock) for i in indices]
                try:
                    result = optimizer_step(setup, micro_batches, noise)
                    break
                except OptimizerStepOutOfMemory as error:
                    raise TrainingStopped(
                        f"out of memory in the optimizer step itself at optimizer step {step + 1}, after the "
                        f"window's gradients were accumulated ({error}); lower --micro-batch-max or free memory, "
                        f"then --resume from {checkpoint_path}"
                    ) from None
                except torch.OutOfMemoryError as error:
                    agreed = not world.distributed or isinstance(error, AgreedOutOfMemory)
                # Out of memory. The error is gone with its except block, and with it the failed window's frames
                # (activations, inputs): free the rest, halve the micro-batch, double N; the effective batch stays
                # exact. Under several processes only when every rank agreed (the vote in optimizer_step).
                del micro_batches
                stream.close()  # its prefetched micro-batches are of the old size
                setup.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if setup.device.type == "cuda":
                    torch.cuda.empty_cache()
                if not agreed:  # this rank alone: it stops, and leaves the process group (see train)
                    raise TrainingStopped(out_of_memory_alone(setup, step, micro_batch, out))
                per_rank_batch = batch.effective_batch // plan.world_size  # this step's (batch phases)
                smaller = smaller_micro_batch(per_rank_batch, micro_batch)
                if smaller is None:
                    raise TrainingStopped(
                        f"out of memory at optimizer step {step + 1} with micro-batch {micro_batch}: no smaller "
                        f"micro-batch keeps the effective batch exact; the last good checkpoint is "
                        f"{checkpoint_path}"
                    )
                counters["out_of_memory"] += 1
                event = {"event": "out_of_memory", "step": step + 1, "micro_batch": smaller,
                         "accumulation_steps": per_rank_batch // smaller, "was": micro_batch}
                metrics.write(event)
                reporter.message(
                    f"out of memory at step {step + 1}: micro-batch {micro_batch} -> {smaller}, accumulation "
                    f"{per_rank_batch // micro_batch} -> {per_rank_batch // smaller}; redoing the window"
                )
                micro_batch = lowered[batch.sequence_length] = smaller
                stream = open_stream(step)
            if not result.finite:
                if not skip_nonfinite and not setup.scaler:
                    raise TrainingStopped(
                        f"non-finite loss or gradient at optimizer step {step + 1} (loss {result.loss}, "
                        f"grad norm {result.grad_norm}); the last good checkpoint is {checkpoint_path}"
                    )
                counters["skipped_nonfinite"] += 1
            counters["samples"] += result.samples
            counters["tokens"] += result.tokens
            counters["partial_windows"] += partial
            waited += clock.seconds
            record = {
                "step": step + 1,
                "epoch": round(step_epoch(plan, step), 6),
                "lr": lr,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "samples": result.samples,
                "tokens": result.tokens,
                "items": result.count,
                "micro_batch": micro_batch,
                "accumulation_steps": len(micro_batches),
                "world_size": world.size,
                "partial": partial,
                "skipped": not result.finite,
                "seconds": round(time.perf_counter() - tick, 6),
                "data_seconds": round(clock.seconds, 6),
                "peak_memory_bytes": peak_memory(setup.device),
            }
            record.update(rates.fields(record))
            slow_loader = watch.update(step + 1, clock.seconds, record["seconds"])
            if slow_loader and main:
                reporter.message(slow_loader)
            if result.grad_syncs is not None:
                record["grad_syncs"] = result.grad_syncs
            if batch.phase is not None:
                record.update(phase=batch.phase + 1, effective_batch=batch.effective_batch,
                              sequence_length=batch.sequence_length)
            if result.noise:
                record.update(result.noise)
            diverging = divergence.update(step + 1, result.loss)
            if diverging and main:
                reporter.message(f"warning: {diverging}" + ("" if stop_on_divergence else
                                                           " (the run goes on; --stop-on-divergence stops it)"))
            done = step + 1 == total
            if evaluation_due(setup, step + 1, done):  # the eval split's metrics, and the plateau decay's step
                record.update(evaluate_step(setup, step + 1, micro_batch, workers, main))
                if "plateau_lr" in record and not done:
                    reporter.message(f"step {step + 1}: {plan.recipe.schedule.decay.metric} has not improved: plateau "
                                     f"decay, lr -> {record['plateau_lr']:.6g} from step {step + 2}")
            metrics.write(record)
            last_record = record
            reporter.step(record)
            if diverging and stop_on_divergence:  # its step logged; the checkpoint before it kept
                raise TrainingStopped(f"{diverging}; stopped (--stop-on-divergence); the last checkpoint is "
                                      f"{checkpoint_path}")
            due = (step + 1) % checkpoint_every == 0 if checkpoint_every else (
                time.perf_counter() - last_checkpoint >= CHECKPOINT_SECONDS)
            received, due = stop.agreed(world, setup.device, due) if not done else (None, due)
            if due or done or received:
                extra = {"seed": seed, "micro_batch": micro_batch,
                         "lowered": {str(length): value for length, value in lowered.items()}}
                if noise is not None:
                    extra["noise_scale"] = noise.state_dict()
                extra["run_totals"] = {"seconds": earlier["seconds"] + time.perf_counter() - started,
                                       "samples": earlier["samples"] + counters["samples"],
                                       "tokens": earlier["tokens"] + counters["tokens"]}
                extra["divergence"] = divergence.state_dict()
                save_checkpoint(setup, checkpoint_path, step + 1, metrics.offset(), extra)
                last_checkpoint = time.perf_counter()
            if received:
                distributed.barrier(world)
                raise Interrupted(
                    f"{signal.Signals(received).name} after optimizer step {step + 1} of {total}; checkpoint "
                    f"written to {checkpoint_path}. Continue with: "
                    + (continue_with or f"reproduce run {out / 'plan.yaml'} --out {out} --resume"),
                    StopSignals.EXIT_CODES[received],
                )
    finally:
        if stream is not None:
            stream.close()
        stop.__exit__()
        metrics.close()
        if noise is not None:
            noise.close()
        if flush_denormals:
            torch.set_flush_denormal(False)
        torch.set_num_threads(threads)

    elapsed = time.perf_counter() - started
    whole = {key: earlier[key] + (elapsed if key == "seconds" else counters[key]) for key in earlier}
    summary = {
        "steps": total,
        "planned_steps": plan.optimizer_steps,
        "resumed_from_step": first_step,
        "arithmetic": plan.arithmetic,
        "exact": plan.exact,
        "world_size": world.size,
        "final": last_record,
        "seconds": round(whole["seconds"], 3),  # the whole run: every segment before a resume too
        "samples_per_second": round(whole["samples"] / whole["seconds"], 2) if whole["seconds"] > 0 else None,
        # what this call ran (the whole run unless it resumed)
        "this_call": {"steps": total - first_step, "samples": counters["samples"], "tokens": counters["tokens"],
                      "seconds": round(elapsed, 3),
                      "samples_per_second": round(counters["samples"] / elapsed, 2) if elapsed > 0 else None},
        "workers": workers,
        "data_seconds": round(waited, 3),
        "data_share": round(waited / elapsed, 4) if elapsed > 0 else None,
        "window_policy": "drop_last" if plan.recipe.data.drop_last else "partial windows normalised by their items",
        **counters,
        "samples": whole["samples"],
        "tokens": whole["tokens"],
        "divergence": divergence.diverged,
        "reported": compare_reported(plan.recipe, last_record, total, plan.optimizer_steps),
        "data": setup.data.get("info", {}),
        "notes": setup.notes,
    }
    if main and noise_scale:  # from metrics.jsonl: the steps before a resume count too
        summary["noise_scale"] = summarise(read_metrics(out / "metrics.jsonl"), total, plan.recipe.task,
                                           reason=unmeasured, warmup_steps=plan.warmup_steps,
                                           diverged=divergence.diverged)
    if main:  # medians of each step's rates, from metrics.jsonl
        summary["throughput"] = rates.summary(read_metrics(out / "metrics.jsonl"))
    model_state = full_model_state(setup)  # FSDP: gathered from every rank's shards
    if main:
        torch.save(model_state, out / "model.pt")
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        summary["plot"] = plot_metrics(out / "metrics.jsonl", out / "loss.png")
    distributed.barrier(world)
    reporter.finish(summary)
    return summary


def already_run(out: Path, first_step: int, total: int, max_steps: int | None, planned: int | None) -> str:
    """Why a resume has nothing to do; with --max-steps (counted from the start of the run), the value that goes on."""
    if max_steps is not None and planned is not None and first_step < planned:
        more = min(first_step + max_steps, planned)
        return (f"--max-steps: {out} has already run {first_step} of {total} optimizer steps; --max-steps counts "
                f"from the start of the run (of {planned} steps): to run {more - first_step} more, give "
                f"--max-steps {more}")
    return f"--resume: {out} has already run {first_step} of {total} optimizer steps; nothing to do"


def earlier_segments(out: Path, state: dict | None, first_step: int) -> tuple[dict, DivergenceWatch]:
    """What the run did before this call (seconds, samples, tokens; zeros for a fresh run) and its divergence
    watch, from the checkpoint, or from metrics.jsonl for a checkpoint written before they were kept."""
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


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
