"""The gradient noise scale measured during `reproduce run` (observe/noise.py), against its definition.

With the weights held fixed (learning rate 0), the run's estimate must agree with tr(Sigma) / |G|^2 computed from
the exact per-item gradients of the whole training set (`torch.func`), for a classifier and a language model; one
window's raw estimates must be exactly the paper's formulas applied to its micro-batch gradients; and measuring it
must never change the weights.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.func import functional_call, grad, vmap

from helpers import SGD, digits_recipe, lm_recipe, reproduce_run
from reproduce.cli import main
from reproduce.data import build_data
from reproduce.data.batches import LazyMicroBatch, fetch
from reproduce.observe.noise import NoiseScale, estimates, summarise
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.setup import build
from reproduce.train.step import optimizer_step
from reproduce.train.trainer import RunRequest, read_metrics, train
from reproduce.train.windows import window

DIGITS = {  # the built-in MLP on the digits, 256 a step in micro-batches of 32
    "batch": {"effective": 256}, "task": "classification", "model": {"builtin": "mlp"},
    "data": {"builtin": "digits", "shuffle": True}, "optimizer": {"name": "sgd", "lr": 0.1},
    "schedule": {"total": {"steps": 1000}},
}
SEQUENCE = 32
PYSOURCE = {  # the built-in GPT (one small layer) on ~1,800 windows of the standard library's own source
    "batch": {"effective": 64 * SEQUENCE, "unit": "tokens", "sequence_length": SEQUENCE},
    "task": "language-modeling",
    "model": {"builtin": "gpt", "kwargs": {"layers": 1, "heads": 2, "dim": 32}},
    "data": {"builtin": "pysource", "kwargs": {"max_bytes": 60_000, "validation_every": 3}, "shuffle": True},
    "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 1000}},
}


def frozen_run(recipe_data: dict, micro_batch: int, steps: int, dtype: torch.dtype = torch.float64):
    """`steps` optimizer steps of the run's own step machinery with the learning rate at 0: the weights stay
    fixed (checked bitwise), so every window samples the same gradient distribution."""
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=micro_batch, dataset_size=len(data.train))
    setup = build(plan, torch.device("cpu"), dtype, data=data)
    for group in setup.optimizer.param_groups:
        group["lr"] = 0.0
    setup.scheduler.base_lrs = [0.0] * len(setup.scheduler.base_lrs)
    before = {k: v.clone() for k, v in setup.unwrapped_model.state_dict().items()}
    noise = NoiseScale(setup)
    records = []
    for step in range(steps):
        indices, _ = window(plan, len(data.train), step, recipe.seed)
        micro_batches = [LazyMicroBatch(data.train, i, setup.device, setup.dtype) for i in indices]
        records.append(optimizer_step(setup, micro_batches, noise).noise)
    assert all(torch.equal(before[k], v) for k, v in setup.unwrapped_model.state_dict().items())
    return setup.unwrapped_model, data.train, records


def definition(model: torch.nn.Module, dataset, loss_of, chunk: int = 64) -> tuple[float, float]:
    """|G|^2 and tr(Sigma) over the whole training set from its exact per-item gradients (torch.func):
    G their mean, tr(Sigma) their variance summed over every parameter (divided by n - 1)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    per_item = vmap(grad(lambda p, x, y: loss_of(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))),
                    in_dims=(None, 0, 0))
    total, squares, n = 0.0, 0.0, len(dataset)
    for start in range(0, n, chunk):
        inputs, targets = fetch(dataset, torch.arange(start, min(start + chunk, n)))
        inputs = inputs.to(next(model.parameters()).dtype) if inputs.is_floating_point() else inputs
        flat = torch.cat([g.flatten(1) for g in per_item(params, inputs, targets).values()], dim=1).double()
        total = total + flat.sum(0)
        squares += float((flat**2).sum())
    mean = total / n
    grad_sq = float(mean @ mean)
    return grad_sq, (squares - n * grad_sq) / (n - 1)


def test_estimate_agrees_with_the_definition_for_a_classifier():
    model, dataset, records = frozen_run(DIGITS, micro_batch=32, steps=100)
    grad_sq, trace = definition(model, dataset, F.cross_entropy)
    exact = trace / grad_sq
    assert 50 < exact < 500  # a noise scale near the batch (256): where the estimate matters
    assert records[-1]["noise_scale"] == pytest.approx(exact, rel=0.15)  # the run's smoothed estimate
    # each window's two estimates are unbiased: their means over the 100 windows land close to the truth
    assert sum(r["noise_trace"] for r in records) / len(records) == pytest.approx(trace, rel=0.05)
    assert sum(r["noise_grad_sq"] for r in records) / len(records) == pytest.approx(grad_sq, rel=0.08)


def test_estimate_agrees_with_the_definition_for_a_language_model_in_tokens():
    """Items are tokens, drawn in sequences of 32: the definition's items are the sequences the run samples (the
    per-sequence gradient of its mean token loss), and the noise scale is counted in tokens (x 32)."""
    model, dataset, records = frozen_run(PYSOURCE, micro_batch=8, steps=60, dtype=torch.float32)

    def sequence_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    grad_sq, trace = definition(model, dataset, sequence_loss)
    exact = SEQUENCE * trace / grad_sq
    assert records[-1]["noise_b_small"] == 64 * SEQUENCE / 5  # in tokens: 8 micro-batches make 5 groups
    assert records[-1]["noise_scale"] == pytest.approx(exact, rel=0.15)
    assert sum(r["noise_trace"] for r in records) / len(records) == pytest.approx(SEQUENCE * trace, rel=0.08)


def micro_batch_gradients(model, micro_batches, loss_fn) -> tuple[list[torch.Tensor], list[int]]:
    """Each micro-batch's summed-loss gradient (flattened), and its loss-bearing items, by plain autograd."""
    gradients, counts = [], []
    for inputs, target in micro_batches:
        model.zero_grad()
        loss_fn(model(inputs), target).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
        counts.append(loss_fn.count(target))
    return gradients, counts


def window_estimates(model, loss_fn, ranks: list[list], population: float) -> dict:
    """What one window's record must hold, from plain autograd on each rank's micro-batches: the first half of a
    rank's micro-batches is one group, each of the last half a group of its own (observe/noise.py, HOOKED_SHARE)."""
    groups = []
    for micro_batches in ranks:
        gradients, counts = micro_batch_gradients(model, micro_batches, loss_fn)
        first = len(gradients) - max(1, len(gradients) // 2)
        if first:
            groups.append((sum(gradients[:first]), sum(counts[:first])))
        groups += list(zip(gradients[first:], counts[first:], strict=True))
    b_big = sum(b for _, b in groups)
    big = sum(g for g, _ in groups) / b_big
    small_sq = sum(b / b_big * float((g / b).square().sum()) for g, b in groups)  # B_small = B_big / K
    grad_sq, trace = estimates(small_sq, float(big.square().sum()), b_big / len(groups), b_big, population)
    # the trace estimate is the items-weighted variance of the groups' gradients: never negative
    weighted = sum(b / b_big * float((g / b - big).square().sum()) for g, b in groups)
    assert trace == pytest.approx(weighted * b_big / (len(groups) - 1), rel=1e-9)
    return {"items": b_big, "groups": [b for _, b in groups], "noise_b_small": b_big / len(groups),
            "noise_grad_sq": grad_sq, "noise_trace": trace}


@pytest.mark.parametrize("case", ["tokens-of-different-lengths", "partial-window"])
def test_one_window_is_exactly_the_formulas_on_its_micro_batches(case, tmp_path):
    if case == "tokens-of-different-lengths":  # micro-batches carry different token counts, some -100 targets
        recipe_data, micro, step = lm_recipe(SGD, effective=16, steps=1), 4, 0
    else:  # 1,437 digits in windows of 512: the third holds 413, in micro-batches of 128, 128, 128 and 29
        recipe_data, micro, step = digits_recipe(SGD, effective=512, steps=3, data={"drop_last": False}), 128, 2
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "run", device="cpu"), dtype=torch.float64, data=data)
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[step]

    setup = build(plan, torch.device("cpu"), torch.float64, data=data)  # the weights before the run
    for past in range(step):
        indices, _ = window(plan, len(data.train), past, recipe.seed)
        optimizer_step(setup, [LazyMicroBatch(data.train, i, setup.device, setup.dtype) for i in indices])
    indices, _ = window(plan, len(data.train), step, recipe.seed)
    loads = [LazyMicroBatch(data.train, i, setup.device, setup.dtype).load() for i in indices]
    items_per_sample = record["items"] / sum(len(i) for i in indices)
    expected = window_estimates(setup.unwrapped_model, setup.loss, [loads], len(data.train) * items_per_sample)
    assert len(expected["groups"]) == 3 and len(set(expected["groups"])) > 1  # groups of different sizes
    assert record["items"] == expected["items"]
    for key in ("noise_b_small", "noise_trace", "noise_grad_sq"):
        assert record[key] == pytest.approx(expected[key], rel=1e-9), key


def test_measuring_never_changes_the_weights(tmp_path):
    recipe = parse_recipe(digits_recipe({"name": "adamw", "lr": 3e-3}, steps=12, data={"shuffle": True}))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "on", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "off", device="cpu", no_noise_scale=True), data=data)
    on = torch.load(tmp_path / "on" / "model.pt", weights_only=True)
    off = torch.load(tmp_path / "off" / "model.pt", weights_only=True)
    assert all(torch.equal(on[k], off[k]) for k in on)
    with_noise, without = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("on", "off"))
    assert [(r["loss"], r["grad_norm"]) for r in with_noise] == [(r["loss"], r["grad_norm"]) for r in without]
    assert all("noise_trace" in r for r in with_noise)  # measured at every step
    assert not any(key.startswith("noise") for r in without for key in r)
    summary_off = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert "noise_scale" not in summary_off


def test_fp16_scaled_gradients_are_measured_unscaled(tmp_path):
    """Under fp16 the micro-batch norms are taken on gradients scaled by GradScaler (65536 at first)."""
    results = {}
    for precision in ("fp32", "fp16"):
        recipe = parse_recipe(digits_recipe(SGD, steps=1, precision=precision))
        data = build_data(recipe)
        plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
        train(plan, RunRequest(tmp_path / precision, device="cpu"), data=data)
        results[precision] = read_metrics(tmp_path / precision / "metrics.jsonl")[0]
    for key in ("noise_trace", "noise_grad_sq"):
        assert results["fp16"][key] == pytest.approx(results["fp32"][key], rel=0.02)


def test_skipped_nonfinite_steps_leave_the_estimate_alone(tmp_path):
    recipe = parse_recipe(digits_recipe({"name": "sgd", "lr": 1e30}, steps=6))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu", skip_nonfinite=True), data=data)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    skipped = [r for r in records if r["skipped"]]
    assert summary["skipped_nonfinite"] == len(skipped) >= 3 and not records[0]["skipped"]
    assert not any("noise_trace" in r for r in skipped)
    kept = [r["noise_scale"] for r in records if "noise_scale" in r]
    assert kept and all(value == kept[0] for value in kept)  # one measured step; the skipped ones change nothing
    assert all(math.isfinite(value) for value in kept)


def test_resume_continues_the_average(tmp_path):
    recipe = parse_recipe(digits_recipe(SGD, steps=8, data={"shuffle": True}))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=3), data=data)
    split = train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    noise_of = lambda name: [(r.get("noise_scale"), r["noise_trace"], r["noise_grad_sq"])  # noqa: E731
                             for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    assert noise_of("split") == noise_of("full")
    assert split["noise_scale"] == full["noise_scale"]  # the last tenth read back from metrics.jsonl, both halves


def test_run_reports_it_and_check_thresholds_it(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", str(out), "--max-steps", "20"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())["noise_scale"]
    assert summary["unit"] == "samples" and summary["effective_batch"] == 256
    assert summary["small_batch"] == 256 / 5  # 32 x 8: the first 4 micro-batches one group, the last 4 one each
    assert summary["measured_steps"] == 20 and summary["last_tenth_steps"] == [19, 20]
    assert summary["final"] == read_metrics(out / "metrics.jsonl")[-1]["noise_scale"] > 0
    line = next(line for line in printed.splitlines() if line.startswith("noise scale: "))
    assert line == f"noise scale: {summary['sentence']}"
    assert line.startswith("noise scale: the effective batch 256 samples is ") and "McCandlish et al. 2018" in line

    final = summary["final"]
    check = tmp_path / "checks.yaml"
    check.write_text(yaml.safe_dump({
        "recipe": "papers/digits-mlp.yaml",
        "budget": {"micro_batch_max": 32, "max_steps": 20},
        "runs": {"single": {"budget": {"micro_batch_max": 256}}},  # one micro-batch a step: nothing to measure
        "checks": [
            {"kind": "metric", "metric": "noise_scale", "min": final / 2, "max": final * 2},
            {"kind": "metric", "metric": "noise_scale", "max": final / 2, "name": "too small"},
            {"kind": "metric", "metric": "noise_scale.last_tenth", "min": 1},
            {"kind": "metric", "metric": "noise_scale", "run": "single", "min": 1},
        ],
    }))
    with pytest.raises(SystemExit) as exit_info:
        main(["check", str(check), "--work", str(tmp_path / "work")])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 1
    rows = {line.split("│")[2].strip(): line.split("│")[3].strip() for line in printed.splitlines()
            if line.count("│") > 4 and "checks.yaml" in line}
    assert rows == {"noise_scale": "pass", "too small": "FAIL", "noise_scale.last_tenth": "pass",
                    "noise_scale (single)": "ERROR"}
    assert "metric 'noise_scale': not measured in this run: one micro-batch per optimizer step" in printed


def test_one_micro_batch_on_one_process_says_so_once(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "256", "--out", str(out), "--max-steps", "3"])
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    said = "noise scale not measured: one micro-batch per optimizer step on one process"
    assert captured.err.count(said) == 1 and "noise scale" not in captured.out
    assert not any(key.startswith("noise") for r in read_metrics(out / "metrics.jsonl") for key in r)
    summary = json.loads((out / "summary.json").read_text())["noise_scale"]
    assert summary["measured_steps"] == 0 and summary["noted"] and "final" not in summary
    assert summary["sentence"] == f"not measured: {summary['reason']}"


def test_summary_of_an_unresolved_gradient_says_so():
    """Late in a run that has fit its training set, |G|^2 sinks below what the batch resolves."""
    records = [{"step": s, "loss": 0.01, "items": 256, "noise_grad_sq": (-1) ** s * 1e-3 - 1e-4,
                "noise_trace": 0.5, "noise_b_small": 32.0} for s in range(1, 21)]
    summary = summarise(records, 20, "classification")
    assert summary["last_tenth"] is None and summary["final"] is None
    assert summary["sentence"].startswith("not resolved") and "far above the effective batch 256 samples" in \
        summary["sentence"]


def test_the_formulas_recover_what_they_estimate():
    """Fed the expected squared norms of batches drawn without replacement from n items, E|G_B|^2 = |G|^2 +
    tr(Sigma) (1/B - 1/n), the estimates return |G|^2 and tr(Sigma) exactly; without n they are the paper's."""
    grad_sq, trace, n = 0.3, 40.0, 1000
    expected = lambda b: grad_sq + trace * (1 / b - 1 / n)  # noqa: E731
    assert estimates(expected(16), expected(256), 16, 256, n) == pytest.approx((grad_sq, trace), rel=1e-12)
    paper = lambda b: grad_sq + trace / b  # noqa: E731
    assert estimates(paper(16), paper(256), 16, 256) == pytest.approx((grad_sq, trace), rel=1e-12)


@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_processes_measure_each_ranks_gradient_before_synchronisation(tmp_path):
    """DDP, 16 x 4 x 2: on each rank the first two micro-batches (no_sync) are one group measured from `.grad`, the
    third and the fourth (which synchronises) are measured by the hooks before their all-reduce; six groups from
    two ranks, summed over them. The record must be the formulas on those local gradients, computed here."""
    recipe_data = digits_recipe(SGD, effective=128, steps=1)  # no shuffling: rank r takes samples 64r .. 64r + 63
    reproduce_run(recipe_data, tmp_path, "two", "--micro-batch-max", "16", "--nproc-per-node", "2")
    record = read_metrics(tmp_path / "two" / "metrics.jsonl")[0]
    assert record["accumulation_steps"] == 4 and record["grad_syncs"] == 1  # measuring adds no synchronisation
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, world_size=2, dataset_size=len(data.train))
    setup = build(plan, torch.device("cpu"), torch.float32, data=data)  # every rank's initial weights
    ranks = [[fetch(data.train, torch.arange(start, start + 16)) for start in range(64 * rank, 64 * rank + 64, 16)]
             for rank in range(2)]
    expected = window_estimates(setup.unwrapped_model, setup.loss, ranks, len(data.train))
    assert expected["groups"] == [32, 16, 16, 32, 16, 16]
    for key in ("noise_b_small", "noise_trace", "noise_grad_sq"):
        assert record[key] == pytest.approx(expected[key], rel=1e-4), key


def test_no_noise_scale_reaches_every_process_torchrun_starts(tmp_path, monkeypatch):
    import reproduce.cli.run as run_module

    launched = []
    monkeypatch.setattr(run_module, "_launch", lambda command: launched.append(command) or 0)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "16", "--out", str(tmp_path / "out"),
              "--nproc-per-node", "2", "--no-noise-scale"])
    assert exit_info.value.code == 0
    command = launched[0]
    assert command[command.index("run"):].count("--no-noise-scale") == 1


def _measured(noise_scale: float, batch: int) -> list[dict]:
    """100 measured steps whose estimates give `noise_scale` at an effective batch of `batch` samples."""
    return [{"step": s, "loss": 0.5, "items": batch, "noise_grad_sq": 1.0, "noise_trace": noise_scale,
             "noise_b_small": batch / 8, "noise_scale": noise_scale} for s in range(1, 101)]


def test_the_verdict_never_asks_for_a_batch_the_training_set_does_not_hold():
    """Below the critical batch the sentence suggests a larger one: never past the training set's size."""
    unbounded = summarise(_measured(5000, 256), 100, "classification")["sentence"]
    assert "a larger batch would still cut" in unbounded
    bounded = summarise(_measured(5000, 256), 100, "classification", train_size=1437)["sentence"]
    assert "a larger batch, up to the training set's 1437 samples, would still cut" in bounded
    whole = summarise(_measured(5000, 1024), 100, "classification", train_size=1437)["sentence"]
    assert "below the critical batch, but the training set holds only 1437 samples" in whole
    assert "would still cut" not in whole
    near = summarise(_measured(300, 256), 100, "classification", train_size=1437)["sentence"]
    assert "near the critical batch" in near
