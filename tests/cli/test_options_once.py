"""Each option that aliases a recipe field, and each of the probe's, is declared once (cli/options.py), and a
command's aliases become its changes from its own declarations; `run`'s options are one RunRequest, from the command
line to the trainer (train/options.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import typer.main

from reproduce.cli import app
from reproduce.cli.options import FIELD_OF_FLAG, alias_changes
from reproduce.cli.run import run_request
from reproduce.plan.overlay import Change
from reproduce.train.options import RunRequest

CLI = Path(__file__).resolve().parents[2] / "src" / "reproduce" / "cli"
# options whose help says what the command does with them, so each command declares its own
OWN_HELP = {"--data", "--eval-data", "--sharding", "--world-size", "--meter"}


def parsed(command: str, *args: str) -> typer.Context:
    """The command's context after parsing `args`, as typer gives it to the command (nothing runs)."""
    return typer.main.get_command(app).commands[command].make_context(command, list(args))


def test_each_shared_option_is_declared_once_in_the_cli():
    shared = [*FIELD_OF_FLAG, "--micro-batch-max", "--policy", "--set", "--memory", "--gpu", "--headroom", "--no-cache"]
    source = "\n".join(path.read_text() for path in sorted(CLI.glob("*.py")))
    declared = {flag: len(re.findall(rf'typer\.Option\([^)]*"{flag}"', source)) for flag in shared}
    assert {flag: n for flag, n in declared.items() if flag not in OWN_HELP and n != 1} == {}


def test_a_commands_aliases_are_found_by_their_flags_in_the_tables_order():
    context = parsed("plan", "digits-mlp", "--packing", "sorted", "--token-budget", "512", "--weights", "w.pt",
                     "--activation-checkpointing", "--data", "train/")
    assert alias_changes(context) == [
        Change("model.weights", "w.pt", "`model.weights`"), Change("data.path", "train/", "`data.path`"),
        Change("model.activation_checkpointing", True, "`model.activation_checkpointing`"),
        Change("data.packing", "sorted", "`data.packing`"), Change("data.token_budget", 512, "`data.token_budget`")]
    assert alias_changes(parsed("memory", "digits-mlp", "--micro-batch", "4")) == []  # none given: no change


def test_the_run_request_holds_every_option_by_its_name(tmp_path):
    context = parsed("run", "papers/digits-mlp.yaml", "--out", str(tmp_path), "--micro-batch-max", "8",
                     "--packing", "none", "--memory", "1GiB", "--meter", "cpu", "--no-noise-scale", "--from", "warm",
                     "--max-restarts", "2", "--tensorboard", "--set", "optimizer.lr=0.5", "--accept-gate", "a")
    request = run_request(context)
    assert (request.out, request.micro_batch_max, request.memory, request.meter) == (tmp_path, 8, "1GiB", "cpu")
    assert request.no_noise_scale and request.from_gate == "warm" and request.accept_gate == ("a",)
    assert request.auto_resume and request.max_restarts == 2  # --max-restarts implies --auto-resume
    assert request.log_to == ("tensorboard",) and request.overrides == ("optimizer.lr=0.5",)
    assert request.changes == (Change("data.packing", "none", "`data.packing`"),)
    assert request.given("resume") == {"micro_batch_max": 8, "log_to": ("tensorboard",), "no_noise_scale": True}


def test_every_option_of_run_reaches_the_request():
    """A new option of `run` is a field of RunRequest (by its parameter's name) or an alias of a recipe field; only
    --tensorboard is neither (it is one of the trackers, `log_to`)."""
    names = {item.name for item in dataclasses.fields(RunRequest)}
    params = typer.main.get_command(app).commands["run"].params
    aliases = {param.name for param in params if param.opts[0] in FIELD_OF_FLAG}
    assert {param.name for param in params} - names - aliases == {"tensorboard"}
