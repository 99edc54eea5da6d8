"""Throughput: trial rates, the timing of every exact split and the choice, from injected step times (no timing
asserted: `time_splits` is given a fake `run_steps`, so its rounds, re-timing, bound and choice are deterministic)."""

from __future__ import annotations

import json
import statistics

import pytest

from helpers import cli, cli_json
from reproduce.probe.runner import timed_trial
from reproduce.probe.search import Measurement
from reproduce.throughput.splits import (
    MAX_STEPS_PER_REPEAT,
    MIN_REPEATS,
    REPEATS,
    RETIME_ROUNDS,
    NotTimed,
    choose,
    exact_splits,
    model_micro_step,
    relative_spread,
    steps_per_repeat,
    time_splits,
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
    def rates(micro_batch, step_seconds, sequence_length):
        trial = timed_trial(Measurement(micro_batch, True, 1, step_seconds=step_seconds), sequence_length)
        return trial.samples_per_second, trial.tokens_per_second

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


class FakeSteps:
    """`run_steps` for time_splits: each call's seconds from `seconds(micro_batch, call)` per optimizer step (call
    counts every call, from 0), the calls recorded as (micro_batch, steps)."""

    def __init__(self, seconds, fail=()):
        self.seconds, self.fail, self.calls = seconds, set(fail), []

    def __call__(self, micro_batch, steps):
        if micro_batch in self.fail:
            raise NotTimed(f"out of memory on fake while timing {micro_batch}")
        call = len(self.calls)
        self.calls.append((micro_batch, steps))
        return steps * self.seconds(micro_batch, call)


def table(times):
    return FakeSteps(lambda m, call: times[m])


def test_every_split_warms_up_then_is_timed_in_rotated_rounds():
    steps = table({4: 1.0, 2: 0.8, 1: 1.5})
    timings = time_splits([4, 2, 1], steps)
    assert steps.calls[:3] == [(4, 1), (2, 1), (1, 1)]  # a warm-up step each, largest first
    rounds = [[m for m, _ in steps.calls[3 + 3 * r: 6 + 3 * r]] for r in range(REPEATS)]
    assert rounds[:3] == [[4, 2, 1], [2, 1, 4], [1, 4, 2]]  # every split once a round, the order rotated
    assert len(steps.calls) == 3 + 3 * REPEATS and timings.retimed is None  # 2 is 25% faster: no re-timing
    assert {m: t.repeats for m, t in timings.timed.items()} == {m: [s] * REPEATS for m, s in {4: 1.0, 2: 0.8,
                                                                                              1: 1.5}.items()}
    decision = choose([4, 2, 1], 4, {}, {}, None, timings=timings)
    assert decision.micro_batch == 2 and decision.indistinguishable is None
    assert "(+25.0% over micro-batch 4, paired over 5 rounds, beyond the noise of 3.0%)" in decision.reason


def test_a_busy_spell_slows_one_repeat_not_the_choice():
    true = {8: 1.0, 4: 0.85, 2: 0.95}
    busy = {5, 6}  # the calls of a second when another process took the core: 3x slower, whichever split ran
    steps = FakeSteps(lambda m, call: true[m] * (3 if call in busy else 1))
    timings = time_splits([8, 4, 2], steps)
    assert max(max(t.repeats) for t in timings.timed.values()) == pytest.approx(3 * 0.95)  # it was seen
    assert {m: t.median for m, t in timings.timed.items()} == pytest.approx(true)  # and the medians ignore it
    assert choose([8, 4, 2], 8, {}, {}, None, timings=timings).micro_batch == 4


def test_short_steps_are_timed_several_to_a_repeat():
    steps = table({2: 0.001, 1: 0.02})
    timings = time_splits([2, 1], steps)
    assert timings.timed[2].steps_per_repeat == MAX_STEPS_PER_REPEAT == steps_per_repeat(0.001)
    assert timings.timed[1].steps_per_repeat == steps_per_repeat(0.02) == 10
    assert (2, MAX_STEPS_PER_REPEAT) in steps.calls and (1, 10) in steps.calls
    assert timings.timed[2].repeats[0] == pytest.approx(0.001)  # a repeat is seconds per optimizer step
    assert steps_per_repeat(1.0) == 1


def test_the_top_two_within_their_spread_are_retimed_and_taken_larger_when_still_indistinguishable():
    steps = table({16: 1.0, 8: 0.99, 4: 2.0})  # 8 is 1% faster than 16: within the 3% floor
    timings = time_splits([16, 8, 4], steps)
    assert timings.retimed == (16, 8)
    assert len(timings.timed[16].repeats) == len(timings.timed[8].repeats) == REPEATS + RETIME_ROUNDS
    assert len(timings.timed[4].repeats) == REPEATS  # only the top two again
    assert len(steps.calls) == 3 + 3 * REPEATS + 2 * RETIME_ROUNDS
    decision = choose([16, 8, 4], 16, {}, {}, None, timings=timings)
    assert decision.micro_batch == 16 and decision.indistinguishable == [16, 8]
    assert decision.reason == ("micro-batch 16 and 8 are indistinguishable (8 faster by 1.0%, paired over 8 rounds, "
                               "within the noise of 3.0% after re-timing both): the larger micro-batch, 16")
    rows = {c.micro_batch: c for c in decision.candidates}
    assert rows[16].chosen and rows[8].share_of_best == 1 and rows[8].spread == 0.0


def test_retiming_can_separate_two_splits_a_noisy_round_had_made_look_alike():
    noisy = iter([1.10, 1.25, 0.95, 1.10, 1.30])  # 32's first repeats spread 27%: within it, 16's 10% lead
    steps = FakeSteps(lambda m, call: 1.0 if m == 16 else (1.10 if call < 2 else next(noisy, 1.10)))
    timings = time_splits([32, 16], steps)
    assert timings.retimed == (32, 16) and timings.timed[32].spread == pytest.approx(0.0)  # steady on re-timing
    decision = choose([32, 16], 32, {}, {}, None, timings=timings)
    assert decision.micro_batch == 16 and decision.indistinguishable is None
    assert "beyond the noise of 3.0% after re-timing both" in decision.reason


def test_a_third_split_the_re_timing_left_second_is_compared_on_the_rounds_both_ran():
    seconds = {64: iter([1.02] * 6), 32: iter([1.0, 0.98, 0.99, 1.0, 1.03, 1.04] + [1.05] * 3),
               16: iter([1.01] * 6 + [1.05] * 3)}  # warm-up, 5 rounds, then a busy re-timing of 32 and 16
    timings = time_splits([64, 32, 16], FakeSteps(lambda m, call: next(seconds[m])))
    assert timings.retimed == (32, 16) and timings.timed[32].median == pytest.approx(1.035)  # now behind 64
    decision = choose([64, 32, 16], 64, {}, {}, None, timings=timings)
    assert decision.micro_batch == 64 and decision.indistinguishable == [64, 16]
    assert decision.reason == ("micro-batch 64 and 16 are indistinguishable (16 faster by 1.0%, paired over 5 rounds, "
                               "within the noise of 3.0%; 32 and 16 re-timed): the larger micro-batch, 64")


def test_pairing_by_round_cancels_the_load_both_splits_saw():
    load = [1.0, 1.0, 1.3, 0.9, 1.6, 1.1]  # the machine's load factor: warm-ups, then one per round of two calls
    steps = FakeSteps(lambda m, call: (1.0 if m == 8 else 1.08) * load[min(call // 2, 5)])  # 16 is 8% slower
    timings = time_splits([16, 8], steps)
    assert timings.timed[8].spread > 0.3 and timings.retimed is None  # a wide spread, yet no doubt round by round
    decision = choose([16, 8], 16, {}, {}, None, timings=timings)
    assert decision.micro_batch == 8 and "+8.0% over micro-batch 16" in decision.reason


def test_the_cost_is_bounded_and_stated_per_split():
    steps = table({8: 1.0, 4: 1.1, 2: 1.5, 1: 3.0})
    timings = time_splits([8, 4, 2, 1], steps, budget=20)
    assert sorted(timings.timed) == [4, 8] and sorted(timings.left_out) == [1, 2]  # the slowest warm-ups left out
    assert "slowest" in timings.left_out[1] and timings.rounds == MIN_REPEATS
    assert timings.seconds == pytest.approx(sum(n * steps.seconds(m, 0) for m, n in steps.calls))  # every step
    assert timings.seconds <= 20
    cost = timings.cost()
    assert cost["bound_seconds"] == 20 and not cost["over_bound"] and cost["rounds"] == MIN_REPEATS
    assert cost["per_split_seconds"] == [pytest.approx(1.0 * (1 + MIN_REPEATS)), pytest.approx(1.1 * 4)]
    assert {m: t.seconds for m, t in timings.timed.items()} == pytest.approx({8: 4.0, 4: 4.4})
    decision = choose([8, 4, 2, 1], 8, {}, {}, None, timings=timings)
    assert decision.cost == cost and all(c.timing_seconds for c in decision.candidates)
    generous = time_splits([8, 4, 2, 1], table({8: 1.0, 4: 1.1, 2: 1.5, 1: 3.0}))
    assert sorted(generous.timed) == [1, 2, 4, 8] and generous.rounds == REPEATS


def test_warm_ups_stop_at_their_share_and_a_bound_too_small_says_so():
    timings = time_splits([8, 4, 2, 1], table({8: 1.0, 4: 1.5, 2: 2.0, 1: 3.0}), budget=4)
    assert sorted(timings.timed) == [4, 8] and "warm-up steps had taken 2.5 s of the 4 s bound" in timings.left_out[2]
    assert timings.rounds == MIN_REPEATS and timings.cost()["over_bound"]  # never fewer than 3 repeats of two


def test_a_split_out_of_memory_is_left_out_with_its_reason():
    timings = time_splits([8, 4, 2], FakeSteps(lambda m, call: {8: 1.0, 4: 0.9, 2: 1.2}[m], fail={8}))
    assert sorted(timings.timed) == [2, 4] and "out of memory" in timings.left_out[8]
    assert choose([8, 4, 2], 8, {}, {}, None, timings=timings).micro_batch == 4


def test_choice_from_step_times():
    decision = choose([32, 16, 8], 64, {32: 0.80, 16: 0.40, 8: 0.72}, {32: "model"}, sequence_length=10)
    assert (decision.micro_batch, decision.accumulation_steps) == (16, 4)
    rows = {c.micro_batch: c for c in decision.candidates}
    assert rows[16].chosen and rows[16].share_of_best == 1
    assert rows[32].samples_per_second == pytest.approx(80) and rows[32].micro_step_seconds == pytest.approx(0.4)
    assert rows[8].share_of_best == pytest.approx(0.40 / 0.72)
    assert rows[16].tokens_per_second == pytest.approx(1600) and rows[32].source == "model"
    assert "the most samples per second" in decision.reason
    tie = choose([32, 16], 64, {32: 0.32, 16: 0.316}, {}, None)  # 16 is 1.3% faster: within a 3% floor
    assert tie.micro_batch == 32 and "indistinguishable" in tie.reason and tie.indistinguishable == [32, 16]
    clear = choose([32, 16], 64, {32: 0.32, 16: 0.30}, {}, None)  # 6.7% faster: beyond the floor
    assert clear.micro_batch == 16 and clear.noise == 0.03


def test_batchnorm_keeps_the_papers_per_device_batch():
    decision = choose([64, 32, 16], 64, {64: 0.5, 32: 0.4, 16: 0.8}, {}, None, batchnorm_micro_batch=16)
    assert decision.micro_batch == 16 and decision.accumulation_steps == 4
    assert "BatchNorm" in decision.reason and "50% of the best rate" in decision.reason
    assert "by throughput alone: 32" in decision.reason


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
    assert len(candidates) == decision["exact_splits"] == len(exact_splits(128, summary["micro_batch_max"]))
    assert sum(c["chosen"] for c in candidates) == 1 and decision["reason"]
    for c in candidates:  # every split timed in whole optimizer steps, at least three repeats, its spread kept
        assert 128 % c["micro_batch"] == 0 and c["micro_batch"] <= summary["micro_batch_max"]
        assert c["source"] == "timed" and len(c["repeats"]) >= 3 and c["spread"] >= 0 and c["timing_seconds"] > 0
        assert c["step_seconds"] == pytest.approx(statistics.median(c["repeats"]), rel=1e-4, abs=1e-6)
        assert c["step_seconds"] == pytest.approx(c["accumulation_steps"] * c["micro_step_seconds"])
        assert c["samples_per_second"] == pytest.approx(128 / c["step_seconds"])
    assert max(c["share_of_best"] for c in candidates) == 1
    cost = decision["cost"]
    assert cost["seconds"] >= sum(c["timing_seconds"] for c in candidates) - 1e-3 and cost["bound_seconds"] == 60
    assert cost["per_split_seconds"] == [pytest.approx(min(c["timing_seconds"] for c in candidates), abs=1e-3),
                                         pytest.approx(max(c["timing_seconds"] for c in candidates), abs=1e-3)]
    assert summary["cost"]["throughput"]["micro_batch"] == summary["micro_batch"]
    chosen = next(c for c in candidates if c["chosen"])
    assert summary["cost"]["throughput"]["step_seconds"] == pytest.approx(chosen["step_seconds"], rel=1e-3)
    code, out, err = cli(capsys, "plan", "gpt.yaml", "--meter", "cpu", "--memory", "2MiB", "--policy", "throughput")
    assert code == 0 and "--policy throughput (measured on cpu)" in out and "throughput: micro-batch" in out
    assert "cost of choosing: " in out and "s each: a warm-up step" in out and "bound 60 s" in out
    assert "spread" in out and "timing s" in out


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
    from reproduce.plan.planfile import load_plan

    saved = load_plan(tmp_path / "out" / "plan.yaml")
    assert saved.policy == "throughput" and saved.throughput.micro_batch == saved.micro_batch
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


@pytest.mark.slow  # 14 s of timing; the rule is test_batchnorm_keeps_the_papers_per_device_batch's, the timed plan
# through the CLI test_plan_policy_throughput_times_exact_splits_and_says_why's
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
