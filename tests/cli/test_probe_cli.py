"""`reproduce probe` and `reproduce plan` without --micro-batch-max: through the real CLI, on tiny models."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import cli, cli_json
from reproduce.hardware.catalog import CONTEXT_BYTES, GPUS, lookup
from reproduce.plan.recipe import load_recipe
from reproduce.probe.runner import ProbeOptions
from reproduce.session import plan_and_probe

DIGITS = """\
batch: {effective: 2048, unit: samples}
task: classification
model: {builtin: mlp, kwargs: {hidden: 32}}
data: {builtin: digits}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 100}}
"""
OFFLINE_LM = """\
batch: {effective: 4096, unit: tokens, sequence_length: 32}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 32, vocab_size: 64}}
data: {name: a corpus we do not have, available: false}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 1000}}
"""
CPU = ("--meter", "cpu", "--memory", "256KiB")


@pytest.fixture(autouse=True)
def files(isolated, tmp_path):
    (tmp_path / "digits.yaml").write_text(DIGITS, encoding="utf-8")
    (tmp_path / "offline.yaml").write_text(OFFLINE_LM, encoding="utf-8")


def probe_json(capsys, *argv: str) -> dict:
    return cli_json(capsys, "probe", *argv)


def test_probe_json_reports_every_trial_and_the_bracket(capsys, tmp_path):
    result = probe_json(capsys, "digits.yaml", *CPU)
    assert result["meter"] == "cpu" and result["budget_bytes"] == 256 * 1024 and result["cached"] is False
    assert result["limit_bytes"] == int(256 * 1024 * 0.9) and result["cap"] == 2048
    trials = {t["micro_batch"]: t for t in result["trials"]}
    assert all({"micro_batch", "peak_bytes", "fits", "seconds"} <= set(t) for t in result["trials"])
    best = result["micro_batch_max"]
    assert trials[best]["fits"] and trials[best]["peak_bytes"] == result["peak_bytes"] <= result["limit_bytes"]
    assert not trials[best + 1]["fits"]
    assert result["plan"]["cost"]["exact"]["step_seconds"] > 0
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


def test_second_probe_comes_from_the_cache(capsys):
    first = probe_json(capsys, "digits.yaml", *CPU)
    again = probe_json(capsys, "digits.yaml", *CPU)
    assert again["cached"] is True and again["trials"] == first["trials"]
    assert probe_json(capsys, "digits.yaml", *CPU, "--no-cache")["cached"] is False
    other = probe_json(capsys, "digits.yaml", "--meter", "cpu", "--memory", "300KiB")
    assert other["cached"] is False and other["budget_bytes"] == 300 * 1024


def test_probe_shows_its_work(capsys):
    code, out, err = cli(capsys, "probe", "digits.yaml", *CPU)
    assert code == 0, err
    for expected in ("micro-batch", "fits", "fitted line: peak(b) =", "largest micro-batch:", "cost on cpu"):
        assert expected in out
    assert "trial micro-batch 2:" in err  # trials are shown as they run


@pytest.mark.parametrize(
    "args, expected",
    [
        (("--memory", "12XB"), "error: --memory: expected a memory size"),
        (("--gpu", "a1000"), "error: --gpu: unknown GPU 'a1000'"),
        (("--gpu", "t4", "--memory", "1GiB"), "error: --memory, --gpu: give one of them"),
        (("--memory", "1GiB", "--headroom", "1.5"), "error: --headroom: expected a fraction in [0, 1)"),
        (("--meter", "cpu"), "error: --meter cpu: needs a budget"),
        (("--meter", "tpu", "--memory", "1GiB"), "error: "),
        (("--meter", "estimate", "--memory", "16MiB"), "error: --memory: 16.00 MiB less headroom leaves nothing"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(capsys, args, expected):
    code, out, err = cli(capsys, "probe", "digits.yaml", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith(expected) and "Traceback" not in err
    assert sum(line.startswith("error: ") for line in lines) == 1


def test_nothing_fitting_is_exit_3_with_the_step_split_by_category(capsys):
    """The cpu meter stops at its budget; the report counts the same step on fake tensors to split it."""
    code, out, err = cli(capsys, "probe", "digits.yaml", "--meter", "cpu", "--memory", "16KiB")
    assert code == 3 and "Traceback" not in err
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("does not fit: not even micro-batch 1 fits"))
    assert "(cpu meter)" in lines[start] and "counted on the same step on fake tensors" in lines[start + 1]
    assert lines[start + 2].startswith("  weights ") and "3,466 parameters in fp32" in lines[start + 2]
    assert any("--sharding fsdp" in line for line in lines)


def test_plan_probes_when_no_micro_batch_max_is_given(capsys):
    code, out, err = cli(capsys, "plan", "digits.yaml", *CPU, "--json")
    assert code == 0, err
    summary = json.loads(out)
    probe = summary["probe"]
    assert summary["micro_batch_max"] == probe["micro_batch_max"] >= summary["micro_batch"]
    assert summary["micro_batch"] * summary["accumulation_steps"] == 2048
    exact = summary["cost"]["exact"]
    assert exact["step_seconds"] == pytest.approx(summary["accumulation_steps"] * exact["micro_step_seconds"])
    assert exact["total_seconds"] == pytest.approx(100 * exact["step_seconds"])


def test_plan_shows_the_cost(capsys):
    code, out, err = cli(capsys, "plan", "digits.yaml", *CPU)
    assert code == 0, err
    assert "cost on cpu (exact" in out and "100 steps:" in out
    assert err.startswith("probe: largest micro-batch")


def test_micro_batch_max_skips_the_probe(capsys, tmp_path):
    code, out, err = cli(capsys, "plan", "digits.yaml", "--micro-batch-max", "64", *CPU, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["micro_batch_max"] == 64 and "probe" not in summary
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the probe measures it")
def test_plan_without_a_budget_on_a_cpu_machine_asks_for_one(capsys):
    code, out, err = cli(capsys, "plan", "digits.yaml")
    assert code == 2 and err.startswith("error: --micro-batch-max: required") and len(err.splitlines()) == 1


def test_plan_for_a_gpu_we_do_not_have(capsys):
    """The estimate meter on synthetic tokens (the data is not here), for a T4's datasheet memory."""
    code, out, err = cli(capsys, "plan", "offline.yaml", "--gpu", "t4", "--json")
    assert code == 0, err
    probe = json.loads(out)["probe"]
    assert probe["meter"] == "estimate" and probe["gpu"] == "t4" and "synthetic" in probe["data"]
    assert probe["budget_bytes"] == 16 * 2**30 - CONTEXT_BYTES
    assert probe["micro_batch_max"] == probe["cap"] == 128  # a tiny model: the paper's batch fits at once
    assert json.loads(out)["cost"]["exact"] is None  # no real step, so no step time


def test_make_plan_probes_with_the_callers_data():
    """What `reproduce run` calls: plan_and_probe with probe options and the data it has already built."""
    from reproduce.data import build_data

    recipe = load_recipe("digits.yaml")
    data = build_data(recipe)
    options = ProbeOptions(memory="256KiB", meter="cpu")
    plan = plan_and_probe(recipe, "digits.yaml", None, 2, "exact", len(data.train), probe=options,
                              data=data).plan
    assert plan.world_size == 2 and plan.micro_batch * plan.accumulation_steps * 2 == 2048
    assert plan.micro_batch_max <= 1024  # capped at the per-rank batch
    assert plan.dataset_size == len(data.train)
    assert len(os.listdir(os.environ["REPRODUCE_CACHE_DIR"])) == 1


def test_catalog_names_and_sizes():
    assert lookup("A100_80GB") is GPUS["a100-80gb"] and lookup("RTX 4090") is GPUS["rtx4090"]
    assert GPUS["h100-80gb"].memory_bytes == 80 * 2**30 and GPUS["h100-80gb"].cublaslt_workspace == 32 * 2**20
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "rtx4090", "rtx3090", "v100-16gb", "v100-32gb",
            "t4", "l4", "a10g"} <= set(GPUS)
    assert all(gpu.source.startswith("https://") for gpu in GPUS.values())
