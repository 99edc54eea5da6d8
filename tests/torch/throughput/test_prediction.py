"""`reproduce plan`'s predicted time: this plan's and the paper's hardware's, from FLOPs or a measured step."""

from __future__ import annotations

import pytest

from helpers import cli, cli_json
from reproduce.throughput.predicted_time import DEFAULT_MFU

PAPER = """\
batch: {effective: 4096, unit: tokens, sequence_length: 32, devices: 8, per_device: 16, device: A100-80GB}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 32, vocab_size: 64}}
data: {name: a corpus we do not have, available: false}
optimizer: {name: adamw, lr: 1.0e-3}
precision: bf16
schedule: {total: {steps: 1000}}
"""


@pytest.fixture(autouse=True)
def files(isolated, tmp_path):
    (tmp_path / "paper.yaml").write_text(PAPER, encoding="utf-8")
    (tmp_path / "tpu.yaml").write_text(PAPER.replace("A100-80GB", "TPUv3 chip"), encoding="utf-8")


def plan_json(capsys, *argv: str) -> dict:
    return cli_json(capsys, "plan", *argv)


def test_predicted_time_is_the_flops_over_the_devices_peak_at_the_stated_mfu(capsys):
    summary = plan_json(capsys, "paper.yaml", "--gpu", "rtx4090", "--micro-batch-max", "16", "--world-size", "2")
    prediction = summary["prediction"]
    steps, per_step = summary["optimizer_steps"], prediction["flops_per_step"]
    assert per_step == prediction["flops_per_sample"] * 128 and prediction["precision"] == "bf16"
    assert summary["predicted_seconds"] == pytest.approx(steps * per_step / (2 * 165.2e12 * DEFAULT_MFU))
    # the paper's own hardware: 8 x A100 80GB (312 TFLOP/s dense bf16), the same samples
    assert summary["paper_predicted_seconds"] == pytest.approx(steps * per_step / (8 * 312e12 * DEFAULT_MFU))
    assert prediction["mfu_assumed"] == DEFAULT_MFU and "Chowdhery et al. 2022" in prediction["mfu_source"]
    halved = plan_json(capsys, "paper.yaml", "--gpu", "rtx4090", "--micro-batch-max", "16", "--world-size", "2",
                       "--mfu", "0.2")
    assert halved["predicted_seconds"] == pytest.approx(2 * summary["predicted_seconds"])


def test_the_plan_prints_its_prediction_and_where_the_mfu_comes_from(capsys):
    code, out, err = cli(capsys, "plan", "paper.yaml", "--gpu", "a100-80gb", "--micro-batch-max", "16")
    assert code == 0, err
    assert "predicted time: " in out and "FLOPs model: 1 x NVIDIA A100 80GB at 312 TFLOP/s bf16 x MFU 40%" in out
    assert "predicted time on the paper's hardware: " in out and "MFU: assumed MFU 40%" in out


def test_unknown_peak_and_a_tpu_paper_predict_nothing(capsys):
    summary = plan_json(capsys, "tpu.yaml", "--gpu", "h100-80gb", "--micro-batch-max", "16")
    assert summary["predicted_seconds"] is None and summary["paper_predicted_seconds"] is None
    notes = " ".join(summary["prediction"]["notes"])
    assert "no datasheet peak" in notes and "TPU" in notes


def test_a_measured_device_predicts_from_its_step_time(capsys):
    summary = plan_json(capsys, "paper.yaml", "--meter", "cpu", "--memory", "4MiB")
    assert summary["prediction"]["predicted_basis"].startswith("measured step time on cpu")
    assert summary["predicted_seconds"] == pytest.approx(summary["cost"]["exact"]["total_seconds"])
    assert summary["paper_predicted_seconds"] > 0


def test_without_hardware_there_is_no_prediction_and_bad_mfu_is_one_line(capsys, tmp_path):
    summary = plan_json(capsys, "paper.yaml", "--micro-batch-max", "16")
    assert summary["predicted_seconds"] is None and "give --gpu" in summary["prediction"]["notes"][0]
    code, out, err = cli(capsys, "plan", "paper.yaml", "--micro-batch-max", "16", "--mfu", "1.5", "--out", "p.yaml")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --mfu: expected a fraction")
    assert "Traceback" not in err and not (tmp_path / "p.yaml").exists()  # nothing written


def test_a_batch_ramp_counts_each_stretchs_own_batch():
    from pathlib import Path

    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe
    from reproduce.throughput.predicted_time import total_samples

    recipe = load_recipe(Path(__file__).parents[3] / "papers" / "brown2020-gpt3-small.yaml")
    plan = make_plan(recipe, 4, 1)
    expected = sum(((p.end_step if p.end_step is not None else plan.optimizer_steps) - p.start_step)
                   * p.effective_batch for p in plan.segments)
    assert total_samples(plan) == expected < plan.optimizer_steps * plan.effective_batch


def test_exported_throughput_plan_names_the_chosen_micro_batch(capsys):
    from reproduce.export import export
    from reproduce.plan.recipe import load_recipe
    from reproduce.throughput.policy import throughput_plan

    plan = throughput_plan(load_recipe("paper.yaml"), "paper.yaml", 64, 1, None, None, gpu="a100-80gb")
    assert plan.policy == "throughput" and plan.throughput.basis == "model"
    assert f"--micro-batch-max {plan.micro_batch} --world-size 1" in export(plan, "torchrun").text
