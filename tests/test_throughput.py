"""Throughput: trial rates, the search over exact splits and the choice, from fixed timings (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from helpers import cli, cli_json
from reproduce.throughput import (
    MAX_TIMED,
    choose,
    exact_splits,
    model_micro_step,
    next_size,
    rates,
    relative_spread,
)

GPT = """\
batch: {effective: 4096, unit: tokens, sequence_length: 32, devices: 1, per_device: 128}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 32, vocab_size: 64}}
data: {name: a corpus we do not have, available: false}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 10}}
"""
LOCAL_GPT = """\
batch: {effective: 512, unit: tokens, sequence_length: 16}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 1, heads: 2, dim: 16}}
data: {builtin: pysource}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 3}}
"""


@pytest.fixture(autouse=True)
def files(isolated, tmp_path):
    (tmp_path / "gpt.yaml").write_text(GPT, encoding="utf-8")


def test_rates_are_the_micro_batch_over_the_step():
    assert rates(8, 0.5, None) == (16.0, None)
    assert rates(8, 0.5, 32) == (16.0, 512.0)
    assert rates(8, None, 32) == (None, None)


def test_probe_json_trials_carry_their_rates(capsys):
    code, out, err = cli(capsys, "probe", "gpt.yaml", "--meter", "cpu", "--memory", "2MiB", "--json")
    assert code == 0, err
    result = json.loads(out)
    fitting = [t for t in result["trials"] if t["fits"]]
    assert fitting and all(t["step_seconds"] > 0 for t in fitting)
    for trial in fitting:
        assert trial["samples_per_second"] == pytest.approx(trial["micro_batch"] / trial["step_seconds"], rel=1e-3)
        assert trial["tokens_per_second"] == pytest.approx(32 * trial["samples_per_second"], rel=1e-3)
    assert all(t["samples_per_second"] is None for t in result["trials"] if not t["fits"])
    code, out, err = cli(capsys, "probe", "gpt.yaml", "--meter", "cpu", "--memory", "2MiB")
    assert "samples/s" in out and "tokens/s" in out


def test_exact_splits_divide_the_per_rank_batch_largest_first():
    assert exact_splits(64, 40) == [32, 16, 8, 4, 2, 1]
    assert exact_splits(12, 100) == [12, 6, 4, 3, 2, 1]
    assert exact_splits(7, 5) == [1]


def search(splits, seconds, timed=None, noise=0.03):
    """Run the search against fixed micro-step times; return the sizes it timed, in order."""
    timed, order = dict(timed or {}), []
    while (size := next_size(splits, timed, noise)) is not None:
        assert size in splits and size not in timed  # never times a size twice
        order.append(size)
        timed[size] = seconds[size]
    return order, timed


def test_search_stops_when_halving_is_no_faster():
    flat = {m: 0.01 * m for m in (32, 16, 8, 4, 2, 1)}  # every split runs at the same rate
    order, _ = search([32, 16, 8, 4, 2, 1], flat)
    assert order == [32, 16]


def test_search_follows_a_faster_smaller_size_and_is_bounded():
    faster_small = {m: 0.01 * m * (1 + m / 64) for m in (64, 32, 16, 8, 4, 2, 1)}  # smaller is always faster
    order, _ = search([64, 32, 16, 8, 4, 2, 1], faster_small)
    assert order == [64, 32, 16, 8][:MAX_TIMED]


def test_search_reuses_the_probes_timings():
    seconds = {m: 0.01 * m for m in (32, 16, 8, 4, 2, 1)}
    order, _ = search([32, 16, 8, 4, 2, 1], seconds, timed={32: 0.32, 2: 0.02})
    assert order == [16]


def test_choice_takes_the_most_samples_per_second():
    decision = choose([32, 16, 8], 64, {32: 0.40, 16: 0.10, 8: 0.09}, {32: "probe trial"}, sequence_length=10)
    assert (decision.micro_batch, decision.accumulation_steps) == (16, 4)
    rows = {c.micro_batch: c for c in decision.candidates}
    assert rows[16].chosen and rows[16].share_of_best == 1
    assert rows[32].samples_per_second == pytest.approx(80) and rows[32].step_seconds == pytest.approx(0.8)
    assert rows[8].share_of_best == pytest.approx((8 / 0.09) / 160)
    assert rows[16].tokens_per_second == pytest.approx(1600) and rows[32].source == "probe trial"
    assert "the most samples per second" in decision.reason


def test_ties_within_the_noise_go_to_the_larger_micro_batch():
    timed = {32: 0.32, 16: 0.158}  # 16 is 1.3% faster: within a 3% floor
    decision = choose([32, 16], 64, timed, {}, None)
    assert decision.micro_batch == 32 and "ties go to the larger micro-batch" in decision.reason
    noisy = choose([32, 16], 64, {32: 0.32, 16: 0.15}, {}, None, noise=0.10)  # 6.7% faster, 10% noise
    assert noisy.micro_batch == 32
    clear = choose([32, 16], 64, {32: 0.32, 16: 0.15}, {}, None, noise=0.01)
    assert clear.micro_batch == 16


def test_batchnorm_keeps_the_papers_per_device_batch():
    decision = choose([64, 32, 16], 64, {64: 0.5, 32: 0.2, 16: 0.2}, {}, None, batchnorm_micro_batch=16)
    assert decision.micro_batch == 16 and decision.accumulation_steps == 4
    assert "BatchNorm" in decision.reason and "by throughput alone: 32" in decision.reason


def test_nothing_to_choose_is_said():
    assert "only micro-batch 1 fits" in choose([1], 64, {1: 0.1}, {}, None, micro_batch_max=1).reason
    assert "one exact split" in choose([7], 7, {7: 0.1}, {}, None, micro_batch_max=9).reason
    untimed = choose([1], 64, {}, {}, None, micro_batch_max=1)
    assert untimed.micro_batch == 1 and untimed.candidates == [] and "only micro-batch 1 fits" in untimed.reason


def test_relative_spread():
    assert relative_spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert relative_spread([1.0, 1.02, 0.98, 1.0, 5.0]) == pytest.approx(0.04)  # one slowed repeat does not count
    assert relative_spread([1.0]) == 0.0


def plan_json(capsys, *argv: str) -> dict:
    return cli_json(capsys, "plan", *argv)


def test_plan_policy_throughput_times_exact_splits_and_says_why(capsys):
    summary = plan_json(capsys, "gpt.yaml", "--meter", "cpu", "--memory", "2MiB", "--policy", "throughput")
    decision = summary["throughput"]
    assert summary["policy"] == "throughput" and summary["exact"] is True
    assert summary["micro_batch"] == decision["micro_batch"] and summary["accumulation_steps"] == decision[
        "accumulation_steps"]
    assert summary["micro_batch"] * summary["accumulation_steps"] == 128  # 4096 tokens / 32
    candidates = decision["candidates"]
    probed = {t["micro_batch"] for t in summary["probe"]["trials"] if t["fits"] and t["step_seconds"]}
    assert 1 < len(candidates) < decision["exact_splits"]  # a few, not every split
    assert sum(c["chosen"] for c in candidates) == 1 and decision["reason"]
    for c in candidates:
        assert 128 % c["micro_batch"] == 0 and c["micro_batch"] <= summary["micro_batch_max"]
        assert c["step_seconds"] == pytest.approx(c["accumulation_steps"] * c["micro_step_seconds"])
        assert c["samples_per_second"] == pytest.approx(128 / c["step_seconds"])
        assert c["source"] == ("probe trial" if c["micro_batch"] in probed else "timed")
    assert max(c["share_of_best"] for c in candidates) == 1
    code, out, err = cli(capsys, "plan", "gpt.yaml", "--meter", "cpu", "--memory", "2MiB", "--policy", "throughput")
    assert code == 0 and "--policy throughput (measured on cpu)" in out and "throughput: micro-batch" in out


def test_estimate_meter_lets_the_flops_model_decide(capsys):
    summary = plan_json(capsys, "gpt.yaml", "--gpu", "a100-80gb", "--policy", "throughput")
    decision = summary["throughput"]
    assert decision["basis"] == "model" and "a model, not a measurement" in decision["reason"]
    assert all(c["source"] == "model" for c in decision["candidates"])
    assert summary["micro_batch"] == max(exact_splits(128, summary["micro_batch_max"]))  # larger is never slower


def test_without_a_probe_the_gpu_named_gets_the_model(capsys):
    summary = plan_json(capsys, "gpt.yaml", "--micro-batch-max", "64", "--gpu", "a100-80gb", "--policy", "throughput")
    assert summary["throughput"]["basis"] == "model" and summary["micro_batch"] == 64 and "probe" not in summary


def test_the_model_reads_the_weights_once_per_micro_step():
    """Compute-bound: seconds in proportion to m; memory-bound (small m): the weights' read time, the same for
    every m, so a smaller micro-batch is never faster per sample."""
    flops, peak, mfu, weights, bandwidth = 1e9, 1e12, 0.5, 3e8, 1e11  # 2 ms per sample; 9 ms to read the weights
    assert model_micro_step(64, flops, peak, mfu, weights, bandwidth) == pytest.approx(64 * 2e-3)
    assert model_micro_step(1, flops, peak, mfu, weights, bandwidth) == pytest.approx(9e-3)
    assert model_micro_step(1, flops, peak, mfu) == pytest.approx(2e-3)  # no bandwidth known: compute only
    per_sample = [model_micro_step(m, flops, peak, mfu, weights, bandwidth) / m for m in (1, 2, 4, 8, 64)]
    assert per_sample == sorted(per_sample, reverse=True)


def test_nothing_to_choose_times_nothing(capsys):
    only_one = plan_json(capsys, "gpt.yaml", "--micro-batch-max", "1", "--policy", "throughput")
    assert only_one["micro_batch"] == 1 and only_one["throughput"]["candidates"] == []
    assert only_one["throughput"]["reason"] == "only micro-batch 1 fits: nothing to choose"
    one_split = plan_json(capsys, "gpt.yaml", "--micro-batch-max", "4", "--world-size", "128", "--policy", "throughput")
    assert one_split["throughput"]["reason"].startswith("one exact split (1 x 1)")  # one sequence per process


def test_run_with_policy_throughput_keeps_the_choice_and_logs_tokens_per_second(tmp_path, capsys):
    (tmp_path / "local.yaml").write_text(LOCAL_GPT, encoding="utf-8")
    code, out, err = cli(capsys, "run", "local.yaml", "--micro-batch-max", "16", "--policy", "throughput",
                         "--max-steps", "2", "--out", "out", "--no-noise-scale")
    assert code == 0, err
    from reproduce.planfile import load_plan

    saved = load_plan(tmp_path / "out" / "plan.yaml")
    assert saved.policy == "throughput" and saved.throughput["micro_batch"] == saved.micro_batch
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_second"] > 0 and r["micro_batch"] == saved.micro_batch for r in records)
    assert "--policy throughput: " in out


BATCHNORM = """\
batch: {effective: 64, unit: samples, devices: 4, per_device: 16}
task: classification
model: {builtin: cnn-bn, norm_layers: [batchnorm], kwargs: {channels: 4}}
data: {builtin: digits}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
schedule: {total: {steps: 10}}
"""


def test_batchnorm_keeps_the_per_device_batch_unless_freed(tmp_path, capsys):
    (tmp_path / "bn.yaml").write_text(BATCHNORM, encoding="utf-8")
    kept = plan_json(capsys, "bn.yaml", "--micro-batch-max", "64", "--policy", "throughput")
    assert kept["micro_batch"] == 16 and kept["accumulation_steps"] == 4 and kept["batchnorm"] is None
    assert kept["throughput"]["candidates"]  # still timed, so the cost of keeping it is seen
    if kept["throughput"]["reason"].startswith("micro-batch 16: the paper's per-device batch"):
        assert "kept for BatchNorm" in kept["throughput"]["reason"]
    freed = plan_json(capsys, "bn.yaml", "--micro-batch-max", "64", "--policy", "throughput", "--free-batchnorm")
    assert freed["micro_batch"] == freed["throughput"]["micro_batch"]
    assert "kept for BatchNorm" not in freed["throughput"]["reason"]
    if freed["micro_batch"] != 16:  # the plan's own BatchNorm warning, and the decision's, say so
        assert freed["batchnorm"] and "not the paper's 16" in freed["throughput"]["reason"]


def test_throughput_under_the_launcher_is_refused_before_launching(tmp_path, capsys):
    (tmp_path / "local.yaml").write_text(LOCAL_GPT, encoding="utf-8")
    code, out, err = cli(capsys, "run", "local.yaml", "--policy", "throughput", "--nproc-per-node", "2",
                         "--micro-batch-max", "4", "--out", "out", "--device", "cpu")
    assert code == 2 and "launching" not in out and "plan first" in err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
