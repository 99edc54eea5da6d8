"""`reproduce run PLAN_OR_RECIPE --out DIR`: the paper's large-batch run, on micro-batches, exactly."""

from __future__ import annotations

import contextlib
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
from ..plan.batchnorm import batchnorm_for_run
from ..plan.launch import node_range
from ..plan.packing import packing_for_run
from ..plan.phases import phase_lines
from ..plan.planner import Plan
from ..plan.reported import reported_line
from ..plan.resume_rules import recipe_and_plan
from ..plan.sharding import check_sharding
from ..session import check_launch_policy, check_sharded_probe, memory_for_run, probe_consensus, run_plan
from ..storage import lock
from ..train.outputs import check_out_dir
from ..train.trackers import LOG_TO_HELP, TrackerReporter, check_trackers, parse_log_to
from .app import app
from .common import is_terminal, loss_text, parameters_line, recipe_argument, show_note, stderr, stdout
from .options import (
    BACKBONE_WEIGHTS_HELP,
    BATCHNORM_HELP,
    CHECKPOINTING_HELP,
    GPU_HELP,
    HEADROOM_HELP,
    MEMORY_HELP,
    METER_HELP,
    MICRO_BATCH_MAX_HELP,
    NO_CACHE_HELP,
    OFFLOAD_HELP,
    PACKING_HELP,
    POLICY_HELP,
    QUANTIZE_HELP,
    SET_HELP,
    SHARDED_GRADIENTS_HELP,
    SHARDING_HELP,
    TOKEN_BUDGET_HELP,
    WEIGHTS_HELP,
    WORLD_SIZE_HELP,
    BatchNormChoice,
    MeterName,
    Offload,
    PackingChoice,
    Policy,
    Quantize,
    Sharding,
    probe_options,
    value_of,
)
from .resume import (
    LAUNCHER_ENV,
    absolute,
    auto_resume_flags,
    continue_command,
    folder_state,
    launcher_args,
    launcher_of_this_job,
)
from .throughput import cost_line


def counted_parameters(plan: Plan, data: dict) -> tuple[int, int] | None:
    """(all parameters, those that train) of the run's model, counted on the meta device (a quantised base
    unquantised); None for a model that cannot be built there (a factory's own code)."""
    from ..models import parameter_counts

    try:
        return parameter_counts(plan.recipe, data.get("info"))
    except (UserError, RuntimeError, NotImplementedError, TypeError, ValueError):
        return None


class PlainReporter:
    """Periodic log lines, for CI logs and other non-terminals.

    Nothing is printed before the run has checked its inputs (`start`), so bad input gets its one error line.
    """

    def __init__(self, warnings: list[str], lines: int = 20, parameters: tuple[int, int] | None = None):
        self.warnings, self.lines, self.every, self.total, self.started = warnings, lines, 1, 0, 0.0
        self.parameters = parameters  # (all, those that train) of the model

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
        if plan.throughput:  # --policy throughput: why this split (timing/throughput_plan.py)
            stdout.print(f"--policy throughput: {plan.throughput['reason']}", markup=False, soft_wrap=True)
            line = cost_line(plan.throughput)
            if line:
                stdout.print(line, markup=False, soft_wrap=True)
        for line in phases:
            stdout.print(line, markup=False)
        if plan.recipe.batch.sharding == "fsdp":
            print(f"sharding: fsdp (FSDP2: parameters, gradients and optimizer state split over {plan.world_size} "
                  "processes)", flush=True)
        from ..plan.memory_options import memory_summary

        if plan.weights is not None:
            print(plan.weights.line(plan.recipe.model.builtin or plan.recipe.model.factory), flush=True)
        if self.parameters is not None:
            print(parameters_line(self.parameters), flush=True)
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
        line = f"step {step}/{self.total} loss {loss_text(record['loss'])} lr {record['lr']:.4g}"
        if "eval_loss" in record:
            line += f" eval_loss {loss_text(record['eval_loss'])}"
        if "eval_accuracy" in record:
            line += f" eval_accuracy {record['eval_accuracy']:.4f}"
        if "eval_miou" in record:
            line += f" eval_miou {record['eval_miou']:.4f}"
        rate = ""
        if record.get("useful_tokens_per_second"):  # variable-length text: tokens that are not padding
            rate = f" {record['useful_tokens_per_second']:,.0f} useful tokens/s"
        elif record.get("tokens_per_second") or record.get("samples_per_second"):  # this step's (train/rates.py)
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
        text = plan.recipe.data.text_columns or plan.recipe.data.packing in ("sorted", "packed")
        self.rate_unit = ("tokens/s" if plan.recipe.batch.sequence_length else "useful tokens/s" if text
                          else f"{plan.unit}/s")
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
        rate = (record.get("tokens_per_second") or record.get("useful_tokens_per_second")
                or record.get("samples_per_second") or 0)  # this step's (rates.py)
        self.progress.update(self.task, advance=1, loss=loss_text(record['loss']), rate=f"{rate:,.0f}")

    def message(self, text: str) -> None:
        stderr.print(text)

    def finish(self, summary: dict) -> None:
        self.progress.stop()


SOURCE_HELP = "A plan file from `reproduce plan --out`, or a recipe (a file or a shipped recipe's name)."
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
MERGED_HELP = ("With model.lora, also write OUT/merged: the adapters merged into the base, a Hugging Face folder that "
               "from_pretrained loads (OUT/adapter, peft's save_pretrained folder, is always written).")
AUTO_RESUME_HELP = ("Start when --out holds no run of this plan, resume when it holds an unfinished one, do nothing "
                    "(exit 0) when it is finished; another plan's run is refused. For restarts and requeued jobs.")
MAX_RESTARTS_HELP = ("torchrun restarts the processes up to N times after one fails; the run continues from its last "
                     "checkpoint (implies --auto-resume).")
NNODES_HELP = "Machines in the job (with --nproc-per-node), or MIN:MAX for torchrun's elastic range."
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


def _auto_resume(source: Path, out: Path, max_steps: int | None, is_main: bool, plan_args: tuple) -> tuple[bool, bool]:
    """--auto-resume: (resume, force) for the run in `out`, after refusing another plan's run there; a finished run
    exits 0 at once."""
    state, words = folder_state(out, max_steps)
    if state != "new":
        try:
            recipe_and_plan(source, out, True, *plan_args)
        except UserError as error:
            raise UserError(f"--auto-resume: {out} holds the run of another plan, which it neither resumes nor "
                            f"overwrites ({error})") from None
    if state == "finished":
        if is_main:
            print(f"--auto-resume: the run in {out} is finished ({words}); nothing to do", flush=True)
        raise typer.Exit(0)
    if is_main and state != "new":
        print(f"--auto-resume: {out} holds {words}: " + ("resuming" if state == "unfinished" else "starting again"),
              flush=True)
    return state == "unfinished", state == "started"


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


def check_sync_batchnorm(recipe, processes: int, device: str) -> None:
    """`model.batchnorm: sync` refused before anything is built or launched: one process, or no CUDA device."""
    if recipe.model.batchnorm != "sync":
        return
    from ..train.distributed import World
    from ..train.setup import check_batchnorm, resolve_device

    check_batchnorm("sync", World(size=processes), resolve_device(device))


@app.command("run")
def run_command(
    source: Path = typer.Argument(..., metavar="PLAN_OR_RECIPE", help=SOURCE_HELP),
    out: Path = typer.Option(..., "--out", help=OUT_HELP),
    micro_batch_max: int | None = typer.Option(None, "--micro-batch-max", min=1, help=MICRO_BATCH_MAX_HELP),
    world_size: int = typer.Option(1, "--world-size", min=1, help=WORLD_SIZE_HELP),
    policy: Policy = typer.Option(Policy.exact, "--policy", help=POLICY_HELP),
    max_steps: int | None = typer.Option(None, "--max-steps", min=1, help=MAX_STEPS_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    auto_resume: bool = typer.Option(False, "--auto-resume", help=AUTO_RESUME_HELP),
    max_restarts: int | None = typer.Option(None, "--max-restarts", min=0, metavar="N", help=MAX_RESTARTS_HELP),
    force: bool = typer.Option(False, "--force", help="Overwrite the outputs of another run in --out."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    seed: int | None = typer.Option(None, "--seed", min=0, max=2**64 - 1, help=SEED_HELP),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", min=1, help=CHECKPOINT_HELP),
    skip_nonfinite: bool = typer.Option(False, "--skip-nonfinite", help=SKIP_HELP),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", min=1, help=NPROC_HELP),
    nnodes: str = typer.Option("1", "--nnodes", metavar="N|MIN:MAX", help=NNODES_HELP),
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
    weights: str | None = typer.Option(None, "--weights", metavar="PATH", help=WEIGHTS_HELP),
    backbone_weights: str | None = typer.Option(None, "--backbone-weights", metavar="FILE",
                                                help=BACKBONE_WEIGHTS_HELP),
    workers: int | None = typer.Option(None, "--workers", min=0, help=WORKERS_HELP),
    no_noise_scale: bool = typer.Option(False, "--no-noise-scale", help=NO_NOISE_HELP),
    stop_on_divergence: bool = typer.Option(False, "--stop-on-divergence", help=DIVERGENCE_HELP),
    merged: bool = typer.Option(False, "--merged", help=MERGED_HELP),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing", help=CHECKPOINTING_HELP),
    sharded_gradients: bool = typer.Option(False, "--sharded-gradients", help=SHARDED_GRADIENTS_HELP),
    offload: Offload | None = typer.Option(None, "--offload", help=OFFLOAD_HELP),
    quantize: Quantize | None = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    batchnorm: BatchNormChoice | None = typer.Option(None, "--batchnorm", help=BATCHNORM_HELP),
    packing: PackingChoice | None = typer.Option(None, "--packing", help=PACKING_HELP),
    token_budget: int | None = typer.Option(None, "--token-budget", min=1, help=TOKEN_BUDGET_HELP),
    overrides: list[str] = typer.Option([], "--set", metavar="FIELD.PATH=VALUE", help=SET_HELP),
) -> None:
    """Train with the plan: micro-batches accumulated into the paper's effective batch, exactly."""
    from ..data import build_data
    from ..data.lengths import training_sizes
    from ..data.text import text_warnings
    from ..train import distributed  # torch is imported only by the commands that train
    from ..train.trainer import RunOptions, train

    source = recipe_argument(source, "plan or recipe")
    trackers = parse_log_to(log_to, tensorboard)
    check_trackers(trackers)  # a missing package: one line, before anything is planned or trained
    world = distributed.world_from_env()
    sharding_name = value_of(sharding)
    memory_flags = (activation_checkpointing, sharded_gradients, value_of(offload))
    launching = nproc_per_node is not None and not world.distributed
    _, nodes = node_range(nnodes)
    if launching and nodes > 1 and rdzv_endpoint is None:
        raise UserError("--rdzv-endpoint: required with --nnodes > 1 (HOST:PORT of node 0)")
    auto_resume = auto_resume or max_restarts is not None
    if auto_resume:
        auto_resume_flags(resume, force, max_restarts, launching)
        resume, force = _auto_resume(source, out, max_steps, world.is_main, (
            sharding_name, data_path, eval_data_path, weights, value_of(quantize), backbone_weights, overrides))
    if launching:
        processes = nproc_per_node * nodes  # an elastic job is planned for its most nodes; fewer re-derive N
        # bad input: one line, before launching
        recipe, plan = recipe_and_plan(source, out, resume, sharding_name, data_path, eval_data_path, weights,
                                       value_of(quantize), backbone_weights, overrides)
        recipe, plan = packing_for_run(recipe, plan, resume, value_of(packing), token_budget)
        recipe, plan = memory_for_run(recipe, plan, resume, out, *memory_flags)
        recipe, plan = batchnorm_for_run(recipe, plan, value_of(batchnorm))
        check_sync_batchnorm(recipe, processes, device)
        check_sharding(recipe, processes)
        check_sharded_probe(recipe, plan, micro_batch_max, meter.value)
        check_launch_policy(policy.value, plan, processes)
        args = _forwarded_args(
            source, out,
            {"--policy": policy.value, "--device": device, "--micro-batch-max": micro_batch_max,
             "--max-steps": max_steps, "--seed": seed, "--checkpoint-every": checkpoint_every, "--memory": memory,
             "--gpu": gpu, "--meter": meter.value, "--headroom": headroom, "--sharding": sharding_name,
             "--data": data_path, "--eval-data": eval_data_path, "--weights": weights, "--workers": workers,
             "--backbone-weights": backbone_weights,
             "--log-to": ",".join(trackers) or None, "--offload": offload.value if offload is not None else None,
             "--quantize": value_of(quantize), "--batchnorm": value_of(batchnorm), "--packing": value_of(packing),
             "--token-budget": token_budget},
            {"--resume": resume and not auto_resume, "--force": force and not auto_resume,
             "--auto-resume": auto_resume, "--skip-nonfinite": skip_nonfinite, "--no-cache": no_cache,
             "--no-noise-scale": no_noise_scale, "--stop-on-divergence": stop_on_divergence, "--merged": merged,
             "--activation-checkpointing": activation_checkpointing, "--sharded-gradients": sharded_gradients},
        )
        args += [part for override in overrides for part in ("--set", override)]  # each process sets them too
        command = distributed.torchrun_command(args, nproc_per_node, nnodes, node_rank, rdzv_endpoint,
                                               max_restarts=max_restarts)
        os.environ[LAUNCHER_ENV] = shlex.join(launcher_args(nproc_per_node, nnodes, node_rank, rdzv_endpoint))
        check_out_dir(out, resume, force)
        with lock.hold_for_launch(out, nodes):  # one machine: the launcher's, for its whole life; several: rank 0's
            print("launching: " + " ".join(command), flush=True)
            code = _launch(command)
        raise typer.Exit(code)
    if world.distributed:
        world_size = world.size
    recipe, plan = recipe_and_plan(source, out, resume, sharding_name, data_path, eval_data_path, weights,
                                   value_of(quantize), backbone_weights, overrides)
    recipe, plan = packing_for_run(recipe, plan, resume, value_of(packing), token_budget)
    recipe, plan = memory_for_run(recipe, plan, resume, out, *memory_flags)
    recipe, plan = batchnorm_for_run(recipe, plan, value_of(batchnorm))
    check_sync_batchnorm(recipe, world.size, device)
    check_sharding(recipe, world.size)
    check_sharded_probe(recipe, plan, micro_batch_max, meter.value)
    check_out_dir(out, resume, force)  # --out taken (one run per folder) and writable before anything is set up
    with lock.hold(out) if lock.owns_the_run(world.distributed, world.rank) else contextlib.nullcontext():
        data = build_data(recipe)
        size = training_sizes(recipe, data["train"])  # per sequence length when batch phases change it
        options = probe_options(memory, gpu, meter, headroom, no_cache)
        on_note = show_note if world.is_main else None
        if plan is None and world.distributed and micro_batch_max is None:
            # every rank probes its own device; all take the smallest result, so no rank runs out of memory
            from ..train.setup import resolve_device

            rank_device = distributed.init(world, resolve_device(device))
            recipe, micro_batch_max = probe_consensus(
                recipe, str(source), world_size, policy.value, size,
                lambda maximum: distributed.all_min(world, maximum, rank_device), probe=options, data=data,
                on_note=on_note)
        plan, warnings = run_plan(recipe, str(source), plan, micro_batch_max, world_size, policy.value, size, resume,
                                  probe=options, data=data, on_note=on_note)
        warnings = [*warnings, *text_warnings(data.get("info") or {})]  # what tokenising cut, with counts
        micro_max = micro_batch_max if isinstance(micro_batch_max, int) else None  # (per-length maxima: no option)
        continue_with = continue_command(
            out, {"--max-steps": max_steps, "--micro-batch-max": micro_max,
                  "--data": absolute(data_path), "--eval-data": absolute(eval_data_path), "--workers": workers,
                  "--device": device if device != "auto" else None, "--seed": seed,
                  "--checkpoint-every": checkpoint_every,
                  "--log-to": ",".join(trackers) or None},
            {"--skip-nonfinite": skip_nonfinite, "--no-noise-scale": no_noise_scale,
             "--stop-on-divergence": stop_on_divergence, "--merged": merged},
            launcher_of_this_job(world.size) if world.distributed else [],
        )
        train_options = RunOptions(device=device, max_steps=max_steps, resume=resume, force=force, seed=seed,
                                   checkpoint_every=checkpoint_every, skip_nonfinite=skip_nonfinite, data=data,
                                   workers=workers, noise_scale=not no_noise_scale, continue_with=continue_with,
                                   stop_on_divergence=stop_on_divergence, merged=merged)
        if not world.is_main:  # the other ranks train quietly; rank 0 reports
            train(plan, out, train_options)
            return
        parameters = counted_parameters(plan, data)
        reporter = (RichReporter if is_terminal() else PlainReporter)(warnings, parameters=parameters)
        # metrics.jsonl stays the source of truth; the trackers get the same numbers (train/trackers.py)
        with TrackerReporter(reporter, trackers, out) as reporter:
            summary = train(plan, out, train_options.replace(reporter=reporter))
        stdout.print(done_line(summary, skip_nonfinite))
        for row in summary.get("reported") or []:
            stdout.print(reported_line(row), markup=False, soft_wrap=True)
        noise = summary.get("noise_scale")
        if noise and not noise.get("noted"):  # a run that cannot measure it said so at its start
            stdout.print(f"noise scale: {noise['sentence']}", markup=False, soft_wrap=True)
        folders = "".join(f", {name}/" for name in ("adapter", "merged") if summary.get(name))  # (models/trained.py)
        stdout.print(f"outputs in {out}: plan.yaml, metrics.jsonl, model.pt, summary.json, "
                     f"checkpoints/last.pt{folders}")
        if summary.get("plot"):
            stdout.print(summary["plot"], markup=False)


def done_line(summary: dict, skip_nonfinite: bool) -> str:
    """The line a finished run prints: its steps and time, the final loss and evaluation, the data's wait."""
    final = summary["final"]
    line = f"done: {summary['steps']} steps in {summary['seconds']:.1f}s"
    this_call = summary.get("this_call") or {}
    if summary.get("resumed_from_step"):  # the whole run, then what this call added
        line += f" ({this_call['steps']} in this call, {this_call['seconds']:.1f}s)"
    line += f", final loss {loss_text(final['loss'])}"
    if skip_nonfinite:  # (counted in this call)
        skipped = summary.get("skipped_nonfinite", 0)
        line += f", skipped {skipped} non-finite step{'' if skipped == 1 else 's'}"
    if "eval_accuracy" in final:
        line += f", eval accuracy {final['eval_accuracy']:.4f}"
    if "eval_miou" in final:
        line += f", eval mIoU {final['eval_miou']:.4f}, pixel accuracy {final['eval_pixel_accuracy']:.4f}"
    if "eval_loss" in final:
        line += f", eval loss {loss_text(final['eval_loss'])}"
    if summary.get("data_share") is not None:
        workers = f"{summary['workers']} worker{'' if summary['workers'] == 1 else 's'}"
        line += f"; waited for data {summary['data_share']:.0%} of the time ({workers})"
    return line
