"""`loss.normalization` (accumulate.py `Window.divisors`): window-tokens, the large batch's mean, and micro-batch-mean,
the Hugging Face Trainer's arithmetic before transformers v4.46.0 (PR #34191): each micro-batch's mean over its own
tokens, divided by the accumulation steps. A tiny GPT on sequences of different lengths, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import SGD, assert_same_weights, lm_recipe, plain_optimizer, run_accumulated, run_plain, whole_batches
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe

MICRO, STEPS = 4, 3


def old_trainer_loop(recipe_data: dict, data: dict, micro: int, steps: int) -> dict:
    """transformers' Trainer before v4.46.0, one process: for each micro-batch the model's loss (the mean
    cross-entropy over its own target tokens) / gradient_accumulation_steps, backward; once per window clip and
    step (Trainer.training_step: `loss = loss / self.args.gradient_accumulation_steps`)."""
    recipe = parse_recipe(recipe_data)
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, data.info).to(torch.float64)
    optimizer = plain_optimizer(recipe, model)
    accumulation = recipe.batch.effective // micro
    batches = whole_batches(data.train, micro, steps * accumulation)
    for index, (inputs, target) in enumerate(batches, start=1):
        loss = F.cross_entropy(model(inputs).flatten(0, -2), target.flatten(), ignore_index=-100)
        (loss / accumulation).backward()
        if index % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def test_micro_batch_mean_is_the_old_trainers_formula_and_not_the_windows(tmp_path):
    old = {**lm_recipe(SGD, steps=STEPS), "loss": {"normalization": "micro-batch-mean"}}
    plan, _, ours, data = run_accumulated(old, micro_batch=MICRO, tmp_path=tmp_path / "old")
    assert plan.accumulation_steps == 4
    counts = [int((target != -100).sum()) for _, target in whole_batches(data.train, MICRO, 4)]
    assert len(set(counts)) > 1  # the micro-batches hold different token counts: the two normalisations differ
    assert_same_weights(ours, old_trainer_loop(old, data, MICRO, STEPS), rtol=1e-6, atol=1e-12)

    exact = lm_recipe(SGD, steps=STEPS)  # window-tokens, the default: the plain large-batch loop's weights
    _, _, window, _ = run_accumulated(exact, micro_batch=MICRO, tmp_path=tmp_path / "exact")
    assert_same_weights(window, run_plain(exact, data, steps=STEPS), rtol=1e-6, atol=1e-12)
    moved = [name for name in ours if not torch.allclose(ours[name], window[name], rtol=1e-6, atol=1e-9)]
    assert moved  # the paper's arithmetic is not the large batch's gradient


def test_normalization_is_the_only_loss_field_other_tasks_take():
    from reproduce.plan.planner import make_plan

    recipe = parse_recipe({**lm_recipe(SGD), "loss": {"normalization": "micro-batch-mean"}})
    assert recipe.loss.normalization == "micro-batch-mean"
    warnings = make_plan(recipe, micro_batch_max=4, dataset_size=64).warnings
    said = [line for line in warnings if "micro-batch-mean" in line]
    assert said == ["loss.normalization: micro-batch-mean: each micro-batch's mean over its own items, averaged over "
                    "the window's micro-batches and processes (the Hugging Face Trainer before transformers v4.46.0): "
                    "not the large batch's gradient where micro-batches hold different counts"]
    assert parse_recipe(lm_recipe(SGD)).loss is None  # the default: window-tokens
    with pytest.raises(UserError, match="loss.normalization: expected one of 'window-tokens' or 'micro-batch-mean'"):
        parse_recipe({**lm_recipe(SGD), "loss": {"normalization": "mean"}})
    with pytest.raises(UserError, match="loss: builtin and factory only with task custom"):
        parse_recipe({**lm_recipe(SGD), "loss": {"builtin": "mae-masked-pixel-mse"}})
