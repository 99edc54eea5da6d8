"""Errors carry the field, not the flag: outside cli/ a user error names the request's field (`micro_batch_max`) or
the recipe's dotted path (`batch.sharding`), never a command-line flag, so a library caller is told about what it
passed; the CLI turns each name into the flag the user typed, in one place (reproduce.cli.options)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from helpers import digits_recipe
from reproduce.cli import main
from reproduce.cli.options import FLAG_OF_FIELD, as_typed, request_flags
from reproduce.cli.reporters import PlainReporter
from reproduce.errors import UserError
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe

SRC = Path(__file__).resolve().parents[2] / "src" / "reproduce"

# Modules whose messages still spell a flag, each with the reason. An entry goes once its module spells no flag (the
# last test checks it).
NOT_YET: dict[str, str] = {}
# helpers whose string argument is the name their errors open with (a file or size named by a field)
LABELLED = {"check_writable", "parse_size", "read_torch_file", "inspect"}
SAID = {"message"}  # a run's lines to its reporter, which the CLI prints as it prints an error
# the library API's modules, which no command calls: a name in backticks there is its caller's argument (`count`)
LIBRARY_ONLY = ("accumulate.py", "library/", "integrations/")


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """UserError, TrainingStopped and every class derived from them in src/ (DoesNotFit, BudgetRequired, ...)."""
    names = {"UserError", "TrainingStopped"}
    while True:
        more = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                and any(getattr(base, "id", None) in names for base in node.bases)} - names
        if not more:
            return names
        names |= more


def _messages() -> dict[str, list[tuple[int, str]]]:
    """Module (relative to src/reproduce) -> (line, text) of every string in a user error's arguments, outside cli/."""
    trees = {path: ast.parse(path.read_text()) for path in SRC.rglob("*.py")}
    called = _error_classes(trees) | LABELLED | SAID
    found: dict[str, list[tuple[int, str]]] = {}
    for path, tree in trees.items():
        name = path.relative_to(SRC).as_posix()
        if name.startswith("cli/"):
            continue
        for call in ast.walk(tree):
            func = getattr(call, "func", None)
            if not isinstance(call, ast.Call) or getattr(func, "id", getattr(func, "attr", None)) not in called:
                continue
            for argument in [*call.args, *(keyword.value for keyword in call.keywords)]:
                for node in ast.walk(argument):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str):
                        found.setdefault(name, []).append((node.lineno, node.value))
    return found


def _flags() -> set[str]:
    return set(request_flags().values()) | set(FLAG_OF_FIELD.values())


def _spelled(text: str) -> list[str]:
    return [flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text) if flag in _flags()]


def test_no_user_error_outside_cli_spells_a_flag():
    messages = _messages()
    assert len(messages) > 40  # the scan sees the modules that raise (not an empty walk)
    spelled = [f"{name}:{line}: {' '.join(_spelled(text))}" for name, found in messages.items() if name not in NOT_YET
               for line, text in found if _spelled(text)]
    assert not spelled, "name the field in backticks (`micro_batch_max`), not the flag:\n" + "\n".join(spelled)


def test_every_name_in_backticks_is_a_field_the_cli_knows():
    """A request's field in backticks must be an option's parameter name, else the CLI would print it as it is."""
    words = {"backbone"}  # a module's attribute (models/segmentation.py), not a field
    unknown = set()
    for module, found in _messages().items():
        if module.startswith(LIBRARY_ONLY):  # the library's own calls: its errors name their arguments
            continue
        for _, text in found:
            for name in re.findall(r"`([a-z][a-z0-9_]*)`", text):
                if name not in request_flags() and name not in words:
                    unknown.add(name)
    assert not unknown


def test_not_yet_lists_only_modules_that_still_spell_flags():
    messages = _messages()
    done = [name for name in NOT_YET if not any(_spelled(text) for _, text in messages.get(name, []))]
    assert not done, f"these spell no flag any more: drop them from NOT_YET: {done}"


def test_a_request_field_prints_as_its_flag_whether_typed_or_not():
    line = "`micro_batch_max`: must be >= 1 (got 0)"
    assert as_typed(line, []) == "--micro-batch-max: must be >= 1 (got 0)"
    assert as_typed(line, ["plan", "x.yaml", "--micro-batch-max", "0"]) == "--micro-batch-max: must be >= 1 (got 0)"
    assert (as_typed("give `memory` SIZE or `gpu` NAME (`reproduce memory` says more)", []) ==
            "give --memory SIZE or --gpu NAME (`reproduce memory` says more)")


@pytest.mark.parametrize("argv, shown", [
    (["run", "r.yaml", "--sharding", "fsdp"], "--sharding"),
    (["run", "r.yaml", "--sharding=fsdp"], "--sharding"),
    (["run", "r.yaml"], "batch.sharding"),  # written in the recipe file
    (["run", "r.yaml", "--set", "batch.sharding=fsdp"], "batch.sharding"),
])
def test_a_recipe_field_prints_as_the_user_gave_it(argv, shown):
    line = "`batch.sharding`: fsdp needs 2 processes or more"
    assert as_typed(line, argv) == f"{shown}: fsdp needs 2 processes or more"


def test_the_field_opens_the_message_and_stays_on_the_error():
    error = UserError("must be >= 1 (got 0)", "a second line", field="micro_batch_max")
    assert error.field == "micro_batch_max"
    assert error.lines == ["`micro_batch_max`: must be >= 1 (got 0)", "a second line"]
    assert UserError("no field here").field is None


def test_a_library_caller_sees_the_argument_the_cli_user_the_flag(tmp_path, capsys):
    recipe = digits_recipe({"name": "sgd", "lr": 0.1}, effective=64)
    with pytest.raises(UserError) as caught:
        make_plan(parse_recipe(recipe), micro_batch_max=4, world_size=65)
    assert caught.value.field == "world_size"
    assert str(caught.value) == ("`world_size`: 65 processes exceed the paper's effective batch of 64 samples: each "
                                 "process needs at least one")
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path), "--micro-batch-max", "4", "--world-size", "65"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --world-size: 65 processes exceed the paper's effective batch of 64 samples: each process needs at "
        "least one")


def test_a_run_s_message_names_its_flag_as_an_error_does(capsys):
    """The trainer's lines name the run's fields (`workers`); the CLI's reporter prints each as its flag."""
    PlainReporter([]).message("warning: the loader is the bottleneck ... with `workers` 0; more workers ...")
    PlainReporter([]).message("note: checkpoints/last.pt: a `force` run was stopped before its first checkpoint")
    assert capsys.readouterr().err.splitlines() == [
        "warning: the loader is the bottleneck ... with --workers 0; more workers ...",
        "note: checkpoints/last.pt: a --force run was stopped before its first checkpoint"]
