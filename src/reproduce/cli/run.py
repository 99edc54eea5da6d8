"""`reproduce run PLAN_OR_RECIPE --out DIR`: the paper's large-batch run, on micro-batches, exactly."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..errors import UserError
from ..memory_options import with_knobs_of
from ..phases import phase_lines
from ..planfile import load_plan, load_recipe_or_plan
from ..planner import Plan
from ..recipe import Recipe, parse_recipe, with_data_paths
from ..reported import reported_line
from ..sharding import check_sharding, with_sharding
from ..train.trackers import LOG_TO_HELP, TrackerReporter, check_trackers, parse_log_to
from .app import app
from .common import is_terminal, stderr, stdout
from .memory import CHECKPOINTING_HELP, OFFLOAD_HELP, SHARDED_GRADIENTS_HELP, Offload, apply_memory_to_run
from .plan import MICRO_BATCH_MAX_HELP, POLICY_HELP, WORLD_SIZE_HELP, Policy, make_plan, plan_and_probe
from .probe import (
    GPU_HELP,
    HEADROOM_HELP,
    MEMORY_HELP,
    METER_HELP,
    NO_CACHE_HELP,
    SHARDING_HELP,
    MeterName,
    Sharding,
    probe_options,
)
from .resume import LAUNCHER_ENV, absolute, continue_command, launcher_args, launcher_of_this_job


class PlainReporter:
    """Periodic log lines, for CI logs and other non-terminals.

    Nothing is printed before the run has checked its inputs (`start`), so bad input gets its one error line.
    """

    def __init__(self, warnings: list[str], lines: int = 20):
        self.warnings, self.lines, self.every, self.total, self.started = warnings, lines, 1, 0, 0.0

    def start(self, plan: Plan, total_steps: int, first_step: int) -> None:
        for warning in self.warnings:
            stderr.print(f"[yellow]warning:[/] {warning}")
        phases = phase_lines(plan.segments, plan.world_size, plan.unit)
        stdout.print(
            ("main batch: " if phases else "")
            + f"micro {plan.micro_batch} x accumulation {plan.accumulation_steps} x world {plan.world_size} = "
            f"{plan.effective_batch} {plan.unit} per step"
            + (f" ({plan.effective_tokens} tokens)" if plan.effective_tokens else "")
            + ("" if plan.exact else f", not the paper's {plan.paper_effective_batch}: lr {plan.lr:.6g} "
               f"({plan.lr_rule})")
        )
        if plan.throughput:  # --policy throughput: why this split (cli/throughput.py)
            stdout.print(f"--policy throughput: {plan.throughput['reason']}", markup=False, soft_wrap=True)
        for line in phases:
            stdout.print(line, markup=False)
        if plan.recipe.batch.sharding == "fsdp":
            print(f"sharding: fsdp (FSDP2: parameters, gradients and optimizer state split over {plan.world_size} "
                  "processes)", flush=True)
        from ..memory_options import memory_summary

        for line in [*plan.memory, *(f"memory: {knob}" for knob in memory_summary(plan.recipe))]:
            print(line, flush=True)
        self.total, self.every = total_steps, max(1, total_steps // self.lines)
        self.started = time.perf_counter()
        where = f", resuming after step {first_step}" if first_step else ""
        print(f"training {total_steps} optimizer steps{where}", flush=True)

    def step(self, record: dict) -> None:
        step = record["step"]
        if step % self.every and step != self.total and step != 1:
            return
        line = f"step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.4g}"
        if "eval_loss" in record:
            line += f" eval_loss {record['eval_loss']:.4f}"
        if "eval_accuracy" in record:
            line += f" eval_accuracy {record['eval_accuracy']:.4f}"
        rate = ""
        if record.get("tokens_per_second") or record.get("samples_per_second"):  # this step's (train/rates.py)
            rate = (f" {record['tokens_per_second']:,.0f} tokens/s" if record.get("tokens_per_second")
                    else f" {record['samples_per_second']:,.0f} samples/s")
        print(line + rate + f" ({time.perf_counter() - self.started:.1f}s)", flush=True)

    def message(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def finish(self, summary: dict) -> None:
        pass


class RichReporter(PlainReporter):
    """A progress bar: optimizer step of total, loss, samples/s, ETA."""

    def start(self, plan: Plan, total_steps: int, first_step: int) -> None:
        super().start(plan, total_steps, first_step)
        self.samples = 0
        self.rate_unit = "tokens/s" if plan.recipe.batch.sequence_length else f"{plan.unit}/s"
        self.progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("micro x{task.fields[micro]}  loss {task.fields[loss]}  {task.fields[rate]} "
                       + self.rate_unit),
            TimeRemainingColumn(), console=stdout,
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=first_step, loss="-", rate="-", micro=plan.accumulation_steps
        )
        self.progress.start()

    def step(self, record: dict) -> None:
        self.samples += record["samples"]
        rate = record.get("tokens_per_second") or record.get("samples_per_second") or 0  # this step's (rates.py)
        self.progress.update(self.task, advance=1, loss=f"{record['loss']:.4f}", rate=f"{rate:,.0f}")

    def message(self, text: str) -> None:
        stderr.print(text)

    def finish(self, summary: dict) -> None:
        self.progress.stop()


SOURCE_HELP = "A plan file from `reproduce plan --out`, or a recipe."
OUT_HELP = "Folder for plan.yaml, metrics.jsonl, checkpoints/, model.pt and summary.json."
SEED_HELP = "Seed for initialisation, data order and dropout (default: the recipe's seed)."
SKIP_HELP = "Skip optimizer steps whose loss or gradient is not finite, instead of stopping."
CHECKPOINT_HELP = "Checkpoint every K optimizer steps (default: every 5 minutes, and at the end)."
NPROC_HELP = "Processes (GPUs) on this machine: launches itself through torchrun (torch.distributed.run)."
NO_NOISE_HELP = "Do not measure the gradient noise scale (metrics.jsonl noise_scale; it never changes the weights)."
DATA_HELP = "The training data (a folder or file in the recipe's data.format), instead of the recipe's data.path."
EVAL_DATA_HELP = "The evaluation data, instead of the recipe's data.eval_path."
WORKERS_HELP = ("DataLoader worker processes per training process (0: fetch in the training process; default: "
                "one per CPU core less one, at most 8, for data read from files; 0 for data held in memory).")
RUN_SHARDING_HELP = SHARDING_HELP + " A resumed run keeps its own."


MAX_STEPS_HELP = ("Stop after optimizer step K, counted from the start of the run: a resumed run goes on to step K "
                  "(smoke runs).")
DIVERGENCE_HELP = ("Stop when the loss diverges (not finite, or above 2x its first value for 10 steps in a row); "
                   "without it the run warns once and goes on.")

def _forwarded_args(source: Path, out: Path, values: dict[str, object], switches: dict[str, bool]) -> list[str]:
    """This command's own options, for each process torchrun starts (without the launcher options):
    `--flag value` for each value that is set, `--flag` for each switch that is on."""
    args = [str(source), "--out", str(out)]
    for flag, value in values.items():
        if value is not None:
            args += [flag, str(value)]
    return args + [flag for flag, on in switches.items() if on]


def _launch(command: list[str]) -> int:
    """Run torchrun, passing SIGINT/SIGTERM on to it (it forwards them to every rank, which checkpoint and stop)."""
    child = subprocess.Popen(command)

    def forward(signum, frame):
        child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _replan(saved: Plan, world_size: int, micro_batch: int | None, dataset_size: int | dict, source: Path) -> Plan:
    """The same effective batch and schedule on another number of processes, or with a smaller micro-batch (a
    resumed run that ran out of memory; None: keep the plan's), or with the dataset's size when the plan was made
    without it: N and the steps per epoch are re-derived. With batch phases each sequence
    length keeps its own micro-batch, lowered to `micro_batch` where that is smaller."""
    from ..planner import plan as make

    cap = micro_batch or saved.micro_batch
    micro = {s.sequence_length: min(s.micro_batch, micro_batch or s.micro_batch) for s in saved.segments}
    micro = micro if len(micro) > 1 else cap  # one micro-batch per sequence length the plan reads
    again = make(saved.recipe, micro, world_size, saved.policy, dataset_size=dataset_size,
                 recipe_path=saved.recipe_path)
    same = ("effective_batch", "steps_per_epoch", "optimizer_steps", "warmup_steps", "decay_milestones")
    if saved.dataset_size is None:  # made without the data: its steps were not known, only its batches
        same = ("effective_batch",)

    def steps(p: Plan) -> list:
        if saved.dataset_size is None:
            return [segment.effective_batch for segment in p.segments]
        return [(segment.start_step, segment.steps, segment.effective_batch) for segment in p.segments]

    # what the saved plan could not know (made without the data: `reproduce plan --out`) comes from the data now
    changed = [field for field in same if getattr(saved, field) is not None and getattr(again, field) != getattr(
        saved, field)]
    if changed or steps(again) != steps(saved):
        raise UserError(
            f"{source}: world_size: the plan ({saved.arithmetic}{_steps_text(saved)}) cannot be kept "
            f"on {world_size} processes with micro-batch {cap}; plan again for {world_size}"
        )
    return again


def _steps_text(plan: Plan) -> str:
    """`, 300 steps`, or nothing for a plan whose schedule was never known (never `None steps`)."""
    return f", {plan.optimizer_steps} steps" if plan.optimizer_steps is not None else ""


def _resumed_data_paths(recipe: Recipe, saved: Recipe, data_path: str | None, eval_data_path: str | None,
                        out: Path, source: str) -> Recipe:
    """Resuming reads the data the run read: its paths come from its plan.yaml; --data / --eval-data, when given,
    must name the same."""
    if recipe.data.format is None or saved.data.format is None:
        return recipe

    def same(a: str | None, b: str | None) -> bool:
        if a is None or b is None:
            return a is b
        return Path(a).expanduser().absolute() == Path(b).expanduser().absolute()

    for option, given, mine, ran in (("--data", data_path, recipe.data.path, saved.data.path),
                                     ("--eval-data", eval_data_path, recipe.data.eval_path, saved.data.eval_path)):
        if given is not None and not same(mine, ran):
            raise UserError(f"{option}: the run in {out} read {ran}; --resume continues it on the same data "
                            f"(got {mine})")
    data = recipe.model_dump(mode="json")
    data["data"].update(path=saved.data.path, eval_path=saved.data.eval_path, available=saved.data.available)
    return parse_recipe(data, source)


def _recipe_and_plan(source: Path, out: Path, resume: bool, sharding: str | None, data_path: str | None,
                     eval_data_path: str | None) -> tuple[Recipe, Plan | None]:
    """The recipe (and plan, when given or resumed) with the data paths and the sharding this run uses: --data /
    --eval-data and --sharding, else the recipe's; a resumed run keeps the data and sharding it was started with."""
    recipe, plan = load_recipe_or_plan(source)
    recipe = with_data_paths(recipe, data_path, eval_data_path, str(source))
    if not resume:
        recipe = with_sharding(recipe, sharding)
        return recipe, plan.model_copy(update={"recipe": recipe}) if plan is not None else None
    saved = load_plan(out / "plan.yaml") if (out / "plan.yaml").is_file() else None
    if saved is None:
        raise UserError(f"--resume: {out} has no plan.yaml to resume")
    started = saved.recipe.batch.sharding
    if sharding is not None and sharding != started:
        raise UserError(f"--sharding: the run in {out} was started with sharding {started}; resume it with the same "
                        f"(got {sharding})")
    recipe = _resumed_data_paths(recipe, saved.recipe, data_path, eval_data_path, out, str(source))
    if with_knobs_of(with_sharding(recipe, started), saved.recipe) != saved.recipe:  # (knobs the plan took kept)
        raise UserError(f"--resume: the recipe in {source} differs from the one {out}/plan.yaml was run with")
    return saved.recipe, saved


def _check_sharded_probe(recipe: Recipe, plan: Plan | None, micro_batch_max: int | None, meter: MeterName) -> None:
    """A real (cuda / cpu) probe measures the whole unsharded model on one device: not what an FSDP rank holds."""
    if recipe.batch.sharding != "fsdp" or plan is not None or micro_batch_max is not None:
        return
    import torch

    if meter in (MeterName.cuda, MeterName.cpu) or (meter == MeterName.auto and torch.cuda.is_available()):
        raise UserError(
            "--micro-batch-max: with batch.sharding fsdp give it (or --meter estimate): the cuda and cpu probes "
            "measure the whole unsharded model on one device, not one rank's share"
        )


@app.command("run")
def run_command(
    source: Path = typer.Argument(..., metavar="PLAN_OR_RECIPE", help=SOURCE_HELP),
    out: Path = typer.Option(..., "--out", help=OUT_HELP),
    micro_batch_max: int | None = typer.Option(None, "--micro-batch-max", min=1, help=MICRO_BATCH_MAX_HELP),
    world_size: int = typer.Option(1, "--world-size", min=1, help=WORLD_SIZE_HELP),
    policy: Policy = typer.Option(Policy.exact, "--policy", help=POLICY_HELP),
    max_steps: int | None = typer.Option(None, "--max-steps", min=1, help=MAX_STEPS_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    force: bool = typer.Option(False, "--force", help="Overwrite the outputs of another run in --out."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    seed: int | None = typer.Option(None, "--seed", help=SEED_HELP),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", min=1, help=CHECKPOINT_HELP),
    skip_nonfinite: bool = typer.Option(False, "--skip-nonfinite", help=SKIP_HELP),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", min=1, help=NPROC_HELP),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Machines in the job (with --nproc-per-node)."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This machine's rank (with --nnodes)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of node 0 (several nodes)."),
    memory: str | None = typer.Option(None, "--memory", metavar="SIZE", help=MEMORY_HELP),
    gpu: str | None = typer.Option(None, "--gpu", metavar="NAME", help=GPU_HELP),
    meter: MeterName = typer.Option(MeterName.auto, "--meter", help=METER_HELP),
    headroom: float = typer.Option(0.1, "--headroom", help=HEADROOM_HELP),
    no_cache: bool = typer.Option(False, "--no-cache", help=NO_CACHE_HELP),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also log each step's metrics to OUT/tensorboard."),
    log_to: list[str] | None = typer.Option(None, "--log-to", metavar="TRACKERS", help=LOG_TO_HELP),
    sharding: Sharding | None = typer.Option(None, "--sharding", help=RUN_SHARDING_HELP),
    data_path: str | None = typer.Option(None, "--data", metavar="PATH", help=DATA_HELP),
    eval_data_path: str | None = typer.Option(None, "--eval-data", metavar="PATH", help=EVAL_DATA_HELP),
    workers: int | None = typer.Option(None, "--workers", min=0, help=WORKERS_HELP),
    no_noise_scale: bool = typer.Option(False, "--no-noise-scale", help=NO_NOISE_HELP),
    stop_on_divergence: bool = typer.Option(False, "--stop-on-divergence", help=DIVERGENCE_HELP),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help=CHECKPOINTING_HELP),
    sharded_gradients: bool = typer.Option(False, "--sharded-gradients", help=SHARDED_GRADIENTS_HELP),
    offload: Offload | None = typer.Option(None, "--offload", help=OFFLOAD_HELP),
) -> None:
    """Train with the plan: micro-batches accumulated into the paper's effective batch, exactly."""
    from ..data import build_data
    from ..data.lengths import training_sizes
    from ..train import distributed  # torch is imported only by the commands that train
    from ..train.trainer import RunOptions, train

    trackers = parse_log_to(log_to, tensorboard)
    check_trackers(trackers)  # a missing package: one line, before anything is planned or trained
    world = distributed.world_from_env()
    sharding_name = sharding.value if sharding is not None else None
    memory_flags = (activation_checkpointing, sharded_gradients, offload)
    if nproc_per_node is not None and not world.distributed:
        if nnodes > 1 and rdzv_endpoint is None:
            raise UserError("--rdzv-endpoint: required with --nnodes > 1 (HOST:PORT of node 0)")
        # bad input: one line, before launching
        recipe, plan = _recipe_and_plan(source, out, resume, sharding_name, data_path, eval_data_path)
        recipe, plan = apply_memory_to_run(recipe, plan, resume, out, *memory_flags)
        check_sharding(recipe, nproc_per_node * nnodes)
        _check_sharded_probe(recipe, plan, micro_batch_max, meter)
        if policy is Policy.throughput and plan is None and nproc_per_node * nnodes > 1:
            raise UserError("--policy throughput: each process would time its own device and might choose another "
                            "split; plan first (reproduce plan --policy throughput --out plan.yaml) and run that plan")
        args = _forwarded_args(
            source, out,
            {"--policy": policy.value, "--device": device, "--micro-batch-max": micro_batch_max,
             "--max-steps": max_steps, "--seed": seed, "--checkpoint-every": checkpoint_every, "--memory": memory,
             "--gpu": gpu, "--meter": meter.value, "--headroom": headroom, "--sharding": sharding_name,
             "--data": data_path, "--eval-data": eval_data_path, "--workers": workers,
             "--log-to": ",".join(trackers) or None, "--offload": offload.value if offload is not None else None},
            {"--resume": resume, "--force": force, "--skip-nonfinite": skip_nonfinite, "--no-cache": no_cache,
             "--no-noise-scale": no_noise_scale, "--stop-on-divergence": stop_on_divergence,
             "--activation-checkpointing": activation_checkpointing, "--sharded-gradients": sharded_gradients},
        )
        command = distributed.torchrun_command(args, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
        os.environ[LAUNCHER_ENV] = shlex.join(launcher_args(nproc_per_node, nnodes, node_rank, rdzv_endpoint))
        print("launching: " + " ".join(command), flush=True)
        raise typer.Exit(_launch(command))
    if world.distributed:
        world_size = world.size
    recipe, plan = _recipe_and_plan(source, out, resume, sharding_name, data_path, eval_data_path)
    recipe, plan = apply_memory_to_run(recipe, plan, resume, out, *memory_flags)
    check_sharding(recipe, world.size)
    _check_sharded_probe(recipe, plan, micro_batch_max, meter)
    data = build_data(recipe)
    size = training_sizes(recipe, data["train"])  # per sequence length when batch phases change it
    options = probe_options(memory, gpu, meter, headroom, no_cache)
    if plan is None and world.distributed and micro_batch_max is None:
        # every rank probes its own device; all take the smallest result, so no rank runs out of memory
        from ..train.setup import resolve_device

        rank_device = distributed.init(world, resolve_device(device))
        probed_plan, _ = plan_and_probe(recipe, str(source), None, world_size, policy, size, probe=options,
                                             data=data, quiet=not world.is_main)
        recipe = probed_plan.recipe  # with the memory knobs the plan took (probe/memory_plan.py)
        # one maximum per sequence length the plan reads, agreed in the same order on every rank
        maxima = {segment.sequence_length: segment.micro_batch_max for segment in probed_plan.segments}
        agreed = {length: distributed.all_min(world, maxima[length], rank_device)
                  for length in sorted(maxima, key=lambda length: length or 0)}
        micro_batch_max = agreed if len(agreed) > 1 else next(iter(agreed.values()))
    if plan is None:
        plan = make_plan(recipe, str(source), micro_batch_max, world_size, policy, dataset_size=size, probe=options,
                         data=data, quiet=not world.is_main)
    else:
        smaller = resume and micro_batch_max is not None and micro_batch_max < plan.micro_batch
        if plan.world_size != world_size or smaller or plan.dataset_size is None:
            plan = _replan(plan, world_size, micro_batch_max if smaller else None, size, source)
    warnings = list(plan.warnings)
    main_size = size.get(recipe.batch.sequence_length) if isinstance(size, dict) else size
    if recipe.data.train_size is not None and recipe.data.train_size != main_size:
        warnings.append(f"data.train_size is {recipe.data.train_size}; the data has {main_size}: using {main_size}")
    micro_max = micro_batch_max if isinstance(micro_batch_max, int) else None  # (per-length maxima: no option)
    continue_with = continue_command(
        out, {"--max-steps": max_steps, "--micro-batch-max": micro_max,
              "--data": absolute(data_path), "--eval-data": absolute(eval_data_path), "--workers": workers,
              "--device": device if device != "auto" else None, "--seed": seed, "--checkpoint-every": checkpoint_every,
              "--log-to": ",".join(trackers) or None},
        {"--skip-nonfinite": skip_nonfinite, "--no-noise-scale": no_noise_scale,
         "--stop-on-divergence": stop_on_divergence},
        launcher_of_this_job(world.size) if world.distributed else [],
    )
    train_options = RunOptions(device=device, max_steps=max_steps, resume=resume, force=force, seed=seed,
                               checkpoint_every=checkpoint_every, skip_nonfinite=skip_nonfinite, data=data,
                               workers=workers, noise_scale=not no_noise_scale, continue_with=continue_with,
                               stop_on_divergence=stop_on_divergence)
    if not world.is_main:  # the other ranks train quietly; rank 0 reports
        train(plan, out, train_options)
        return
    reporter = RichReporter(warnings) if is_terminal() else PlainReporter(warnings)
    # metrics.jsonl stays the source of truth; the trackers get the same numbers (train/trackers.py)
    with TrackerReporter(reporter, trackers, out) as reporter:
        summary = train(plan, out, train_options.replace(reporter=reporter))
    final = summary["final"]
    line = f"done: {summary['steps']} steps in {summary['seconds']:.1f}s"
    this_call = summary.get("this_call") or {}
    if summary.get("resumed_from_step"):  # the whole run, then what this call added
        line += f" ({this_call['steps']} in this call, {this_call['seconds']:.1f}s)"
    line += f", final loss {final['loss']:.4f}"
    if "eval_accuracy" in final:
        line += f", eval accuracy {final['eval_accuracy']:.4f}"
    if "eval_loss" in final:
        line += f", eval loss {final['eval_loss']:.4f}"
    if summary.get("data_share") is not None:
        workers = f"{summary['workers']} worker{'' if summary['workers'] == 1 else 's'}"
        line += f"; waited for data {summary['data_share']:.0%} of the time ({workers})"
    stdout.print(line)
    for row in summary.get("reported") or []:
        stdout.print(reported_line(row), markup=False, soft_wrap=True)
    noise = summary.get("noise_scale")
    if noise and not noise.get("noted"):  # a run that cannot measure it said so at its start
        stdout.print(f"noise scale: {noise['sentence']}", markup=False, soft_wrap=True)
    stdout.print(f"outputs in {out}: plan.yaml, metrics.jsonl, model.pt, summary.json, checkpoints/last.pt")
    if summary.get("plot"):
        stdout.print(summary["plot"], markup=False)
