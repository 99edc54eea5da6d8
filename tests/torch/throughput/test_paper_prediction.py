"""The paper's predicted time from the recipe alone: its hardware (batch.devices x batch.device) is in the recipe, so
`plan` predicts it without --gpu, which changes only `predicted_seconds`; the FLOPs count is cached, so planning again
imports no torch. The P100's datasheet rates, and FP32 (not TF32) on cards before Ampere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_json
from reproduce.hardware.catalog import lookup
from reproduce.hardware.peaks import identify, on_card, peaks_of
from reproduce.throughput.predicted_time import DEFAULT_MFU

ROOT = Path(__file__).resolve().parents[3]
GOYAL = str(ROOT / "papers" / "goyal2017-resnet50.yaml")


def test_the_papers_time_needs_no_gpu_and_gpu_changes_only_this_plans(isolated, capsys):
    alone = cli_json(capsys, "plan", GOYAL, "--micro-batch-max", "32")
    prediction = alone["prediction"]
    assert alone["predicted_seconds"] is None and "give --gpu NAME" in prediction["notes"][0]
    # 90 epochs of 1,281,167 images at 8,192 a step, 256 P100 SXM2 at their FP32 10.6 TFLOP/s (no TF32 on Pascal)
    steps = alone["optimizer_steps"]
    assert steps == 90 * (1_281_167 // 8192)
    assert prediction["paper_basis"] == "FLOPs model: 256 x NVIDIA Tesla P100 SXM2 16GB at 10.6 TFLOP/s fp32 x MFU 40%"
    expected = steps * 8192 * prediction["flops_per_sample"] / (256 * 10.6e12 * DEFAULT_MFU)
    assert alone["paper_predicted_seconds"] == pytest.approx(expected)
    # 2,575 s at the assumed 40%: the paper's "one hour" (3,600 s) is an MFU of 29%, within the range the model assumes
    assert expected == pytest.approx(2575, rel=0.01)
    with_gpu = cli_json(capsys, "plan", GOYAL, "--micro-batch-max", "32", "--gpu", "rtx4090")
    assert with_gpu["paper_predicted_seconds"] == alone["paper_predicted_seconds"]
    assert with_gpu["predicted_seconds"] == pytest.approx(steps * 8192 * prediction["flops_per_sample"] /
                                                          (82.6e12 * DEFAULT_MFU))  # TF32 on Ada: 82.6 TFLOP/s
    assert "tf32" in with_gpu["prediction"]["predicted_basis"]


def test_a_tpu_paper_is_not_modelled_and_counts_nothing(isolated, capsys):
    summary = cli_json(capsys, "plan", str(ROOT / "papers" / "dosovitskiy2021-vit-b16.yaml"), "--micro-batch-max", "64")
    assert summary["paper_predicted_seconds"] is None and "flops_per_sample" not in summary["prediction"]
    assert summary["prediction"]["notes"] == [
        "no predicted time: give --gpu NAME (or let the plan probe a device) to predict one"]


@pytest.mark.subprocess
def test_planning_again_reads_the_cached_count_and_imports_no_torch(tmp_path):
    env = {**os.environ, "REPRODUCE_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from reproduce.cli import main\n"
            f"try:\n    main(['plan', {GOYAL!r}, '--micro-batch-max', '32', '--json'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                           cwd=tmp_path) for _ in range(2)]
    assert [r.stderr.strip().splitlines()[-1] for r in runs] == ["True", "False"]
    first, again = (json.loads(r.stdout) for r in runs)
    assert again["paper_predicted_seconds"] == first["paper_predicted_seconds"] is not None


def test_p100_datasheet_rates_and_no_tf32_before_ampere():
    assert peaks_of("p100-sxm2").fp32 == 10.6e12 and peaks_of("p100-pcie").fp32 == 9.3e12
    assert peaks_of("p100-sxm2").bandwidth == peaks_of("p100-pcie").bandwidth == 732e9
    assert peaks_of("p100-16gb").fp32 is None  # the name covers both cards: no single rate
    assert lookup("P100-SXM2-16GB").name == "p100-sxm2" and lookup("p100-pcie-16gb").name == "p100-pcie"
    assert identify("Tesla P100-SXM2-16GB", 16) == "p100-sxm2" and identify("Tesla P100-PCIE-16GB", 16) == "p100-pcie"
    assert on_card("tf32", lookup("v100-32gb").capability) == "fp32"
    assert on_card("tf32", lookup("p100-sxm2").capability) == "fp32"
    assert on_card("tf32", lookup("a100-80gb").capability) == "tf32"
    assert on_card("fp16", lookup("v100-32gb").capability) == "fp16"


def test_the_throughput_model_uses_the_fp32_peak_before_ampere():
    """A convolution model in fp32 (cuDNN's TF32 column on Ampere and later) on a V100, which has no TF32: the
    throughput policy's FLOPs model times its splits at the fp32 peak (hardware/peaks.on_card), as predictions do."""
    from reproduce.plan.recipe import load_recipe
    from reproduce.throughput.policy import _model_times

    recipe = load_recipe(Path(__file__).parents[3] / "papers" / "goyal2017-resnet50.yaml")
    times, kinds = _model_times(recipe, "v100-16gb", [16, 32], None, 0.4)
    assert kinds == {16: "model", 32: "model"} and times[16] < times[32]
    assert peaks_of("v100-16gb").tf32 is None and peaks_of("v100-16gb").fp32 is not None
