"""`planner.plan` read as its named steps: each step on its own, and the plan's warnings in the steps' order."""

from __future__ import annotations

import pytest

from core_helpers import make_recipe
from reproduce.errors import UserError
from reproduce.plan.phases import schedule_in_steps
from reproduce.plan.planner import (
    check_arguments,
    choose_split,
    make_plan,
    scale_lr,
    warn_last,
    warn_partial_epoch,
)
from reproduce.plan.segments import micro_batch_cap


@pytest.mark.parametrize(("micro", "world", "policy", "message"), [
    (0, 1, "exact", "`micro_batch_max`: must be >= 1 (got 0)"),
    (8, 0, "exact", "`world_size`: must be >= 1 (got 0)"),
    (8, 1, "fastest", "`policy`: expected exact, fast or throughput (got 'fastest')"),
    (8, 129, "exact", "`world_size`: 129 processes exceed the paper's effective batch of 128 samples"),
])
def test_check_arguments_names_the_field(micro, world, policy, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_arguments(make_recipe(), micro, world, policy)
    with pytest.raises(UserError, match=message.split(":")[0]):  # plan refuses the same, before anything else
        make_plan(make_recipe(), micro, world, policy)


def test_choose_split_exact_fast_and_the_alternative():
    r = make_recipe(batch={"effective": 96, "devices": None, "per_device": None})
    warnings: list[str] = []
    chosen, alternative = choose_split(r, 40, 1, "exact", None, warnings)
    assert (chosen.micro_batch, chosen.accumulation_steps, chosen.exact) == (32, 3, True)
    assert alternative is None and warnings == []
    chosen, alternative = choose_split(r, 96, 1, "fast", None, warnings)  # (the cap: micro_batch_cap)
    assert (chosen.micro_batch, chosen.accumulation_steps) == (96, 1) and warnings == []
    capped = "micro-batch capped at 96: the paper's batch of 96 over 1 process(es) needs no more per step"
    assert make_plan(r, 1000, 1, "fast").warnings[0] == capped and micro_batch_cap(1000, 96, 1) == 96


def test_choose_split_takes_a_given_exact_micro_batch_or_refuses_it():
    warnings: list[str] = []
    chosen, _ = choose_split(make_recipe(), 64, 1, "exact", 16, warnings)
    assert (chosen.micro_batch, chosen.accumulation_steps) == (16, 8)
    with pytest.raises(UserError, match="micro_batch: 48 is not an exact split of 128 per process at most 64"):
        choose_split(make_recipe(), 64, 1, "exact", 48, warnings)


def test_choose_split_without_an_exact_split_takes_the_nearest_batch():
    r = make_recipe(batch={"effective": 100, "devices": None, "per_device": None})
    warnings: list[str] = []
    chosen, alternative = choose_split(r, micro_batch_cap(1000, 100, 3), 3, "exact", None, warnings)
    assert (chosen.micro_batch, chosen.accumulation_steps, chosen.effective_batch, chosen.exact) == (33, 1, 99, False)
    assert warnings[0] == "no exact split: 100 samples is not divisible by world size 3; using the nearest batch 99"


def test_scale_lr_sqrt_rule_and_adam_option():
    r = make_recipe(batch={"effective": 100, "devices": None, "per_device": None},
                    optimizer={"name": "adam", "lr": 1e-3})
    chosen, _ = choose_split(r, micro_batch_cap(1000, 100, 3), 3, "exact", None, [])
    warnings: list[str] = []
    rule, source, adam = scale_lr(r, chosen, warnings)
    assert rule == "sqrt" and adam is not None and adam.eps == pytest.approx(1e-8 / 0.99 ** 0.5)
    assert warnings == ["effective batch 99 is not the paper's 100 (x0.99): LR 0.001 -> 0.000994987 by the sqrt rule"]
    exact, _ = choose_split(make_recipe(), 48, 1, "exact", None, [])
    assert scale_lr(make_recipe(), exact, warnings)[0] == "exact" and scale_lr(make_recipe(), exact, [])[2] is None


def test_warn_partial_epoch():
    warnings: list[str] = []
    warn_partial_epoch(make_recipe(), None, 128, 1, 0, warnings)  # no data size: nothing to say
    warn_partial_epoch(make_recipe(), 1024, 128, 1, 0, warnings)  # whole windows
    assert warnings == []
    keep = make_recipe(data={"drop_last": False})
    warn_partial_epoch(keep, 1000, 128, 1, 104, warnings)
    warn_partial_epoch(keep, 1000, 128, 200, 104, warnings)
    warn_partial_epoch(keep, 100, 128, 1, 100, warnings)
    assert warnings == [
        "the last window of each epoch holds 104 of 128 samples: normalised by the 104 it holds",
        "the last window of each epoch holds 104 of 128 samples: dropped: fewer than the 200 processes",
        "an epoch (100 samples) is shorter than one optimizer step (128): every step is partial",
    ]


@pytest.mark.parametrize(("total", "said"), [(7, False), (8, True), (20, True)])
def test_the_partial_last_window_is_said_only_of_a_run_that_reaches_it(total, said):
    """1,000 samples at 128 a step without drop_last: 7 whole windows, then one of 104. A run of 7 steps or fewer
    never meets it."""
    recipe = make_recipe(data={"drop_last": False}, schedule={"warmup": {"steps": 0}, "decay": {"kind": "constant"},
                                                              "total": {"steps": total}})
    plan = make_plan(recipe, 32)
    epoch_end = "the last window of each epoch holds 104 of 128 samples: normalised by the 104 it holds"
    assert (epoch_end in plan.warnings) is said and plan.partial_window == 104


def test_schedule_in_steps_converts_every_length():
    r = make_recipe()  # 1000 samples, drop_last: 7 steps an epoch; 1 warm-up epoch, milestones at 5 and 8, 10 epochs
    chosen, _ = choose_split(r, 48, 1, "exact", None, [])
    p = make_plan(r, 48)
    assert p.segments[0].model_dump(include={"kind", "micro_batch", "effective_batch", "steps_per_epoch"}) == {
        "kind": "whole", "micro_batch": 32, "effective_batch": 128, "steps_per_epoch": 7}
    warnings: list[str] = []
    s, phases = schedule_in_steps(r, None, chosen, p.segments, [], 7, warnings)
    assert (s.start_step, s.end_step, s.warmup_steps, s.decay_milestones, s.decay_end_step, s.min_lr,
            s.warmup_start_lr, s.lr) == (0, 70, 7, [35, 56], 70, 0, 0, chosen.lr)
    assert phases == [] and warnings == [] and s == p.schedule
    steps = (p.optimizer_steps, p.warmup_steps, p.schedule.decay_milestones, p.schedule.decay_end_step)
    assert steps == (70, 7, [35, 56], 70)


def test_schedule_in_steps_needs_the_data_size_for_epochs():
    r = make_recipe(data={"train_size": None})
    with pytest.raises(UserError, match="r.yaml: data.train_size: required: schedule.total is counted in epochs"):
        make_plan(r, 48, recipe_path="r.yaml")


def test_warn_last_batchnorm_then_deviations():
    r = make_recipe(deviations=["fewer epochs"])
    chosen, _ = choose_split(r, 48, 1, "exact", None, [])
    s, phases = schedule_in_steps(r, None, chosen, make_plan(r, 48).segments, [], 7, [])
    warnings = ["earlier"]
    warn_last(r, "BatchNorm note", s.end_step, phases, warnings)
    assert warnings == ["earlier", "BatchNorm note", "deviation from the paper: fewer epochs"]


def test_plan_warnings_come_in_the_steps_order():
    r = make_recipe(batch={"effective": 100, "devices": None, "per_device": None},
                    model={"builtin": "cnn", "norm_layers": ["batchnorm"]}, data={"drop_last": False},
                    deviations=["fewer epochs"])
    p = make_plan(r, 1000, world_size=3)
    assert [w.split(" ")[0] for w in p.warnings] == ["micro-batch", "no", "effective", "the", "BatchNorm", "deviation"]
    assert p.policy == "exact" and p.effective_tokens is None and p.paper_effective_batch == 100


def test_throughput_policy_is_exact_with_its_name():
    p = make_plan(make_recipe(), 64, policy="throughput", micro_batch=16)
    assert (p.policy, p.micro_batch, p.accumulation_steps, p.exact) == ("throughput", 16, 8, True)
