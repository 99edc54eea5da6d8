"""`reproduce plan`'s forecast cost and the recipe's budget (throughput/budget.py through the CLI): the cost row of
the table, `plan --json`'s `forecast`, and a budget the forecast exceeds refused before anything is written."""

from __future__ import annotations

import pytest

from helpers import cli, cli_json

PAPER = """\
batch: {effective: 4096, unit: tokens, sequence_length: 32, devices: 8, per_device: 16, device: A100-80GB}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 32, vocab_size: 64}}
data: {name: a corpus we do not have, available: false}
optimizer: {name: adamw, lr: 1.0e-3}
precision: bf16
schedule: {total: {steps: 1000}}
"""
ON_A100 = ("--gpu", "a100-80gb", "--micro-batch-max", "16")


@pytest.fixture(autouse=True)
def files(isolated, tmp_path):
    (tmp_path / "paper.yaml").write_text(PAPER, encoding="utf-8")


def test_the_forecast_is_the_predicted_time_on_the_plans_gpus_and_the_money_at_the_given_price(capsys):
    summary = cli_json(capsys, "plan", "paper.yaml", *ON_A100, "--world-size", "4", "--price", "2.5")
    forecast = summary["forecast"]
    assert forecast["gpu_hours"] == pytest.approx(summary["predicted_seconds"] * 4 / 3600)
    assert forecast["gpus"] == 4 and forecast["basis_kind"] == "datasheet"
    assert forecast["basis"] == "FLOPs model: 4 x NVIDIA A100 80GB at 312 TFLOP/s bf16 x MFU 40%"
    assert forecast["money"] == pytest.approx(2.5 * forecast["gpu_hours"]) and forecast["price_from"] == "price"
    assert forecast["paper_gpu_hours"] == pytest.approx(summary["prediction"]["paper_gpu_hours"])
    assert forecast["budget"] is None and forecast["within_budget"] is None


def test_the_table_shows_the_cost_row_and_a_budget_within_it(capsys):
    code, out, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--set", "budget.gpu_hours=1",
                         "--set", "budget.price=3", "--set", "budget.currency=EUR")
    assert code == 0, err
    row = out[out.index("cost (forecast)"):]
    assert "GPU-hours (1 GPU x " in row and "at 3.00 EUR per GPU-hour" in row and "budget 1 GPU-hours: within" in row


def test_a_budget_the_forecast_exceeds_is_refused_with_one_line_and_nothing_written(capsys, tmp_path):
    for extra in ([], ["--emit", "torchrun"], ["--json"]):
        code, out, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--set", "budget.gpu_hours=1e-9",
                             "--out", "plan.yaml", *extra)
        assert code == 2 and out == "" and "Traceback" not in err
        line, = err.strip().splitlines()
        assert line.startswith("error: budget.gpu_hours: the forecast of the whole run is 9.15e-07 GPU-hours (1 GPU "
                               "at 16 x 8, FLOPs model: 1 x NVIDIA A100 80GB")
        assert line.endswith("over the budget of 1e-09 GPU-hours; no split or GPU count fits: the FLOPs model's "
                             "GPU-hours are the same for all of them, nor does another GPU of the catalog; raise "
                             "the budget to at least 9.15e-07 GPU-hours")
        assert not (tmp_path / "plan.yaml").exists()


def test_a_money_budget_needs_a_price_and_a_bad_price_is_one_line(capsys):
    code, _, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--set", "budget.money=100")
    assert code == 2 and err.strip() == ("error: budget.money: a money budget needs the price of one GPU-hour: give "
                                         "--price P (per GPU-hour) or budget.price")
    code, _, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--price", "0")
    assert code == 2 and err.strip() == "error: --price: expected the price of one GPU-hour, > 0 (got 0)"
    code, out, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--set", "budget.money=1e-7", "--price", "0.5")
    assert code == 2 and err.strip().endswith("raise the budget to at least 9.15e-07 GPU-hours = 4.57e-07")
    code, out, err = cli(capsys, "plan", "paper.yaml", *ON_A100, "--set", "budget.gpu_hours=5e-7")
    assert code == 2 and err.strip().endswith(  # bf16: the A100's 312 TFLOP/s, the MI300X's 1307.4
        "the catalog's mi300x would (2.18e-07 GPU-hours at its datasheet peak; --gpu mi300x plans it, memory "
        "included), or raise the budget to at least 9.15e-07 GPU-hours")


def test_a_measured_device_forecasts_from_its_step_time_and_refuses_on_it(capsys):
    summary = cli_json(capsys, "plan", "paper.yaml", "--meter", "cpu", "--memory", "4MiB")
    forecast = summary["forecast"]
    assert forecast["basis"] == "measured step time on cpu" and forecast["basis_kind"] == "measured"
    assert forecast["gpu_hours"] == pytest.approx(summary["cost"]["exact"]["total_seconds"] / 3600)
    code, out, err = cli(capsys, "plan", "paper.yaml", "--meter", "cpu", "--memory", "4MiB",
                         "--set", f"budget.gpu_hours={forecast['gpu_hours'] / 1000:.3g}")  # the probe's cache: the same
    assert code == 2 and out == ""  # step times as the first plan
    line, = [line for line in err.splitlines() if line.startswith("error:")]  # (after the probe's line)
    assert line.startswith("error: budget.gpu_hours: the forecast of the whole run is ")
    assert "measured step time on cpu), over the budget of " in line
    assert "; no exact split or GPU count fits (" in line, line  # 1000 x cheaper: none does
