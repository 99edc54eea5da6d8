"""Every recipe in papers/ loads, validates and plans; the plan keeps the batch arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe

PAPERS = Path(__file__).resolve().parents[2] / "papers"
RECIPES = sorted(PAPERS.glob("*.yaml"))
MICRO_BATCH_MAX = 16


def test_there_are_at_least_ten_recipes():
    assert len(RECIPES) >= 10, [path.name for path in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=[path.stem for path in RECIPES])
def test_recipe_plans_with_the_batch_arithmetic(path: Path):
    recipe = load_recipe(path)
    result = make_plan(recipe, micro_batch_max=MICRO_BATCH_MAX)
    assert result.micro_batch * result.accumulation_steps * result.world_size == result.effective_batch
    assert result.exact == (result.effective_batch == recipe.batch.sequences)
    assert 1 <= result.micro_batch <= MICRO_BATCH_MAX
    if result.exact:
        assert result.lr == recipe.optimizer.lr
    if recipe.batch.unit == "tokens":
        assert result.effective_tokens == result.effective_batch * recipe.batch.sequence_length


@pytest.mark.parametrize("path", RECIPES, ids=[path.stem for path in RECIPES])
def test_recipe_opens_with_its_plan_command(path: Path):
    lines = path.read_text(encoding="utf-8").splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    assert header, f"{path.name}: should open with a comment naming the paper and its plan command"
    assert any(f"reproduce plan papers/{path.name} --micro-batch-max " in line for line in header), header


def test_goyal_plans_the_papers_per_worker_batch():
    recipe = load_recipe(PAPERS / "goyal2017-resnet50.yaml")
    result = make_plan(recipe, micro_batch_max=32)
    assert (result.micro_batch, result.accumulation_steps, result.world_size) == (32, 256, 1)
    assert result.effective_batch == 8192 and result.exact
    assert result.lr == 3.2
    assert result.steps_per_epoch == 156  # 1281167 // 8192, drop_last
    assert result.optimizer_steps == 14040  # 90 epochs x 156
    assert result.warmup_steps == 780  # 5 epochs x 156
    assert result.schedule.warmup_start_lr == 0.1
    assert result.schedule.decay_milestones == [4680, 9360, 12480]  # epochs 30, 60, 80
    assert result.batchnorm_warning is None


def test_nanogpt_token_batch_is_480_sequences():
    recipe = load_recipe(PAPERS / "nanogpt-gpt2-124m.yaml")
    assert recipe.batch.unit == "tokens"
    assert recipe.batch.effective == 491520
    assert recipe.batch.sequence_length == 1024
    assert recipe.batch.sequences == 480  # 12 x 5 accumulation x 8 GPUs
    result = make_plan(recipe, micro_batch_max=MICRO_BATCH_MAX)
    assert result.effective_batch == 480 and result.exact
    assert result.effective_tokens == 491520
    assert result.optimizer_steps == 600000 and result.warmup_steps == 2000
