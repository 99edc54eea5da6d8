"""The whole run's forecast cost and the recipe's budget checked against it at plan time (throughput/budget.py), on
step times given as the probe records them: what a split costs, and the cheapest exact way that fits a budget."""

from __future__ import annotations

import pytest

from reproduce.errors import UserError
from reproduce.plan.overlay import changes_of, overlay
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.probe.runner import ProbeResult, ProbeTrial
from reproduce.throughput.budget import cheaper_ways, forecast
from reproduce.throughput.cost import plan_costs
from reproduce.throughput.predicted_time import gpu_hours

GPT = "papers/pysource-gpt.yaml"  # 64 sequences a step, 300 steps


def probed(times: dict[int, float]) -> ProbeResult:
    """A CPU probe that timed one micro-step of each size in `times` (seconds)."""
    trials = [ProbeTrial(micro_batch=m, fits=True, peak_bytes=1, seconds=1.0, step_seconds=s) for m, s in times.items()]
    return ProbeResult(recipe_path=GPT, meter="cpu", device="cpu", gpu=None, data="synthetic", budget_bytes=2**30,
                       headroom=0.1, limit_bytes=2**30, cap=64, world_size=1, micro_batch_max=64, peak_bytes=1,
                       tensor_bytes=1, step_seconds=None, trials=trials, line=None, seconds=1.0, torch_version="-")


def planned(overrides: list[str], world_size: int, result: ProbeResult):
    """The plan and its prediction as `plan` makes them on a measured device: the measured step time x the steps."""
    recipe = overlay(load_recipe(GPT), changes_of(overrides), "the recipe")
    plan = make_plan(recipe, 64, world_size, recipe_path=GPT)
    seconds = plan_costs(plan, result)[plan.policy].total_seconds
    prediction = {"predicted_seconds": seconds, "predicted_basis": "measured step time on cpu",
                  "gpu_hours": gpu_hours(seconds, world_size)}
    return plan, prediction


# 0.01 s a sample at micro-batch 8, 0.005 s at 64: fewer GPUs allow the larger, cheaper micro-batch
FASTER_LARGE = {8: 0.08, 64: 0.32}


def test_the_forecast_is_gpus_times_hours_on_its_basis_and_money_at_the_users_price():
    plan, prediction = planned([], 8, probed(FASTER_LARGE))
    assert (plan.micro_batch, plan.accumulation_steps, plan.world_size) == (8, 1, 8)
    out = forecast(plan, probed(FASTER_LARGE), prediction, price=2.0)
    assert out["gpu_hours"] == pytest.approx(300 * 0.08 * 8 / 3600)
    assert out["basis"] == "measured step time on cpu" and out["basis_kind"] == "measured"
    assert out["money"] == pytest.approx(2.0 * out["gpu_hours"]) and out["price_from"] == "price"
    assert out["budget"] is None and out["within_budget"] is None


def test_the_recipes_price_counts_when_no_price_is_given_and_the_given_one_wins():
    plan, prediction = planned(["budget.gpu_hours=1", "budget.price=3", "budget.currency=EUR"], 8,
                               probed(FASTER_LARGE))
    out = forecast(plan, probed(FASTER_LARGE), prediction)
    assert (out["price"], out["price_from"], out["currency"]) == (3.0, "budget.price", "EUR")
    assert out["within_budget"] is True and out["budget"] == {"gpu_hours": 1.0, "price": 3.0, "currency": "EUR"}
    assert forecast(plan, probed(FASTER_LARGE), prediction, price=1.5)["money"] == pytest.approx(
        1.5 * out["gpu_hours"])


def test_the_cheaper_ways_cost_each_split_at_its_micro_batchs_time():
    result = probed(FASTER_LARGE)
    plan, _ = planned([], 8, result)
    ways = {(w.world_size, w.micro_batch): w for w in cheaper_ways(plan, result)}
    assert ways[1, 64].gpu_hours == pytest.approx(300 * 0.32 / 3600)  # measured
    t32 = 0.08 + (0.32 - 0.08) * (32 - 8) / (64 - 8)  # interpolated between the timed sizes
    assert ways[2, 32].accumulation_steps == 1 and ways[2, 32].gpu_hours == pytest.approx(300 * t32 * 2 / 3600)
    assert ways[64, 1].gpu_hours == pytest.approx(300 * 0.01 * 64 / 3600)  # scaled from the smallest timed size
    assert cheaper_ways(plan, result)[0] == ways[1, 64]


def test_a_budget_the_forecast_exceeds_is_refused_naming_the_gpu_count_that_fits():
    result = probed(FASTER_LARGE)
    plan, prediction = planned(["budget.gpu_hours=0.03"], 8, result)  # the plan's 0.0533; 1 GPU at 64 x 1: 0.0267
    with pytest.raises(UserError) as caught:
        forecast(plan, result, prediction)
    assert caught.value.lines == [
        "`budget.gpu_hours`: the forecast of the whole run is 0.0533 GPU-hours (8 GPUs at 8 x 1, measured step time on "
        "cpu), over the budget of 0.03 GPU-hours; the cheapest exact split that fits: 1 GPU at 64 x 1 (0.0267 "
        "GPU-hours) (`world_size` 1)"]


def test_a_cheaper_split_on_the_same_gpus_is_named_with_its_micro_batch():
    slower_large = {16: 0.16, 64: 1.28}  # 0.01 s a sample at 16, 0.02 s at 64
    plan, prediction = planned(["budget.gpu_hours=0.06"], 1, probed(slower_large))
    assert plan.micro_batch == 64
    with pytest.raises(UserError) as caught:
        forecast(plan, probed(slower_large), prediction)
    assert caught.value.lines[0].endswith(
        "the cheapest exact split that fits: 1 GPU at 16 x 4 (0.0533 GPU-hours) (`world_size` 1 and "
        "`micro_batch_max` 16)")


def test_when_nothing_fits_the_line_says_so_and_the_least_budget():
    result = probed(FASTER_LARGE)
    plan, prediction = planned(["budget.money=0.01", "budget.price=0.5", "budget.currency=EUR"], 8, result)
    with pytest.raises(UserError) as caught:
        forecast(plan, result, prediction)
    line, = caught.value.lines
    assert line.startswith("`budget.money`: the forecast of the whole run is 0.0533 GPU-hours = 0.0267 EUR ")
    assert line.endswith("over the budget of 0.01 EUR; no exact split or GPU count fits (the cheapest is 1 GPU at "
                         "64 x 1 (0.0267 GPU-hours), on the probe's step times); raise the budget to at least 0.0267 "
                         "GPU-hours = 0.0133 EUR")


def test_the_flops_models_hours_are_the_same_for_every_split_so_nothing_else_fits():
    recipe = overlay(load_recipe(GPT), changes_of(["budget.gpu_hours=1"]), "the recipe")
    plan = make_plan(recipe, 64, 1, recipe_path=GPT)
    prediction = {"predicted_seconds": 7200.0, "gpu_hours": 2.0,
                  "predicted_basis": "FLOPs model: 1 x NVIDIA A100 80GB at 19.5 TFLOP/s fp32 x MFU 40%"}
    with pytest.raises(UserError) as caught:
        forecast(plan, None, prediction)
    assert caught.value.lines[0].endswith("no split or GPU count fits: the FLOPs model's GPU-hours are the same for "
                                          "all of them; raise the budget to at least 2 GPU-hours, or plan for a "
                                          "faster GPU (`gpu`)")
    assert forecast(plan, None, {**prediction, "gpu_hours": 0.5})["basis_kind"] == "datasheet"


def test_on_the_datasheets_the_card_with_the_fewest_gpu_hours_that_fit_is_named():
    """2 GPU-hours on an A100's 19.5 TFLOP/s fp32 at MFU 40%: the same FLOPs on each catalog card's own peak."""
    recipe = overlay(load_recipe(GPT), changes_of(["budget.gpu_hours=1"]), "the recipe")
    plan = make_plan(recipe, 64, 1, recipe_path=GPT)
    per_sample = 2 * 3600 * 19.5e12 * 0.4 / (300 * 64)
    prediction = {"predicted_seconds": 7200.0, "gpu_hours": 2.0, "flops_per_sample": per_sample,
                  "precision": "fp32", "mfu_assumed": 0.4,
                  "predicted_basis": "FLOPs model: 1 x NVIDIA A100 80GB at 19.5 TFLOP/s fp32 x MFU 40%"}
    with pytest.raises(UserError) as caught:
        forecast(plan, None, prediction)
    assert caught.value.lines[0].endswith(  # MI300X: 163.4 TFLOP/s fp32 (AMD's data sheet): 2 x 19.5 / 163.4
        "the catalog's mi300x would (0.239 GPU-hours at its datasheet peak; `gpu` mi300x plans it, memory "
        "included), or raise the budget to at least 2 GPU-hours")
    with pytest.raises(UserError) as caught:  # no card does 0.1 GPU-hours
        recipe = overlay(load_recipe(GPT), changes_of(["budget.gpu_hours=0.1"]), "the recipe")
        forecast(make_plan(recipe, 64, 1), None, prediction)
    assert caught.value.lines[0].endswith("the same for all of them, nor does another GPU of the catalog; raise the "
                                          "budget to at least 2 GPU-hours")


def test_a_money_budget_needs_a_price_and_no_forecast_leaves_the_budget_unchecked():
    plan = make_plan(overlay(load_recipe(GPT), changes_of(["budget.money=10"]), "the recipe"), 64, 1, recipe_path=GPT)
    with pytest.raises(UserError) as caught:
        forecast(plan, None, {"gpu_hours": 1.0, "predicted_basis": "measured step time on cpu"})
    assert caught.value.lines == ["`budget.money`: a money budget needs the price of one GPU-hour: give `price` P "
                                  "(per GPU-hour) or budget.price"]
    out = forecast(plan, None, {"gpu_hours": None, "notes": ["no prediction for this plan"]}, price=2)
    assert out["within_budget"] is None and out["notes"][0].startswith("budget not checked: no forecast")
    with pytest.raises(UserError, match="price of one GPU-hour, > 0"):
        forecast(plan, None, {}, price=0)


def test_when_the_plan_is_the_cheapest_way_the_line_says_so():
    result = probed(FASTER_LARGE)
    plan, prediction = planned(["budget.gpu_hours=0.01"], 1, result)  # 1 GPU at 64 x 1: 0.0267, the cheapest
    with pytest.raises(UserError) as caught:
        forecast(plan, result, prediction)
    assert caught.value.lines[0].endswith("no exact split or GPU count fits (this plan's is the cheapest, on the "
                                          "probe's step times); raise the budget to at least 0.0267 GPU-hours")


def test_a_plan_with_batch_phases_is_refused_without_other_splits():
    path = "papers/pysource-gpt-phases.yaml"
    plan = make_plan(overlay(load_recipe(path), changes_of(["budget.gpu_hours=0.001"]), "the recipe"), 64, 1,
                     recipe_path=path)
    assert plan.has_phases and cheaper_ways(plan, probed(FASTER_LARGE)) == []
    prediction = {"predicted_seconds": 36.0, "gpu_hours": 0.01, "predicted_basis": "measured step time on cpu"}
    with pytest.raises(UserError) as caught:
        forecast(plan, probed(FASTER_LARGE), prediction)
    assert caught.value.lines[0].endswith("over the budget of 0.001 GPU-hours; no other split is forecast for a plan "
                                          "with batch phases; raise the budget to at least 0.01 GPU-hours")
