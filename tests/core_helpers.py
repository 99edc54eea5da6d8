"""The helpers that import no torch: the planner tests' small recipe (`make_recipe`), the CLI in this process
(`cli`, `cli_json`) and `snapshot`. tests/core/ imports only these (its tests run without torch); helpers.py
re-exports them, so every other test module keeps importing from helpers.py.

Test modules import from here or from helpers.py, never from conftest.py or from one another.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from reproduce.plan.recipe import parse_recipe

# A small, valid recipe used across the planner tests (numbers chosen for easy arithmetic).
BASE = {
    "batch": {"effective": 128, "unit": "samples", "devices": 4, "per_device": 32},
    "task": "classification",
    "model": {"builtin": "mlp"},
    "data": {"builtin": "digits", "train_size": 1000},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {
        "warmup": {"epochs": 1},
        "decay": {"kind": "step", "milestones": {"epochs": [5, 8]}, "factor": 0.1},
        "total": {"epochs": 10},
    },
}


def make_recipe(**overrides):
    """BASE with nested overrides: make_recipe(batch={"effective": 96}) merges into BASE['batch']."""
    data = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        elif value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return parse_recipe(data, source="test")


# ---- the CLI in this process ---------------------------------------------------------------------------------


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`reproduce ARGV` in this process: its exit code, stdout and stderr."""
    from reproduce.cli import main

    capsys.readouterr()
    try:
        main([str(arg) for arg in argv])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_json(capsys, command: str, *argv: str) -> dict:
    """`reproduce COMMAND ARGV --json`, which must exit 0: its JSON."""
    code, out, err = cli(capsys, command, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` by its SHA-256: compared before and after a refused command (nothing written)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
