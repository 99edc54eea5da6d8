"""`reproduce.probe_step` on a user's own step (library/probing.py): the CLI probe's search and cpu meter around a
callable; for the same model, loss and optimizer as a recipe it finds what `reproduce probe` finds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reproduce
from reproduce.data import build_data
from reproduce.data.batches import fetch
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.recipe import load_recipe
from reproduce.probe.runner import ProbeOptions, run_probe
from reproduce.shipped import resolve_recipe

BUDGET = "512KiB"


def test_the_probe_of_a_user_step_finds_what_reproduce_probe_finds(isolated):
    recipe = load_recipe(resolve_recipe("digits-mlp"))
    data = build_data(recipe)
    cli = run_probe(recipe, "digits-mlp", ProbeOptions(memory=BUDGET, meter="cpu", use_cache=False,
                                                       time_steps=False), data=data)
    # the user's side: the same model, their own SGD with momentum, their own loss, a window of two micro-batches
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, data.info)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = reproduce.Accumulator(model, optimizer)

    def step(micro_batch: int) -> None:
        micro_batches = [fetch(data.train, torch.arange(micro_batch)) for _ in range(reproduce.PROBE_WINDOW)]
        with acc.window([micro_batch] * len(micro_batches)) as window:
            for inputs, targets in micro_batches:
                window.backward(F.cross_entropy(model(inputs), targets, reduction="sum"))

    ours = reproduce.probe_step(step, cap=cli.cap, model=model, optimizer=optimizer, memory=BUDGET, meter="cpu",
                           time_steps=False)
    assert 1 < cli.micro_batch_max < cli.cap  # the budget binds
    assert ours.micro_batch_max == cli.micro_batch_max
    assert (ours.limit_bytes, ours.cap, ours.meter) == (cli.limit_bytes, cli.cap, cli.meter)
    assert ours.peak_bytes == pytest.approx(cli.peak_bytes, rel=0.02)
    # a trial over the budget ran out of memory and left no gradient behind
    assert any(not trial.fits for trial in ours.trials)
    assert all(p.grad is None for p in model.parameters())


def test_the_estimate_meter_is_refused_on_a_user_step():
    with pytest.raises(UserError, match="`meter`: expected cpu, cuda or auto"):
        reproduce.probe_step(lambda m: None, cap=4, memory="1MiB", meter="estimate")
