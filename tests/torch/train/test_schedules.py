"""LR schedules (docs/schedules.md): a batch phase's own schedule, `lr_points`, plateau decay with ReduceLROnPlateau's
semantics, a ramp that does not depend on the micro-batch, and plans that need the dataset size. Runs against a plain
PyTorch loop whose LRs are written out by hand here, in float64."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_same_model, assert_same_weights
from reproduce.cli import main
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.planfile import parse_plan, plan_to_yaml
from reproduce.plan.planner import lr_at, lr_points, make_plan
from reproduce.plan.recipe import load_recipe, parse_recipe
from reproduce.plan.schedules import Plateau
from reproduce.train.trainer import RunRequest, read_metrics, train

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code


def digits(batch: dict, steps: int, schedule: dict | None = None, evaluation: dict | None = None, shuffle=False,
           model=None) -> dict:
    return {"batch": batch, "task": "classification", "model": model or {"builtin": "mlp"},
            "data": {"builtin": "digits", "shuffle": shuffle}, "optimizer": SGD,
            "schedule": {"total": {"steps": steps}, **(schedule or {})},
            "evaluation": evaluation or {"at_end": False}}


# Two phases; the second restarts the LR: its own peak 0.1, a warm-up of 2 steps of its batch, then linear decay to
# 0.01 at the run's end. The first: warm-up over 2 steps to 0.05, cosine to 0 where the second begins (step 4).
PHASES = {"effective": 64, "phases": [
    {"steps": 4, "effective": 32},
    {"effective": 64, "lr": 0.1, "warmup": {"steps": 2}, "decay": {"kind": "linear", "min_lr": 0.01}},
]}
ALL_STEPS = 9


def by_hand(step: int) -> float:
    """The LR of 0-based step `step` of PHASES, written out from the recipe's words."""
    if step < 2:
        return 0.05 * step / 2
    if step < 4:
        return 0.5 * 0.05 * (1 + math.cos(math.pi * (step - 2) / (4 - 2)))
    if step < 6:
        return 0.1 * (step - 4) / 2
    return 0.1 + (0.01 - 0.1) * (step - 6) / (ALL_STEPS - 6)


def phases_recipe(**options) -> dict:
    return copy.deepcopy(digits(PHASES, ALL_STEPS, {"warmup": {"steps": 2}, "decay": {"kind": "cosine"}}, **options))


def run(recipe_data: dict, micro: int, out, **kwargs):
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    plan = make_plan(recipe, micro, dataset_size=len(data.train))
    train(plan, RunRequest(out, device="cpu", **kwargs), dtype=torch.float64, data=data)
    return plan, data, torch.load(out / "model.pt", weights_only=True), read_metrics(out / "metrics.jsonl")


def plain_loop(recipe_data: dict, data: dict, batches: list[int], lrs: list[float], plateau: dict | None = None,
               every: int | None = None) -> tuple[dict, list[float]]:
    """Momentum SGD over consecutive windows of `batches`, the LR of step s `lrs[s]` (times torch's own
    ReduceLROnPlateau's decisions on the mean eval loss every `every` steps, when `plateau` is given)."""
    recipe = parse_recipe(recipe_data)
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, {}).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    reduce = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **plateau) if plateau else None
    inputs, targets = data.train.tensors
    eval_inputs, eval_targets = data.eval.tensors
    scale, used, start = 1.0, [], 0
    for step, (size, lr) in enumerate(zip(batches, lrs, strict=True)):
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        used.append(lr * scale)
        loss = F.cross_entropy(model(inputs[start:start + size].double()), targets[start:start + size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        start += size
        if reduce is not None and (step + 1) % every == 0:
            with torch.no_grad():
                value = float(F.cross_entropy(model(eval_inputs.double()), eval_targets))
            for group in optimizer.param_groups:
                group["lr"] = lr * scale  # ReduceLROnPlateau multiplies the LR it finds
            reduce.step(value)
            scale = optimizer.param_groups[0]["lr"] / lr if lr else scale
    return model.state_dict(), used


# ---- per-phase schedules -----------------------------------------------------------------------------------------


def test_a_phase_with_its_own_schedule_restarts_the_lr():
    p = make_plan(parse_recipe(phases_recipe()), 16, dataset_size=1437)
    assert p.schedule.decay_end_step == 4  # the recipe's schedule ends where the second phase's begins
    own = p.segments[1].schedule
    assert (own.start_step, own.end_step, own.warmup_steps, own.lr, own.min_lr) == (4, 9, 2, 0.1, 0.01)
    assert [lr_at(p, s) for s in range(ALL_STEPS)] == pytest.approx([by_hand(s) for s in range(ALL_STEPS)],
                                                                     abs=1e-15)
    # the plan file keeps it, and a plan file written before phases had schedules still loads
    again = parse_plan(yaml.safe_load(plan_to_yaml(p)), "plan.yaml")
    assert again.segments[1].schedule == own
    edited = yaml.safe_load(plan_to_yaml(p))
    edited["segments"][1]["schedule"] = None
    with pytest.raises(UserError, match="segments\\[1\\].schedule: the recipe's phase has its own lr / warmup / decay"):
        parse_plan(edited, "plan.yaml")
    old = yaml.safe_load(plan_to_yaml(make_plan(parse_recipe(digits({"effective": 64, "phases": [
        {"steps": 4, "effective": 32}, {"effective": 64}]}, 9)), 16, dataset_size=1437)))
    for phase in old["segments"]:
        del phase["schedule"]
    assert parse_plan(old, "old.yaml").segments[1].schedule is None


def test_a_phases_lengths_count_in_its_own_units():
    # warm-up in samples at the second phase's batch of 64: 128 samples = 2 of its steps; decay until 2 epochs
    second = {"effective": 64, "warmup": {"samples": 128}, "decay": {"kind": "linear", "until": {"epochs": 0.1}}}
    recipe = parse_recipe(digits({"effective": 64, "phases": [{"steps": 4, "effective": 32}, second]}, 40))
    p = make_plan(recipe, 16, dataset_size=1437)
    own = p.segments[1].schedule
    assert own.warmup_steps == 2 and own.decay_end_step == 4 + round(0.1 * (1437 // 64))
    assert own.lr == SGD["lr"]  # no lr of its own: optimizer.lr
    early = parse_recipe(digits({"effective": 64, "phases": [{"steps": 4, "effective": 32}, second]}, 40,
                                {"warmup": {"steps": 6}}))
    assert ("schedule.warmup: 6 steps, but batch.phases[1] starts its own schedule at step 5: the recipe's warm-up "
            "never reaches its peak") in make_plan(early, 16, dataset_size=1437).warnings


def test_a_phase_schedule_run_equals_a_plain_loop_across_the_boundary_float64(tmp_path):
    recipe = phases_recipe()
    plan, data, ours, records = run(recipe, 16, tmp_path / "run")
    batches = [32] * 4 + [64] * 5
    assert [r["samples"] for r in records] == batches
    assert [r["lr"] for r in records] == pytest.approx([by_hand(s) for s in range(ALL_STEPS)], abs=1e-15)
    assert records[4]["lr"] == 0.0 and records[3]["lr"] > 0  # back to zero at the second phase's first step
    reference, _ = plain_loop(recipe, data, batches, [by_hand(s) for s in range(ALL_STEPS)])
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)


def test_resume_inside_the_second_warm_up_is_bitwise(tmp_path):
    recipe = phases_recipe(shuffle=True, model={"builtin": "mlp", "kwargs": {"dropout": 0.3}})
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, 16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    # one step into the second warm-up
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=5), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")
    assert [(r["loss"], r["lr"]) for r in read_metrics(tmp_path / "split" / "metrics.jsonl")] == [
        (r["loss"], r["lr"]) for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]


# ---- lr_points and the tables ---------------------------------------------------------------------------------


def test_lr_points_mark_every_change_of_shape():
    p = make_plan(parse_recipe(phases_recipe()), 16, dataset_size=1437)
    assert lr_points(p) == [[s + 1, pytest.approx(by_hand(s), abs=1e-15)] for s in (0, 2, 3, 4, 6, 8)]
    goyal = make_plan(load_recipe("papers/goyal2017-resnet50.yaml"), 32)
    points = dict((step, lr) for step, lr in lr_points(goyal))
    warm, (first, *_) = goyal.warmup_steps, goyal.schedule.decay_milestones
    assert points[1] == pytest.approx(0.1) and points[warm + 1] == pytest.approx(3.2)
    assert points[first] == pytest.approx(3.2) and points[first + 1] == pytest.approx(0.32)  # both sides of a drop
    assert max(points) == goyal.optimizer_steps


def test_lamb_plan_json_rewarms_at_the_second_phase_and_the_table_shows_the_same(capsys):
    assert cli(["plan", "papers/you2019-lamb-bert-large.yaml", "--micro-batch-max", "64", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    points = dict((step, lr) for step, lr in summary["lr_points"])
    assert points[1] == 0 and points[2001] == pytest.approx(6e-3)  # NVIDIA's phase-1 warm-up and LR
    assert points[7038] < 2e-6 and points[7039] == 0.0  # decayed to ~0, and back to zero at the second phase
    assert points[7239] == pytest.approx(4e-3) and max(points) == summary["optimizer_steps"] == 8599
    assert cli(["plan", "papers/you2019-lamb-bert-large.yaml", "--micro-batch-max", "64"]) == 0
    table = capsys.readouterr().out
    for start, end in ((1, 7038), (7039, 8599)):  # the phases table: each phase's first and last LR
        assert f"{points[start]:.4g} - {points[end]:.4g}" in table
    assert "own schedule: lr 0.004," in table


def test_gpt3_steps_do_not_depend_on_the_micro_batch():
    recipe = load_recipe("papers/brown2020-gpt3-small.yaml")
    plans = [make_plan(recipe, m) for m in (1, 16, 256)]
    assert len({p.optimizer_steps for p in plans}) == 1 and len({p.warmup_steps for p in plans}) == 1
    ramps = [[(ph.start_step, ph.effective_batch) for ph in p.segments] for p in plans]
    assert ramps[0] == ramps[1] == ramps[2] and len(ramps[0]) > 200  # the ramp is followed even at m = 256
    first = plans[2].segments[0]
    assert (first.micro_batch, first.accumulation_steps, first.effective_batch) == (16, 1, 16)  # one smaller one


def test_ramp_granularity_is_the_recipes():
    data = load_recipe("papers/brown2020-gpt3-small.yaml").model_dump(mode="json", exclude_none=True)
    data["batch"]["ramp"]["granularity"] = 8 * 2048  # 8 sequences
    p = make_plan(parse_recipe(data), 4, world_size=2)
    assert all(ph.effective_batch % 8 == 0 for ph in p.segments[:-1])
    with pytest.raises(UserError, match="`world_size`: 3 processes cannot share batch.ramp.granularity"):
        make_plan(parse_recipe(data), 4, world_size=3)


def test_vit_plans_to_whole_steps_and_a_missing_train_size_is_one_line(tmp_path, capsys):
    p = make_plan(load_recipe("papers/dosovitskiy2021-vit-b16.yaml"), 64)
    assert p.optimizer_steps == 90 * (14_000_000 // 4096) and p.schedule.decay_end_step == p.optimizer_steps
    data = yaml.safe_load(open("papers/dosovitskiy2021-vit-b16.yaml"))
    del data["data"]["train_size"]
    path = tmp_path / "vit.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli(["plan", str(path), "--micro-batch-max", "64", "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}: data.train_size: required: schedule.total is counted in epochs, and the plan needs "
                   "the training samples per epoch to count its optimizer steps (or plan the run with its data)"]
    assert not (tmp_path / "p.yaml").exists()


# ---- plateau decay ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"mode": "min", "patience": 2}, {"mode": "max", "patience": 1, "cooldown": 2},
    {"mode": "min", "patience": 3, "threshold": 0.05, "threshold_mode": "abs", "min_lr": 0.004},
    {"mode": "max", "patience": 1, "threshold": 0.1, "threshold_mode": "rel", "factor": 0.5},
])
def test_plateau_decides_as_torchs_reduce_lr_on_plateau(options):
    decay = {"kind": "plateau", "metric": "eval_loss", "factor": 0.1, **options}
    recipe = parse_recipe(digits({"effective": 64}, 100, {"decay": decay}, {"every_steps": 1}))
    planned = make_plan(recipe, 16, dataset_size=1437)
    ours = Plateau(planned.recipe.schedule.decay, planned.lr, planned.schedule.min_lr)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=SGD["lr"])
    theirs = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **{"factor": 0.1, **options})
    rng = random.Random(0)
    value = 1.0
    for step in range(300):
        value += rng.choice([-0.2, -0.01, 0.0, 0.0, 0.01, 0.1])
        ours.step(value, step + 1)
        theirs.step(value)
        assert SGD["lr"] * ours.state["scale"] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), step


PLATEAU = {"kind": "plateau", "metric": "eval_loss", "patience": 1, "factor": 0.5, "threshold": 0.02}


def test_plateau_run_equals_a_plain_loop_with_reduce_lr_on_plateau_float64(tmp_path):
    recipe = digits({"effective": 64}, 14, {"warmup": {"steps": 2}, "decay": PLATEAU}, {"every_steps": 2,
                                                                                       "at_end": False})
    plan, data, ours, records = run(recipe, 16, tmp_path / "run")
    planned = [lr_at(plan, s) for s in range(14)]
    reference, used = plain_loop(recipe, data, [64] * 14, planned, plateau={
        "factor": 0.5, "patience": 1, "threshold": 0.02}, every=2)
    assert [r["lr"] for r in records] == pytest.approx(used, rel=1e-12)
    assert min(used) < SGD["lr"] / 2  # it did decrease, more than once
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    decreased = [r["step"] for r in records if "plateau_lr" in r]
    assert decreased and all(records[s]["lr"] < records[s - 1]["lr"] for s in decreased if s < 14)


def test_plateau_state_is_checkpointed_and_resume_is_bitwise(tmp_path):
    recipe = digits({"effective": 64}, 14, {"decay": PLATEAU}, {"every_steps": 2, "at_end": False}, shuffle=True)
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, 16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=9), data=data)
    saved = torch.load(tmp_path / "split" / "checkpoints" / "last.pt", weights_only=True)["scheduler"]["plateau"]
    assert saved["evaluations"] == 4 and saved["decreases"]  # 2, 4, 6, 8
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")
    assert [(r["loss"], r["lr"]) for r in read_metrics(tmp_path / "split" / "metrics.jsonl")] == [
        (r["loss"], r["lr"]) for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]


def test_he2016_plans_with_plateau_decay(capsys):
    assert cli(["plan", "papers/he2016-resnet50.yaml", "--micro-batch-max", "32", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["decay_kind"] == "plateau"
    # evaluations every 5004 steps; the first sets the best, 10 + 1 more without improvement: step 12 x 5004 + 1
    assert summary["lr_points"] == [[1, 0.1], [12 * 5004 + 1, 0.1]] and "depend on the run" in summary["lr_points_note"]


def test_a_scheduler_state_from_before_plateau_decay_loads():
    p = make_plan(parse_recipe(digits({"effective": 64}, 10, {"warmup": {"steps": 4}})), 16, dataset_size=1437)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=p.lr)
    old = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    optimizer.step()
    old.step()
    from reproduce.train.optim.optimizers import PlanScheduler

    scheduler = PlanScheduler(p, torch.optim.SGD(model.parameters(), lr=p.lr))
    scheduler.load_state_dict(old.state_dict())
    assert scheduler.last_epoch == 1 and "plateau" not in scheduler.state_dict()


# ---- bad input ------------------------------------------------------------------------------------------------


def plateau_decay(d: dict, **fields) -> None:
    """The recipe's decay a plateau's (with `fields`), its second phase without a schedule of its own."""
    d["batch"]["phases"][1] = {"effective": 64}
    d["schedule"]["decay"] = {**PLATEAU, **fields}


BAD = [
    ("a phase schedule with no steps to run",
     lambda d: d["batch"].update(phases=[{"steps": 20, "effective": 32}, {"effective": 64, "lr": 0.1}]),
     "batch.phases[1]: its own schedule has no length to run over: the phase starts at step 21, but the run ends "
     "after 9 optimizer steps"),
    ("plateau without evaluation", lambda d: (plateau_decay(d), d.pop("evaluation")),
     "evaluation.every_steps: required by schedule.decay kind plateau (the LR can only drop at an evaluation)"),
    ("unknown metric", lambda d: plateau_decay(d, metric="top1"),
     "schedule.decay.metric: unknown metric 'top1' for task classification; expected one of eval_loss, "
     "eval_accuracy, eval_error"),
    ("patience 0", lambda d: plateau_decay(d, patience=0),
     "schedule.decay.patience: must be > 0 (got 0)"),
    ("patience -1", lambda d: plateau_decay(d, patience=-1),
     "schedule.decay.patience: must be > 0 (got -1)"),
    ("a phase schedule after plateau decay", lambda d: d["schedule"].update(decay={**PLATEAU}),
     "batch.phases.1: a phase's own schedule cannot follow schedule.decay kind plateau (whose decreases apply to the "
     "whole run)"),
    ("a schedule on the first phase", lambda d: d["batch"]["phases"][0].update(lr=0.1),
     "batch.phases.0.lr: the first phase's schedule is optimizer.lr and schedule.warmup / decay; give a phase its "
     "own from the second phase on"),
]


@pytest.mark.parametrize("name,edit,message", BAD, ids=[case[0] for case in BAD])
def test_bad_schedules_are_one_line_exit_2_and_nothing_written(name, edit, message, tmp_path, capsys):
    data = phases_recipe(evaluation={"every_steps": 2})
    edit(data)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "plan.yaml"
    assert cli(["plan", str(path), "--micro-batch-max", "16", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(message), err
    assert str(path) in err[0] and not out.exists()


def test_exports_say_where_a_phase_restarts_and_never_invent_a_plateau_shape(capsys):
    assert cli(["plan", "papers/you2019-lamb-bert-large.yaml", "--micro-batch-max", "64", "--emit", "torchrun"]) == 0
    assert "batch.phases[1] restarts the LR schedule at step 7039" in capsys.readouterr().out
    assert cli(["plan", "papers/he2016-resnet50.yaml", "--micro-batch-max", "32", "--emit", "lightning"]) == 0
    emitted = capsys.readouterr().out
    assert "return 1.0  # then x factor where ReduceLROnPlateau decides" in emitted and "progress" not in emitted


def test_plateau_decides_alike_on_every_rank(tmp_path):
    """Under DDP only rank 0 evaluates: its metric is broadcast, so every rank lowers its LR after the same step
    (a rank that did not would train with another LR, and the two processes would not equal one)."""
    from helpers import assert_close_weights, reproduce_run, reproduce_run_here, weights

    recipe = digits({"effective": 128}, 10, {"decay": PLATEAU}, {"every_steps": 2, "at_end": False})
    reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "16", "--nproc-per-node", "2")
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "16")
    two, one = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("two", "one"))
    assert [r["lr"] for r in two] == pytest.approx([r["lr"] for r in one], rel=1e-12)
    assert any("plateau_lr" in r for r in two) and two[-1]["lr"] < SGD["lr"]
    assert_close_weights(weights(tmp_path, "two"), weights(tmp_path, "one"))


def test_a_plateau_run_without_evaluation_data_stops_before_writing(tmp_path):
    parsed = parse_recipe(digits({"effective": 64}, 4, {"decay": PLATEAU}, {"every_steps": 2}))
    data = build_data(parsed)
    data = dataclasses.replace(data, eval=None)
    with pytest.raises(UserError, match="kind plateau watches eval_loss, but this run has no evaluation data"):
        planned = make_plan(parsed, 16, dataset_size=len(data.train))
        train(planned, RunRequest(tmp_path / "run", device="cpu"), data=data)
    assert not (tmp_path / "run").exists()


@settings(max_examples=40, deadline=None)
@given(start=st.integers(1, 63), micro=st.integers(2, 64), world=st.sampled_from([1, 2, 4, 8]),
       length=st.integers(500, 50000), tokens=st.booleans())
def test_a_ramp_is_the_same_whatever_the_micro_batch(start, micro, world, length, tokens):
    """(For a batch the processes can match exactly: otherwise the batch the ramp ends at depends on the split.)"""
    batch = {"effective": 512, "sequence_length": 8, "unit": "tokens",
             "ramp": {"start": start * 8, "length": {"tokens": length * 8} if tokens else {"samples": length}}}
    recipe = parse_recipe({"batch": batch, "task": "language-modeling", "model": {"builtin": "gpt"},
                           "data": {"name": "text", "available": False}, "optimizer": {"name": "adamw", "lr": 1e-4},
                           "schedule": {"total": {"samples": 100000}, "warmup": {"samples": 3000}}})
    small, large = make_plan(recipe, 1, world_size=world), make_plan(recipe, micro, world_size=world)
    assert [(p.start_step, p.steps, p.effective_batch) for p in small.segments] == [
        (p.start_step, p.steps, p.effective_batch) for p in large.segments]
    assert (small.optimizer_steps, small.warmup_steps) == (large.optimizer_steps, large.warmup_steps)
    for phase in large.segments[:-1]:  # whole windows: micro-batches of the main one, the last one smaller
        share = phase.effective_batch // world
        assert phase.micro_batch == min(large.micro_batch, share)
        count = phase.accumulation_steps
        assert (count - 1) * phase.micro_batch < share <= count * phase.micro_batch
