"""The start of a training run (trainer.train's first part): the plan checked against the world, the model and
data built, the training set grouped, the checkpoint loaded on --resume, plan.yaml written, the notes and the start
reported."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data import training_set
from ..data.packing import Grouped, grouping_of, sample_lengths
from ..errors import UserError
from ..models import count_parameters
from ..models.hf import check_packed
from ..models.varlen import runs_varlen
from ..models.weights import check_merged
from ..observe.noise import NoiseScale, not_measured_reason
from ..observe.outputs import MetricsLog
from ..observe.rates import StepRates
from ..plan.gates import planned_gates
from ..plan.planfile import plan_to_yaml
from ..plan.planner import Plan
from ..plan.segments import batch_phases, length_sizes
from ..storage import faults
from ..storage.files import WriteFailed, write_atomic
from .distributed import processes as distributed
from .distributed.processes import World
from .gates import resume_source, start_gates
from .optim.plateau import check_plateau
from .options import RunRequest
from .reporter import Reporter, run_start
from .resume import Resumed, earlier_segments, last_record, resume_run
from .run_state import Run
from .setup import build, resolve_device
from .windows import grouping_line, micro_batch_at

if TYPE_CHECKING:
    from ..data import Datasets


def start_run(plan: Plan, request: RunRequest, world: World, data: Datasets | None, reporter: Reporter,
              dtype: torch.dtype, continue_with: str) -> Run:
    """Check the plan against the world; build the model and data; load the checkpoint on --resume; write
    plan.yaml; report the notes and the start."""
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
