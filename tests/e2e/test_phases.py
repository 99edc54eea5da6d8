"""Batch phases and ramps: the plan (each phase its own m x N x W, ramp batches, schedules across phases), the
plan file, and `reproduce run` against a plain PyTorch loop over the same per-step batches, in float64."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import assert_same_model, assert_same_weights, plain_loop
from reproduce.cli import main
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.plan.flatview import flat_fields
from reproduce.plan.planfile import parse_plan, plan_to_yaml
from reproduce.plan.planner import lr_at, make_plan
from reproduce.plan.recipe import Length, parse_recipe
from reproduce.plan.segments import Segment, epoch_steps, lengths_to_steps, stream_window
from reproduce.train.trainer import RunRequest, read_metrics, train

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def lm(phases=None, ramp=None, effective=256, length=512, total=None, unit="samples", **schedule) -> dict:
    batch = {"effective": effective, "sequence_length": length, "unit": unit}
    batch.update({"phases": phases} if phases else {})
    batch.update({"ramp": ramp} if ramp else {})
    return {
        "batch": batch, "task": "language-modeling", "model": {"builtin": "gpt"},
        "data": {"name": "text", "available": False}, "optimizer": {"name": "adamw", "lr": 1e-4},
        "schedule": {"total": total or {"steps": 1000}, **schedule},
    }


BERT = [{"steps": 900, "effective": 256, "sequence_length": 128}, {"effective": 256}]


# ---- the plan ----------------------------------------------------------------------------------------------


def test_each_phase_gets_the_micro_batch_that_fits_at_its_length():
    recipe = parse_recipe(lm(BERT, warmup={"steps": 100}, decay={"kind": "linear"}))
    p = make_plan(recipe, {128: 64, 512: 16})
    first, second = p.segments
    assert (first.micro_batch, first.accumulation_steps, first.sequence_length) == (64, 4, 128)
    assert (second.micro_batch, second.accumulation_steps, second.sequence_length) == (16, 16, 512)
    assert (first.start_step, first.steps, second.start_step, second.steps) == (0, 900, 900, None)
    assert first.exact and second.exact and p.optimizer_steps == 1000 and p.warmup_steps == 100
    # the main batch (batch.effective at batch.sequence_length) is the 512 phase
    assert (p.micro_batch, p.accumulation_steps) == (16, 16)
    # the LR schedule runs on across the phases: the same as the plan of one batch throughout
    single = make_plan(parse_recipe(lm(None, warmup={"steps": 100}, decay={"kind": "linear"})), 16)
    assert [lr_at(p, s) for s in (0, 50, 899, 900, 901, 999)] == [lr_at(single, s) for s in (0, 50, 899, 900, 901,
                                                                                                999)]


def test_a_phase_that_cannot_be_exact_gets_its_own_lr_factor():
    phases = [{"steps": 10, "effective": 64, "sequence_length": 128}, {"effective": 96}]
    recipe = parse_recipe(lm(phases, effective=96, total={"steps": 30}))
    p = make_plan(recipe, 8, world_size=5)  # neither 64 nor 96 splits over 5 processes
    assert not p.segments[0].exact and p.segments[0].effective_batch % 5 == 0
    factor = p.segments[0].effective_batch / 64
    assert p.segments[0].lr_factor == pytest.approx(factor ** 0.5)  # AdamW: square-root rule
    assert lr_at(p, 0) == pytest.approx(1e-4 * factor ** 0.5)
    assert lr_at(p, 29) == pytest.approx(1e-4 * p.segments[1].lr_factor)
    assert any("batch.phases[0]: effective batch" in w for w in p.warnings)


def gpt3_like(start=8, grain_tokens=4000, total_tokens=40000, warmup_tokens=3000):
    return parse_recipe(lm(None, ramp={"start": start * 8, "length": {"tokens": grain_tokens}}, effective=512,
                           length=8, total={"tokens": total_tokens}, warmup={"tokens": warmup_tokens},
                           decay={"kind": "cosine"}, unit="tokens"))


def test_ramp_batches_follow_the_recipes_granularity_and_the_tokens_stay_exact():
    p = make_plan(gpt3_like(), 4, world_size=2)  # 64 sequences of 8 tokens; grain: one sequence per process = 2
    ramp, final = p.segments[:-1], p.segments[-1]
    batches = [phase.effective_batch for phase in ramp]
    assert batches == sorted(set(batches)) and batches[0] == 8 and batches[-1] < 64
    assert all(b % 2 == 0 and phase.micro_batch == 4 and phase.accumulation_steps == -(-b // 2 // 4)
               for b, phase in zip(batches, ramp, strict=True))
    assert final.kind == "phase" and final.effective_batch == 64 and final.exact
    per_step = [phase.effective_batch * 8 for phase in p.segments for _ in range(phase.steps or 0)]
    total_tokens = sum(per_step) + (p.optimizer_steps - len(per_step)) * 64 * 8
    assert abs(total_tokens - 40000) <= 64 * 8 / 2  # the schedule's 40,000 tokens, to half a step
    assert abs(sum(per_step[: p.warmup_steps]) - 3000) <= max(per_step[: p.warmup_steps + 1]) / 2
    # the ramp's own length: 4,000 tokens read before the target batch
    assert 4000 <= sum(per_step) < 4000 + 64 * 8


@settings(max_examples=60, deadline=None)
@given(start=st.integers(1, 63), micro=st.integers(1, 16), world=st.integers(1, 4),
       length=st.integers(500, 50000), steps_unit=st.booleans())
@example(start=63, micro=1, world=3, length=500, steps_unit=False)  # 64 over 3 processes: the plan's 63 = the start
def test_ramp_invariants(start, micro, world, length, steps_unit):
    unit = {"steps": max(1, length // 1000)} if steps_unit else {"samples": length}
    recipe = parse_recipe(lm(None, ramp={"start": start * 8, "length": unit}, effective=512, length=8,
                             total={"samples": 200000}, unit="tokens"))
    p = make_plan(recipe, micro, world_size=world)
    grain = world  # the recipe's default granularity: one sequence per process, whatever the micro-batch
    assert p.segments[-1].effective_batch == p.effective_batch and p.segments[-1].steps is None
    for index, phase in enumerate(p.segments):
        if phase.kind == "ramp":
            share = phase.effective_batch // world
            assert phase.effective_batch % grain == 0 and grain <= phase.effective_batch < p.effective_batch
            assert phase.micro_batch == min(p.micro_batch, share)
            assert phase.accumulation_steps == -(-share // phase.micro_batch)
            assert index == 0 or p.segments[index - 1].effective_batch < phase.effective_batch
        else:
            assert phase.micro_batch * phase.accumulation_steps * world == phase.effective_batch
        if index:
            assert phase.start_step == p.segments[index - 1].start_step + p.segments[index - 1].steps


def naive_stream(batches: list[tuple[int, int]], sizes: dict, world: int, drop_last: bool) -> list[tuple]:
    """Step by step: each length's position in its own data, epoch after epoch (what the windows must follow)."""
    position, out = {}, []
    for batch, length in batches:
        epoch, offset = position.get(length, (0, 0))
        left = sizes[length] - offset
        if left < batch and (drop_last or left < world):  # the rest of the epoch is dropped
            epoch, offset, left = epoch + 1, 0, sizes[length]
        size = min(batch, left)
        out.append((epoch, offset, size))
        offset += size
        position[length] = (epoch + 1, 0) if offset >= sizes[length] else (epoch, offset)
    return out


@settings(max_examples=80, deadline=None)
@given(drop_last=st.booleans(), world=st.integers(1, 3),
       segments=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40), st.sampled_from([16, 32])), min_size=1,
                         max_size=5))
def test_stream_windows_follow_each_lengths_data(drop_last, world, segments):
    sizes = {16: 101, 32: 50}
    phases, start = [], 0
    for index, (steps, batch, length) in enumerate(segments):
        batch = max(batch, world)
        last = index == len(segments) - 1
        per_epoch, _ = epoch_steps(sizes[length], batch, world, drop_last)
        phases.append(Segment(kind="phase", start_step=start, steps=None if last else steps, micro_batch_max=batch,
                                micro_batch=batch, accumulation_steps=1, effective_batch=batch,
                                paper_effective_batch=batch, sequence_length=length, exact=True, lr_factor=1.0,
                                dataset_size=sizes[length], steps_per_epoch=per_epoch))
        start += 0 if last else steps
    total = start + 6
    flat = [(p.effective_batch, p.sequence_length) for p in phases for _ in range(
        p.steps if p.steps is not None else total - p.start_step)]
    want = naive_stream(flat, sizes, world, drop_last)
    got = [stream_window(phases, step, world, drop_last) for step in range(total)]
    assert [(w.epoch, w.offset, w.size) for w in got] == want


def test_schedule_in_epochs_walks_the_phases():
    recipe = parse_recipe({
        "batch": {"effective": 64, "phases": [{"epochs": 2, "effective": 32}, {"effective": 64}]},
        "task": "classification", "model": {"builtin": "mlp"}, "data": {"builtin": "digits", "train_size": 1000},
        "optimizer": SGD, "schedule": {"warmup": {"epochs": 3}, "total": {"epochs": 4}},
    })
    p = make_plan(recipe, 16)
    assert p.segments[0].steps == 62 and p.segments[1].start_step == 62  # 2 x (1000 // 32)
    assert p.warmup_steps == 62 + 15 and p.optimizer_steps == 62 + 2 * 15  # then epochs of 1000 // 64 = 15 steps
    assert lengths_to_steps(p.segments, Length(samples=32 * 62 + 64), "x", []) == 63


# ---- the plan file -----------------------------------------------------------------------------------------


def test_plans_with_phases_round_trip_and_check_their_phases():
    recipe = parse_recipe(lm(BERT))
    p = make_plan(recipe, {128: 64, 512: 16})
    data = yaml.safe_load(plan_to_yaml(p))
    assert parse_plan(data, "plan.yaml") == p
    data["segments"][1]["accumulation_steps"] = 8
    data["segments"][0]["start_step"] = 3
    with pytest.raises(UserError) as info:
        parse_plan(data, "plan.yaml")
    assert info.value.lines == [
        "plan.yaml: segments[0].start_step: expected 0 (where the segment before it ends), got 3",
        "plan.yaml: segments[1].effective_batch: micro_batch x accumulation_steps x world_size = 16 x 8 x 1 = 128, "
        "not 256",
        "plan.yaml: segments[1].start_step: expected 903 (where the segment before it ends), got 900",
    ]
    data = yaml.safe_load(plan_to_yaml(p))
    data["segments"] = [{**data["segments"][-1], "kind": "whole", "start_step": 0}]
    with pytest.raises(UserError, match="the recipe's batch has phases or a ramp, but the plan has one `whole`"):
        parse_plan(data, "plan.yaml")


def test_a_plan_from_before_phases_loads_as_before():
    p = make_plan(parse_recipe(lm(None)), 16)
    data = {**flat_fields(p), "recipe": p.recipe.model_dump(mode="json")}  # a reproduce-plan/1 file's fields
    del data["phases"]  # written by a version without batch phases
    assert parse_plan(data, "old.yaml") == p


def test_plan_command_prints_the_phases_and_the_ramp(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "papers/brown2020-gpt3-small.yaml", "--micro-batch-max", "16"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "batch phases" in out and "ramp from 32,768 tokens" in out and "16 x 16 x 1 = 256  exact" in out
    with pytest.raises(SystemExit):
        main(["plan", "papers/devlin2019-bert-base.yaml", "--micro-batch-max", "16", "--json"])
    phases = json.loads(capsys.readouterr().out)["phases"]
    assert [(p["start_step"], p["steps"], p["sequence_length"]) for p in phases] == [(0, 900000, 128),
                                                                                    (900000, None, 512)]


# ---- reproduce run against a plain loop ------------------------------------------------------------------


def digits(batch: dict, steps: int, shuffle=False, model=None) -> dict:
    return {"batch": batch, "task": "classification", "model": model or {"builtin": "mlp"},
            "data": {"builtin": "digits", "shuffle": shuffle}, "optimizer": SGD,
            "schedule": {"total": {"steps": steps}}}


def plain_loop_over(recipe_data: dict, windows: list[tuple], datasets: dict) -> dict:
    """The plain loop (tests/helpers.py) over each step's whole batch: (sequence length, first item, size) windows."""
    def batches():
        for length, start, size in windows:
            dataset = datasets[length]
            if hasattr(dataset, "tensors"):
                yield dataset.tensors[0][start:start + size], dataset.tensors[1][start:start + size]
            else:
                yield dataset.batch(torch.arange(start, start + size))
    return plain_loop(recipe_data, batches(), {"vocab_size": 256})


def run(recipe_data: dict, micro: int, out, **kwargs):
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    from reproduce.data import training_sizes

    plan = make_plan(recipe, micro, dataset_size=training_sizes(recipe, data.train))
    train(plan, RunRequest(out, device="cpu", **kwargs), dtype=torch.float64, data=data)
    return plan, data, torch.load(out / "model.pt", weights_only=True), read_metrics(out / "metrics.jsonl")


def test_batch_phases_run_equals_a_plain_loop_over_the_same_batches_float64(tmp_path):
    recipe = digits({"effective": 64, "phases": [{"steps": 3, "effective": 32}, {"steps": 2, "effective": 128},
                                                 {"effective": 64}]}, steps=8)
    plan, data, ours, records = run(recipe, 16, tmp_path / "run")
    assert [r["accumulation_steps"] for r in records] == [2, 2, 2, 8, 8, 4, 4, 4]
    assert [r["phase"] for r in records] == [1, 1, 1, 2, 2, 3, 3, 3]
    batches = [(32, None)] * 3 + [(128, None)] * 2 + [(64, None)] * 3
    windows = [(length, start, size) for (_, length), (_, start, size) in zip(
        batches, naive_stream(batches, {None: 1437}, 1, True), strict=True)]
    assert windows[3] == (None, 96, 128) and windows[5] == (None, 352, 64)
    reference = plain_loop_over(recipe, windows, {None: data.train})
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)


def test_ramp_run_equals_a_plain_loop_over_the_ramps_batches_float64(tmp_path):
    recipe = digits({"effective": 96, "ramp": {"start": 16, "length": {"samples": 300}}}, steps=12)
    plan, data, ours, records = run(recipe, 16, tmp_path / "run")
    # by the ramp's definition: batch = 16 + (96 - 16) x samples read / 300, rounded down to whole samples (the
    # default granularity, one per process: not the micro-batch), until 300 samples are read; then 96
    expected, read = [], 0
    while len(expected) < 12:
        expected.append(96 if read >= 300 else int(16 + 80 * read / 300))
        read += expected[-1]
    assert expected[:5] == [16, 20, 25, 32, 40]
    assert [r["samples"] for r in records] == expected
    # a batch that is not a whole number of micro-batches of 16 ends with a smaller one (20 = 16 + 4)
    assert [r["accumulation_steps"] for r in records] == [-(-b // 16) for b in expected]
    starts = [sum(expected[:i]) for i in range(12)]
    reference = plain_loop_over(recipe, [(None, s, b) for s, b in zip(starts, expected, strict=True)],
                           {None: data.train})
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)


def pysource_lm(shuffle=False, dropout=0.0) -> dict:
    return {
        "batch": {"effective": 4, "sequence_length": 32,
                  "phases": [{"steps": 2, "effective": 8, "sequence_length": 16}, {"effective": 4}]},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 1, "heads": 2, "dim": 16, "dropout": dropout}},
        "data": {"builtin": "pysource", "kwargs": {"max_bytes": 200000}, "shuffle": shuffle},
        "optimizer": SGD, "schedule": {"total": {"steps": 4}}, "evaluation": {"at_end": False},
    }


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "loader-worker"])
def test_sequence_length_phases_read_the_data_cut_at_each_length_float64(workers, tmp_path):
    recipe = pysource_lm()
    plan, data, ours, records = run(recipe, 2, tmp_path / "run", workers=workers)
    assert [(r["sequence_length"], r["samples"], r["tokens"]) for r in records] == [
        (16, 8, 128), (16, 8, 128), (32, 4, 128), (32, 4, 128)]
    for record in records:  # each phase's tokens per second at its own length (16 tokens, then 32), not the recipe's
        assert record["tokens_per_second"] == pytest.approx(record["samples_per_second"] * record["sequence_length"],
                                                            rel=1e-3)
    cut = {16: data.train.with_sequence_length(16), 32: data.train}
    windows = [(16, 0, 8), (16, 8, 8), (32, 0, 4), (32, 4, 4)]  # each length reads its own data from its start
    reference = plain_loop_over(recipe, windows, cut)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)


def test_resume_across_phase_boundaries_is_bitwise(tmp_path):
    recipe = digits({"effective": 64, "phases": [{"steps": 3, "effective": 32}, {"steps": 2, "effective": 128},
                                                 {"effective": 64}]}, steps=8, shuffle=True,
                    model={"builtin": "mlp", "kwargs": {"dropout": 0.3}})
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, 16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    # stops inside the first phase
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=2), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)  # and crosses both boundaries
    assert_same_model(tmp_path / "full", tmp_path / "split")
    assert [r["loss"] for r in read_metrics(tmp_path / "split" / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]


def test_data_that_cannot_be_cut_at_another_length_is_refused(tmp_path):
    recipe = pysource_lm()
    recipe["data"] = {"factory": "factories:variable_lm", "shuffle": False}
    with pytest.raises(UserError, match="cannot be cut at another length: its dataset has no with_sequence_length"):
        run(recipe, 2, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["devlin2019-bert-base.yaml", "you2019-lamb-bert-large.yaml"])
def test_check_re_derives_each_phase_length_and_catches_a_wrong_one(name):
    """`reproduce check`'s plan invariants: each phase's steps come back from its recipe length; one more is caught."""
    from pathlib import Path

    from reproduce.check.invariants import plan_problems
    from reproduce.check.schema import Budget
    from reproduce.plan.recipe import load_recipe

    plan = make_plan(load_recipe(Path(__file__).resolve().parents[2] / "papers" / name), 32, 1)
    assert plan_problems(plan, Budget(micro_batch_max=32)) == []
    phases = list(plan.segments)
    phases[0] = phases[0].model_copy(update={"steps": phases[0].steps + 1})
    problems = plan_problems(plan.model_copy(update={"segments": phases}), Budget(micro_batch_max=32))
    assert (f"phases[0].steps: batch.phases[0] is {plan.recipe.batch.phases[0].value:g} steps, "
            f"{phases[0].steps - 1} steps of {phases[0].effective_batch}; the plan has {phases[0].steps}") in problems
