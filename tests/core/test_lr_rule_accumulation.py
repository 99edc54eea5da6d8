"""The LR rule reads the effective batch, accumulation included: MMEngine's `auto_scale_lr` scales the LR by
world size x per-GPU batch and ignores `accumulative_counts` (open-mmlab/mmdetection#10728), so a "4xb2" config
run on one GPU with 4 accumulation steps would get a quarter of its LR. A pitfall this planner must not share
(/work/shared/reference/peers-pitfalls.md). No torch."""

from __future__ import annotations

import pytest

from core_helpers import make_recipe
from reproduce.plan.planner import make_plan


def mmengine_auto_scale_lr(lr: float, base_batch_size: int, world_size: int, batch_size: int) -> float:
    """mmengine.runner.Runner.scale_lr: lr x (world_size x train_dataloader.batch_size) / base_batch_size, the
    optimizer wrapper's accumulative_counts left out."""
    return lr * world_size * batch_size / base_batch_size


@pytest.fixture
def four_by_two():
    """MMSegmentation's naming: 4 GPUs x 2 images = 8, SGD lr 0.01 (deeplabv3_r50-d8_4xb2-40k_cityscapes)."""
    return make_recipe(batch={"effective": 8, "devices": 4, "per_device": 2},
                       optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_papers_batch_by_accumulation_keeps_the_papers_lr(four_by_two, world_size):
    p = make_plan(four_by_two, micro_batch_max=2, world_size=world_size)
    assert (p.micro_batch, p.accumulation_steps, p.world_size) == (2, 4 // world_size, world_size)
    assert p.exact and p.effective_batch == 8 and p.lr_scaling.rule == "exact" and p.lr == 0.01
    wrong = mmengine_auto_scale_lr(0.01, base_batch_size=8, world_size=world_size, batch_size=2)
    if world_size < 4:  # accumulation in use: MMEngine's rule would have shrunk the LR
        assert wrong < p.lr and wrong == pytest.approx(0.01 * world_size / 4)


def test_a_batch_that_differs_scales_by_the_effective_batch_not_the_per_step_one():
    """Not matched exactly (a batch of 127, policy fast, micro-batches of up to 8 on one process): the linear rule's
    factor is (micro x accumulation x world) / the paper's 127, never micro x world / 127."""
    recipe = make_recipe(batch={"effective": 127, "devices": None, "per_device": None},
                         optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9})
    p = make_plan(recipe, micro_batch_max=8, policy="fast")
    assert not p.exact and p.accumulation_steps > 1 and p.lr_scaling.rule == "linear"
    assert p.effective_batch == p.micro_batch * p.accumulation_steps * p.world_size
    assert p.lr == pytest.approx(0.01 * p.effective_batch / 127)
    assert p.lr > 2 * mmengine_auto_scale_lr(0.01, 127, p.world_size, p.micro_batch)
