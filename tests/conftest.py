from __future__ import annotations

import copy

import pytest

from reproduce.recipe import parse_recipe

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


@pytest.fixture
def recipe():
    return make_recipe()
