"""The planner: exact splits, LR rules, schedule conversion, BatchNorm, warnings; plus property tests."""

from __future__ import annotations

import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_helpers import make_recipe
from reproduce.errors import UserError
from reproduce.plan.planner import lr_at, make_plan


@pytest.mark.subprocess
def test_planner_imports_no_torch():
    import subprocess

    code = ("import sys, reproduce.plan.planner, reproduce.plan.planfile, reproduce.plan.recipe\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_exact_split_uses_largest_divisor(recipe):
    p = make_plan(recipe, micro_batch_max=48)
    assert (p.micro_batch, p.accumulation_steps, p.world_size) == (32, 4, 1)
    assert p.exact and p.effective_batch == 128 and p.lr == 0.1 and p.lr_scaling.rule == "exact"


def test_world_size_splits_across_processes(recipe):
    p = make_plan(recipe, micro_batch_max=16, world_size=4)
    assert p.micro_batch * p.accumulation_steps * p.world_size == 128
    assert (p.micro_batch, p.accumulation_steps) == (16, 2)


def test_micro_batch_capped_at_per_rank_batch(recipe):
    p = make_plan(recipe, micro_batch_max=1000)
    assert (p.micro_batch, p.accumulation_steps) == (128, 1)
    assert any("capped" in w for w in p.warnings)


def test_fast_alternative_offered_when_exact_micro_batch_is_small():
    r = make_recipe(batch={"effective": 127, "devices": None, "per_device": None})  # 127 is prime
    p = make_plan(r, micro_batch_max=32)
    assert p.exact and p.micro_batch == 1 and p.accumulation_steps == 127
    alt = p.alternative
    assert alt is not None and alt.policy == "fast" and alt.micro_batch >= 16
    assert not alt.exact and alt.effective_batch == alt.micro_batch * alt.accumulation_steps
    assert alt.lr == pytest.approx(0.1 * alt.effective_batch / 127)  # SGD: linear rule


def test_fast_policy_scales_lr_linearly_for_sgd():
    r = make_recipe(batch={"effective": 127, "devices": None, "per_device": None})
    p = make_plan(r, micro_batch_max=32, policy="fast")
    assert not p.exact and p.lr_scaling.rule == "linear"
    assert p.lr == pytest.approx(0.1 * p.effective_batch / 127)
    assert any("not the paper's" in w for w in p.warnings)


def test_fast_policy_scales_lr_by_sqrt_for_adam_and_offers_malladi_option():
    r = make_recipe(
        batch={"effective": 127, "devices": None, "per_device": None},
        optimizer={"name": "adamw", "lr": 1e-3, "momentum": 0.0, "betas": [0.9, 0.95], "eps": 1e-8},
    )
    p = make_plan(r, micro_batch_max=32, policy="fast")
    k = p.effective_batch / 127
    assert p.lr_scaling.rule == "sqrt" and p.lr == pytest.approx(1e-3 * math.sqrt(k))
    assert p.lr_scaling.adam_option is not None
    assert p.lr_scaling.adam_option.betas[1] == pytest.approx(1 - k * 0.05)
    assert p.lr_scaling.adam_option.eps == pytest.approx(1e-8 / math.sqrt(k))


def test_scaling_rule_override():
    r = make_recipe(batch={"effective": 127, "devices": None, "per_device": None}, scaling_rule="none")
    p = make_plan(r, micro_batch_max=32, policy="fast")
    assert p.lr_scaling.rule == "none" and p.lr == 0.1


def test_no_exact_split_when_world_size_does_not_divide():
    r = make_recipe(batch={"effective": 129, "devices": None, "per_device": None})
    p = make_plan(r, micro_batch_max=8, world_size=2)
    assert not p.exact
    assert any("no exact split" in w for w in p.warnings)


def test_epochs_converted_to_optimizer_steps(recipe):
    p = make_plan(recipe, micro_batch_max=32)
    # 1000 samples / 128 per step = 7 full steps (drop_last), 104 left over
    assert p.steps_per_epoch == 7 and p.partial_window == 104
    assert p.optimizer_steps == 70 and p.warmup_steps == 7 and p.schedule.decay_milestones == [35, 56]
    assert any("104 of 128" in w and "dropped" in w for w in p.warnings)


def test_partial_window_kept_without_drop_last():
    r = make_recipe(data={"drop_last": False})
    p = make_plan(r, micro_batch_max=32)
    assert p.steps_per_epoch == 8
    assert any("normalised by the 104" in w for w in p.warnings)


def test_epoch_shorter_than_one_step_warns():
    r = make_recipe(data={"train_size": 100})
    p = make_plan(r, micro_batch_max=32)
    assert p.steps_per_epoch == 0
    assert any("shorter than one optimizer step" in w for w in p.warnings)


def test_token_batches_count_sequences():
    r = make_recipe(
        batch={"effective": 491520, "unit": "tokens", "sequence_length": 1024, "devices": 8, "per_device": 12,
               "accumulation": 5},
        task="language-modeling",
        schedule={"warmup": {"tokens": 2000 * 491520}, "decay": {"kind": "cosine", "min_lr": 6e-5},
                  "total": {"steps": 600000}},
        optimizer={"name": "adamw", "lr": 6e-4},
    )
    p = make_plan(r, micro_batch_max=12, world_size=8)
    assert p.effective_batch == 480 and p.effective_tokens == 491520 and p.unit == "sequences"
    assert (p.micro_batch, p.accumulation_steps) == (12, 5)
    assert p.optimizer_steps == 600000 and p.warmup_steps == 2000


def test_steps_keep_the_data_they_cover_when_batch_changes():
    r = make_recipe(batch={"effective": 127, "devices": None, "per_device": None},
                    schedule={"warmup": None, "decay": {"kind": "constant"}, "total": {"steps": 1000}})
    p = make_plan(r, micro_batch_max=32, policy="fast")
    assert p.optimizer_steps == round(1000 * 127 / p.effective_batch)


def test_batchnorm_prefers_papers_per_device_batch():
    r = make_recipe(model={"builtin": "cnn", "norm_layers": ["batchnorm"]})
    p = make_plan(r, micro_batch_max=64)  # 64 would divide 128 too, but the paper's BN batch is 32
    assert p.micro_batch == 32 and p.batchnorm_warning is None


def test_batchnorm_warns_when_per_device_does_not_fit():
    r = make_recipe(model={"builtin": "cnn", "norm_layers": ["batchnorm"]})
    p = make_plan(r, micro_batch_max=16)
    assert p.micro_batch == 16
    assert "BatchNorm statistics will be computed over micro-batches of 16" in p.batchnorm_warning
    assert p.batchnorm_warning in p.warnings


def test_lr_schedule_warmup_then_step_decay(recipe):
    r = make_recipe(schedule={"warmup": {"epochs": 1, "start_lr": 0.01},
                              "decay": {"kind": "step", "milestones": {"epochs": [5, 8]}, "factor": 0.1},
                              "total": {"epochs": 10}})
    p = make_plan(r, micro_batch_max=32)
    assert lr_at(p, 0) == pytest.approx(0.01)
    assert lr_at(p, 7) == pytest.approx(0.1)
    assert lr_at(p, 34) == pytest.approx(0.1) and lr_at(p, 35) == pytest.approx(0.01)
    assert lr_at(p, 56) == pytest.approx(0.001)


def test_lr_schedule_cosine_ends_at_min_lr():
    r = make_recipe(schedule={"warmup": {"steps": 0}, "decay": {"kind": "cosine", "min_ratio": 0.1},
                              "total": {"epochs": 10}})
    p = make_plan(r, micro_batch_max=32)
    assert lr_at(p, 0) == pytest.approx(0.1)
    assert lr_at(p, p.optimizer_steps) == pytest.approx(0.01)
    assert lr_at(p, p.optimizer_steps // 2) == pytest.approx(0.055, rel=0.05)


def test_bad_arguments_are_user_errors(recipe):
    """A library caller is told about the argument it passed, not a command-line flag."""
    with pytest.raises(UserError) as caught:
        make_plan(recipe, micro_batch_max=0)
    assert caught.value.field == "micro_batch_max"
    assert str(caught.value) == "`micro_batch_max`: must be >= 1 (got 0)"
    with pytest.raises(UserError, match="^`world_size`: must be >= 1"):
        make_plan(recipe, micro_batch_max=4, world_size=0)
    with pytest.raises(UserError, match="^`world_size`: 129 processes exceed the paper's effective batch"):
        make_plan(recipe, micro_batch_max=4, world_size=129)


@settings(max_examples=300, deadline=None)
@given(
    effective=st.integers(1, 5000),
    micro_batch_max=st.integers(1, 600),
    world_size=st.integers(1, 16),
    policy=st.sampled_from(["exact", "fast"]),
    optimizer=st.sampled_from(["sgd", "adamw"]),
)
def test_plan_invariants(effective, micro_batch_max, world_size, policy, optimizer):
    if world_size > effective:
        return
    r = make_recipe(batch={"effective": effective, "devices": None, "per_device": None},
                    optimizer={"name": optimizer, "lr": 0.5, "momentum": 0.0})
    p = make_plan(r, micro_batch_max=micro_batch_max, world_size=world_size, policy=policy)
    assert p.micro_batch * p.accumulation_steps * p.world_size == p.effective_batch
    assert p.exact == (p.effective_batch == effective)
    assert 1 <= p.micro_batch <= micro_batch_max
    assert p.accumulation_steps >= 1
    if p.exact:
        assert p.lr == 0.5 and p.split.lr_factor == 1.0
    if policy == "exact" and effective % world_size == 0:
        assert p.exact


def test_a_copied_plan_derives_its_numbers_from_its_own_parts(recipe):
    """The split's numbers are attributes set by the validator; pydantic's copy runs none, so Plan's copy derives
    them again: a plan copied with another split reads that split's micro-batch, N and arithmetic."""
    small, large = make_plan(recipe, 4), make_plan(recipe, 64)
    copied = small.model_copy(update={"split": large.split})
    assert (copied.micro_batch, copied.accumulation_steps, copied.arithmetic) == (
        large.micro_batch, large.accumulation_steps, large.arithmetic)
    assert copied.micro_batch != small.micro_batch
