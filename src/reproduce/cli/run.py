"""`reproduce run PLAN_OR_RECIPE --out DIR`: the paper's large-batch run, on micro-batches, exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from ..errors import Interrupted, UserError
from ..observe.outputs import check_out_dir, run_outputs
from ..observe.trackers import LOG_TO_HELP, Trackers, parse_log_to
from ..plan.launch import node_range
from ..plan.planfile import load_plan
from ..session import check_launch_policy, checked_run, prepare_run
from ..storage import lock, signals
from ..storage.aside import settle
from ..train.options import RunRequest
from . import options
from .app import app
from .common import recipe_argument, show_note
from .reporters import PlainReporter, RichReporter

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
RUN_SHARDING_HELP = options.SHARDING_HELP + " A resumed run keeps its own."


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

ACCEPT_GATE_HELP = ("With --resume: go on past the gate NAME the run paused at (its miss recorded as accepted); "
                    "repeatable.")
FROM_GATE_HELP = ("With --resume: start from the checkpoint kept at the gate GATE (checkpoints/gate-GATE.pt), the "
                  "same state as the uninterrupted run after that step.")
REFERENCE_HELP = ("An earlier run of this recipe (its folder): this run's curve must stay within the recipe's "
                  "reference.band of its at the reference's logged steps; repeatable (several seeds give the band "
                  "from their spread).")


def run_request(context: typer.Context) -> RunRequest:
    """The run command's options as one frozen request: each parameter named as a field gives it, the alias options
    their changes, the trackers parsed, `--max-restarts` implying `--auto-resume`."""
    given = context.params
    values = {item.name: given[item.name].value if isinstance(given[item.name], Enum) else given[item.name]
              for item in dataclasses.fields(RunRequest) if item.name in given}
    return RunRequest(**{**values, "source": recipe_argument(given["source"], "plan or recipe"),
                         "auto_resume": given["auto_resume"] or given["max_restarts"] is not None,
                         "log_to": tuple(parse_log_to(given["log_to"], given["tensorboard"])),
                         "overrides": tuple(given["overrides"] or ()), "changes": tuple(options.alias_changes(context)),
                         "accept_gate": tuple(given["accept_gate"]), "reference": tuple(given["reference"])})


def request_args(request: RunRequest, which: str) -> list[str]:
    """The options `which` repeats ("torchrun": each process's; "resume": the continuing command's) as arguments;
    a resume repeats of the recipe's changes only the data's paths (its plan.yaml keeps the others)."""
    args: list[str] = []
    flags = options.request_flags()  # each field's flag, as the command declares it (`overrides` is --set)
    for name, value in request.given(which).items():
        if name == "overrides":
            args += [part for text in value for part in (flags[name], text)]  # type: ignore[attr-defined]
        elif value is True:
            args.append(flags[name])
        else:
            args += [flags[name], ",".join(value) if isinstance(value, tuple) else str(value)]
    for change in request.changes:
        flag = options.FLAG_OF_FIELD[change.path]
        if which == "torchrun":
            args += [flag] + ([] if change.value is True else [str(change.value)])
        elif change.path in ("data.path", "data.eval_path"):
            args += [flag, str(Path(str(change.value)).expanduser().absolute())]
    return args


# The command that continues an interrupted run, `reproduce run OUT/plan.yaml --out OUT --resume`, with every option
# that shapes the run, so that pasted as printed it goes on with the same run.


def launcher_args(nproc_per_node: int, nnodes: int | str, node_rank: int, rdzv_endpoint: str | None) -> list[str]:
    args = ["--nproc-per-node", str(nproc_per_node)]
    if str(nnodes) != "1":
        args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if rdzv_endpoint is not None:
        args += ["--rdzv-endpoint", rdzv_endpoint]
    return args


def launcher_of_this_job(world_size: int) -> list[str]:
    """torchrun's options for the resume command: as `--nproc-per-node` launched this job, else (torchrun started
    by hand) from the variables torchrun sets."""
    given = os.environ.get(lock.LAUNCHER_ENV)
    if given is not None:
        return shlex.split(given)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return launcher_args(local, max(1, world_size // local), int(os.environ.get("GROUP_RANK", 0)), None)


def continue_command(request: RunRequest, world: Any) -> str:
    """The command that continues this run after a signal, with every option that shapes it (torchrun's too)."""
    launcher = launcher_of_this_job(world.size) if world.distributed else []
    out, args = request.out, request_args(request, "resume")
    return shlex.join(["reproduce", "run", str(out / "plan.yaml"), "--out", str(out), "--resume", *launcher, *args])


def folder_state(out: Path, max_steps: int | None) -> tuple[str, str]:
    """Where the run in `out` stands for --auto-resume, and a few words on it: `new`, `started` (plan.yaml, no
    checkpoint: start again), `unfinished` (resume) or `finished` (judged from the last checkpoint, never from a
    summary.json that may be damaged)."""
    if not (out / "plan.yaml").is_file():
        return "new", "no run there"
    if not (out / "checkpoints" / "last.pt").is_file():
        try:  # (nothing to check it against)
            summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = {}
        summary = summary if isinstance(summary, dict) else {}
        steps, planned = summary.get("steps"), summary.get("planned_steps") or summary.get("steps")
        if isinstance(steps, int) and isinstance(planned, int) and steps >= (
                planned if max_steps is None else min(max_steps, planned)):
            return "finished", f"{steps} of {planned} optimizer steps run"
        return "started", "its plan.yaml but no checkpoint yet"
    from ..train.resume import finished_state  # (torch: only for a folder with a checkpoint)

    try:
        planned = load_plan(out / "plan.yaml").optimizer_steps
    except UserError:  # the resume says what is wrong with it
        planned = None
    return finished_state(out, max_steps, planned)


def auto_resumed(request: RunRequest, world: Any, launching: bool) -> tuple[bool, bool]:
    """(resume, force) as --auto-resume decides, after refusing another plan's run (a finished run exits 0); it
    chooses between starting and --resume itself, and --max-restarts is torchrun's."""
    if request.resume or request.force:
        raise UserError(f"--auto-resume: it decides between starting and resuming by itself; without "
                        f"{'--resume' if request.resume else '--force'}")
    if request.max_restarts is not None and not launching:
        raise UserError("--max-restarts: torchrun restarts the processes it launched; give --nproc-per-node "
                        "(or run torchrun --max-restarts yourself, with --auto-resume)")
    state, words = folder_state(request.out, request.max_steps)
    if state != "new":
        try:
            checked_run(request, 1, True)
        except UserError as error:
            raise UserError(f"--auto-resume: {request.out} holds the run of another plan, which it neither resumes "
                            f"nor overwrites ({error})") from None
    if state == "finished":
        if world.is_main:
            print(f"--auto-resume: the run in {request.out} is finished ({words}); nothing to do", flush=True)
        raise typer.Exit(0)
    if world.is_main and state != "new":
        print(f"--auto-resume: {request.out} holds {words}: " + ("resuming" if state == "unfinished" else
                                                                  "starting again"), flush=True)
    return state == "unfinished", state == "started"


COMMAND_ENV = "REPRODUCE_COMMAND"  # the command the user typed, for the processes a launcher started


def launch(request: RunRequest, world: Any) -> int:
    """`--nproc-per-node`: the run's checks here, then torchrun starting this command in each process."""
    from ..train.distributed import processes as distributed

    _, nodes = node_range(request.nnodes)
    if nodes > 1 and request.rdzv_endpoint is None:
        raise UserError("--rdzv-endpoint: required with --nnodes > 1 (HOST:PORT of node 0)")
    with lock.hold_for_launch(request.out, nodes):  # one machine: the launcher's, for its whole life; several: rank 0's
        if nodes == 1 and (note := settle(request.out, run_outputs(request.out))):  # (what a killed --force left)
            show_note(f"note: {note}")
        resume, force = auto_resumed(request, world, True) if request.auto_resume else (request.resume, request.force)
        processes = request.nproc_per_node * nodes  # an elastic job is planned for its most nodes; fewer re-derive N
        _, plan = checked_run(request, processes, resume)  # bad input: one line, before launching
        check_launch_policy(request.policy, plan, processes)
        args = [str(request.source), "--out", str(request.out), *request_args(request, "torchrun")]
        launcher = (request.nproc_per_node, request.nnodes, request.node_rank, request.rdzv_endpoint)
        command = distributed.torchrun_command(args, *launcher, max_restarts=request.max_restarts)
        os.environ[lock.LAUNCHER_ENV] = shlex.join(launcher_args(*launcher))
        check_out_dir(request.out, resume, force)
        print("launching: " + " ".join(command), flush=True)
        return _launch(command)


def _launch(command: list[str]) -> int:
    """Run torchrun: its workers die with this process, get its signals, and say their ending through it, once."""
    from ..train.distributed.launched import run_launched

    return run_launched(command, shlex.join(["reproduce", *map(str, options.typed_args)]))


starting_run: dict[str, Any] = {}  # the run command's request, and whether it resumes or forces (once decided)


def stops_in_one_line(command):
    """The run command with SIGINT / SIGTERM handled before and after the trainer's part, in one line, exit 130 / 143,
    with the command that goes on: the resume of the checkpoint that was there, else the command as typed."""

    @functools.wraps(command)
    def guarded(**kwargs: Any) -> None:
        decided = starting_run
        decided.clear()
        with signals.guard():
            try:
                command(**kwargs)
            except signals.SignalReceived as received:
                if "request" not in decided:  # (before the options were read: nothing decided, nothing written)
                    raise Interrupted(f"{received.name} before the run started", received.exit_code) from None
                out = decided["request"].out
                if decided["resume"] and (out / "checkpoints" / "last.pt").is_file():
                    from ..train.distributed import processes as distributed

                    then = (f"{out / 'checkpoints' / 'last.pt'} is as it was. Continue with: "
                            + continue_command(decided["request"], distributed.world_from_env()))
                else:
                    kept = "the previous run is back in place" if decided["force"] else "nothing of this run was kept"
                    typed = os.environ.get(COMMAND_ENV) or shlex.join(["reproduce", *map(str, options.typed_args)])
                    then = f"{kept} in {out}. Start again with: {typed}"
                when = "this call's first optimizer step" if decided["resume"] else "the first optimizer step"
                raise Interrupted(f"{received.name} before {when}; {then}", received.exit_code) from None
            received = signals.take()
            if received is not None:  # after the end was written: nothing to continue
                raise Interrupted(f"{signal.Signals(received).name} after the run finished: its outputs in "
                                  f"{decided['request'].out} are complete",
                                  signals.EXIT_CODES[signal.Signals(received)])

    return guarded


def train_in_folder(request: RunRequest, world: Any) -> None:
    """The run in --out: the folder taken and checked, the run prepared, trained and shown (rank 0)."""
    from ..train.reporter import Reporters
    from ..train.trainer import train_checked

    owner = lock.owns_the_run(world.distributed, world.rank)
    # --out taken (one run per folder), writable and settled before anything is decided or set up
    with lock.hold(request.out) if owner else contextlib.nullcontext():
        note = settle(request.out, run_outputs(request.out)) if owner else None  # (what a killed --force left)
        if note and world.is_main:
            show_note(f"note: {note}")
        resume, force = auto_resumed(request, world, False) if request.auto_resume else (request.resume, request.force)
        starting_run.update(resume=resume, force=force)
        if request.from_gate is not None and not resume:
            raise UserError("--from: starts a resumed run from a gate's checkpoint; give it with --resume")
        checked = checked_run(request, world.size, resume)
        check_out_dir(request.out, resume, force)
        prepared = prepare_run(request, world, resume, show_note if world.is_main else None, checked)
        continue_with = continue_command(request, world)
        decided = dataclasses.replace(request, resume=resume, force=force)  # as --auto-resume decided
        if not world.is_main:  # the other ranks train quietly; rank 0 reports
            train_checked(prepared.plan, decided, world, data=prepared.data, continue_with=continue_with)
            return
        renderer = (RichReporter if sys.stdout.isatty() else PlainReporter)(prepared.warnings)
        # metrics.jsonl stays the source of truth; the trackers asked for get the same records, beside the renderer
        with Trackers(list(request.log_to), request.out) if request.log_to else contextlib.nullcontext() as trackers:
            reporter = Reporters(trackers, renderer) if trackers else Reporters(renderer)
            train_checked(prepared.plan, decided, world, data=prepared.data, reporter=reporter,
                          continue_with=continue_with)


@app.command("run")
@stops_in_one_line
def run_command(
    context: typer.Context,
    source: Path = typer.Argument(..., metavar="PLAN_OR_RECIPE", help=SOURCE_HELP),
    out: Path = typer.Option(..., "--out", help=OUT_HELP),
    micro_batch_max: options.MicroBatchMaxOption = None,
    world_size: options.WorldSizeOption = 1,
    policy: options.PolicyOption = options.Policy.exact,
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
    memory: options.MemoryOption = None,
    gpu: options.GpuOption = None,
    meter: options.MeterOption = options.MeterName.auto,
    headroom: options.HeadroomOption = 0.1,
    no_cache: options.NoCacheOption = False,
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also log each step's metrics to OUT/tensorboard."),
    log_to: list[str] | None = typer.Option(None, "--log-to", metavar="TRACKERS", help=LOG_TO_HELP),
    sharding: options.Sharding | None = typer.Option(None, "--sharding", help=RUN_SHARDING_HELP),
    data: str | None = typer.Option(None, "--data", metavar="PATH", help=DATA_HELP),
    eval_data: str | None = typer.Option(None, "--eval-data", metavar="PATH", help=EVAL_DATA_HELP),
    weights: options.WeightsOption = None,
    backbone_weights: options.BackboneWeightsOption = None,
    workers: int | None = typer.Option(None, "--workers", min=0, help=WORKERS_HELP),
    no_noise_scale: bool = typer.Option(False, "--no-noise-scale", help=NO_NOISE_HELP),
    stop_on_divergence: bool = typer.Option(False, "--stop-on-divergence", help=DIVERGENCE_HELP),
    merged: bool = typer.Option(False, "--merged", help=MERGED_HELP),
    activation_checkpointing: options.CheckpointingOption = False,
    sharded_gradients: options.ShardedGradientsOption = False,
    offload: options.OffloadOption = None,
    quantize: options.QuantizeOption = None,
    batchnorm: options.BatchNormOption = None,
    packing: options.PackingOption = None,
    token_budget: options.TokenBudgetOption = None,
    overrides: options.SetOption = None,
    accept_gate: list[str] = typer.Option([], "--accept-gate", metavar="NAME", help=ACCEPT_GATE_HELP),
    from_gate: str | None = typer.Option(None, "--from", metavar="GATE", help=FROM_GATE_HELP),
    reference: list[str] = typer.Option([], "--reference", metavar="RUN_DIR", help=REFERENCE_HELP),
) -> None:
    """Train with the plan: micro-batches accumulated into the paper's effective batch, exactly."""
    request = run_request(context)  # the one value of the options above, from here to the trainer
    starting_run.update(request=request, resume=request.resume, force=request.force)
    from ..train.distributed import processes as distributed  # torch is imported only by the commands that train
    world = distributed.world_from_env()
    # under reproduce's launcher (even alone after an elastic restart): die with it, take its signals
    from ..train.distributed.launched import join_launcher

    join_launcher()
    if request.nproc_per_node is not None and not world.distributed:
        raise typer.Exit(launch(request, world))
    train_in_folder(request, world)
