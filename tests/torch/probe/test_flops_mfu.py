"""FLOPs counted on fake tensors, the GPU catalog's peaks, MFU, and each step's rates in metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from reproduce.cli import main
from reproduce.hardware.catalog import GPUS
from reproduce.hardware.peaks import PEAKS, identify, peaks_of, precision_key
from reproduce.observe.rates import mfu
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.flops import recipe_flops
from reproduce.throughput.predicted_time import DEFAULT_MFU, predicted_seconds

MLP = {
    "batch": {"effective": 64, "unit": "samples"},
    "task": "classification",
    "model": {"builtin": "mlp", "kwargs": {"hidden": 16}},
    "data": {"builtin": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "schedule": {"total": {"steps": 3}},
}
GPT = """\
batch: {effective: 512, unit: tokens, sequence_length: 16}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 16}}
data: {builtin: pysource}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 3}}
"""


pytestmark = pytest.mark.usefixtures("isolated")


def test_mlp_flops_are_the_matrix_products_forward_and_backward():
    """64 -> 16 -> 16 -> 10: forward 2 x (64h + h^2 + 10h); backward the weights' gradients (as much again) and the
    inputs' gradients of every layer but the first (the data needs none)."""
    h = 16
    forward = 2 * (64 * h + h * h + 10 * h)
    flops = recipe_flops(parse_recipe(MLP, "test"))
    assert flops.per_sample == 3 * forward - 2 * 64 * h
    assert flops.per_token is None and flops.convolution_share == 0
    assert sum(flops.by_op.values()) == flops.per_sample


def test_gpt_flops_count_attention_and_scale_per_token(tmp_path):
    (tmp_path / "gpt.yaml").write_text(GPT, encoding="utf-8")
    from reproduce.plan.recipe import load_recipe

    flops = recipe_flops(load_recipe(tmp_path / "gpt.yaml"))
    assert any("attention" in op for op in flops.by_op)  # the fused kernel CUDA runs, counted on any machine
    assert flops.per_token == flops.per_sample / 16


def test_every_catalog_gpu_has_datasheet_peaks_or_none():
    assert set(PEAKS) == set(GPUS)
    for name, peaks in PEAKS.items():
        assert peaks.source, name
        for precision in ("fp32", "tf32", "bf16", "fp16"):
            value = peaks.flops(precision)
            assert value is None or 1e12 < value < 2e15, (name, precision)
    a100 = peaks_of("a100-80gb")
    assert (a100.fp32, a100.tf32, a100.bf16) == (19.5e12, 156e12, 312e12)  # dense: the datasheet's sparse / 2
    assert peaks_of("v100-16gb").bf16 is None and peaks_of("h100-80gb").bf16 is None  # unknown: never guessed


def test_local_gpu_names_resolve_to_their_catalog_entry():
    assert identify("NVIDIA A100-SXM4-80GB", 79.2) == "a100-80gb"
    assert identify("NVIDIA A100-PCIE-40GB", 39.4) == "a100-40gb"
    assert identify("NVIDIA H100 80GB HBM3", 79.1) == "h100-sxm"
    assert identify("NVIDIA H100 PCIe", 79.1) == "h100-pcie"
    assert identify("NVIDIA H200", 139.8) == "h200" and identify("NVIDIA H200 NVL", 139.8) is None
    assert identify("Tesla V100-SXM2-32GB", 31.7) == "v100-32gb" and identify("Tesla V100-PCIE-16GB", 15.8) is None
    assert identify("NVIDIA GeForce RTX 4090", 23.6) == "rtx4090" and identify("Some GPU", 8) is None


def test_precision_and_mfu_arithmetic():
    assert precision_key("bf16") == "bf16" and precision_key("fp32") == "fp32" and precision_key("fp32", True) == "tf32"
    assert mfu(156e12, 2, 312e12) == pytest.approx(0.25)
    assert mfu(1e12, 1, None) is None and mfu(None, 1, 1e12) is None
    assert predicted_seconds(100, 1e15, 8, 312e12, 0.5) == pytest.approx(100 * 1e15 / (8 * 312e12 * 0.5))
    assert predicted_seconds(None, 1e15, 8, 312e12) is None and predicted_seconds(10, 1e15, 8, None) is None
    assert 0 < DEFAULT_MFU < 1


def test_run_metrics_carry_each_steps_throughput(tmp_path, capsys):
    (tmp_path / "gpt.yaml").write_text(GPT, encoding="utf-8")
    try:
        main(["run", "gpt.yaml", "--micro-batch-max", "8", "--max-steps", "3", "--out", "out", "--no-noise-scale"])
    except SystemExit as exit_:
        assert not exit_.code
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["throughput"]
    per_sample = summary["flops_per_sample"]
    assert len(records) == 3 and per_sample > 0
    for record in records:
        assert record["samples_per_second"] == pytest.approx(record["samples"] / record["seconds"], rel=1e-3)
        assert record["tokens_per_second"] == pytest.approx(16 * record["samples_per_second"], rel=1e-3)
        assert record["flops_per_second"] == pytest.approx(per_sample * record["samples_per_second"], rel=1e-3)
        assert record["mfu"] is None  # a CPU: no datasheet peak
    rates = sorted(r["tokens_per_second"] for r in records)
    assert summary["median_tokens_per_second"] == rates[1] and summary["median_mfu"] is None
    assert any("mfu null" in note for note in summary["notes"])
    assert "tokens/s" in capsys.readouterr().out
