"""`reproduce run`: accumulated micro-batches give the plain large-batch run's weights, on real models and data."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    ADAMW,
    SGD,
    assert_same_model,
    assert_same_weights,
    digits_recipe,
    lm_recipe,
    run_accumulated,
    run_plain,
)
from reproduce.cli import main
from reproduce.data import build_data
from reproduce.data.batches import collate
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.trainer import RunRequest, read_metrics, train

# workers: micro-batches fetched by DataLoader worker processes (0: in the training process)
WITH_WORKERS = [pytest.param(SGD, 0, id="sgd-momentum"), pytest.param(ADAMW, 0, id="adamw"),
                pytest.param(SGD, 2, id="sgd-momentum-2-workers")]


@pytest.mark.parametrize("optimizer, workers", WITH_WORKERS)
def test_classifier_accumulation_equals_large_batch_float64(optimizer, workers, tmp_path):
    recipe = digits_recipe(optimizer)
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=8, tmp_path=tmp_path, workers=workers)
    assert summary["workers"] == workers
    assert (plan.micro_batch, plan.accumulation_steps) == (8, 8)
    reference = run_plain(recipe, data, steps=6)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    # and the weights really moved: the test would catch a run that did nothing
    torch.manual_seed(0)
    initial = build_model(parse_recipe(recipe)).state_dict()
    assert any(not torch.allclose(initial[k].double(), ours[k]) for k in ours)


@pytest.mark.parametrize("optimizer, workers", WITH_WORKERS)
def test_language_model_with_padding_normalises_by_tokens_float64(optimizer, workers, tmp_path):
    recipe = lm_recipe(optimizer)
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path, workers=workers)
    assert plan.accumulation_steps == 4
    lengths = {len(x) for x, _ in data.train}
    assert len(lengths) > 3  # sequences really differ in length, so padding and counting matter
    reference = run_plain(recipe, data, steps=3)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    first = [collate([data.train[i] for i in range(16)])][0][1]
    assert records[0]["items"] == int((first != -100).sum())  # normalised by the window's real tokens


def test_mean_of_micro_batch_means_would_differ(tmp_path):
    """The peers' bug (HF #34191): averaging per-micro-batch token means is not the large-batch loss."""
    data = build_data(parse_recipe(lm_recipe(SGD)))
    window = [data.train[i] for i in range(16)]
    torch.manual_seed(0)
    logits = torch.randn(16, 16, 32, dtype=torch.float64)
    _, target = collate(window)
    exact = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    means = [F.cross_entropy(logits[i:i + 4].flatten(0, 1), target[i:i + 4].flatten(), ignore_index=-100)
             for i in range(0, 16, 4)]
    assert abs(float(sum(means) / 4 - exact)) > 1e-4


def test_float32_within_rounding(tmp_path):
    recipe = digits_recipe(SGD)
    _, _, ours, data = run_accumulated(recipe, micro_batch=8, tmp_path=tmp_path, dtype=torch.float32)
    reference = run_plain(recipe, data, steps=6, dtype=torch.float32)
    assert_same_weights(ours, reference, rtol=1e-4, atol=1e-6)


def test_partial_last_window_normalised_by_what_it_holds(tmp_path):
    # 1437 training digits, batch 512: two full windows and a partial one of 413 samples, kept (drop_last false)
    recipe = digits_recipe(SGD, effective=512, steps=3, data={"drop_last": False})
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=128, tmp_path=tmp_path)
    assert plan.steps_per_epoch == 3 and plan.partial_window == 413
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["samples"] for r in records] == [512, 512, 413] and records[-1]["partial"]
    assert summary["partial_windows"] == 1
    reference = run_plain(recipe, data, steps=3)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)


def test_batchnorm_is_not_equivalent(tmp_path):
    """BN normalises each micro-batch by its own statistics: accumulation cannot match the large batch."""
    recipe = digits_recipe(SGD, model="cnn-bn", effective=32, steps=3)
    plan, _, ours, data = run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    assert "BatchNorm statistics will be computed over micro-batches of 4" in " ".join(plan.warnings)
    reference = run_plain(recipe, data, steps=3)
    differences = [float((ours[k] - reference[k]).abs().max()) for k in ours if ours[k].is_floating_point()]
    assert max(differences) > 1e-3


def test_bf16_autocast_runs_on_cpu(tmp_path):
    recipe = digits_recipe(SGD, precision="bf16")
    _, summary, _, _ = run_accumulated(recipe, micro_batch=16, tmp_path=tmp_path, dtype=torch.float32)
    assert summary["steps"] == 6 and summary["final"]["loss"] < 2.5


def test_resume_equals_uninterrupted_run_bitwise(tmp_path):
    recipe = digits_recipe(SGD, steps=8, data={"shuffle": True})
    recipe["model"] = {"builtin": "mlp", "kwargs": {"dropout": 0.3}}  # dropout: the RNG state must resume too
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, micro_batch_max=16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=3, checkpoint_every=2), data=data)
    with pytest.raises(UserError, match="not empty"):
        train(plan, RunRequest(tmp_path / "split", device="cpu"), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    split = torch.load(tmp_path / "split" / "model.pt", weights_only=True)
    for name in full:
        assert torch.equal(full[name], split[name]), name
    lines = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert [r["loss"] for r in lines] == [r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]


def test_cli_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", str(out), "--max-steps", "12"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "micro 32 x accumulation 8 x world 1 = 256 samples per step" in printed
    assert {"plan.yaml", "metrics.jsonl", "model.pt", "summary.json", "checkpoints"} <= {p.name for p in out.iterdir()}
    records = read_metrics(out / "metrics.jsonl")
    keys = {"step", "epoch", "lr", "loss", "grad_norm", "samples", "tokens", "micro_batch", "accumulation_steps",
            "seconds", "data_seconds", "peak_memory_bytes"}
    assert len(records) == 12 and keys <= records[0].keys()
    assert records[0]["lr"] == pytest.approx(0.02) and records[0]["accumulation_steps"] == 8
    assert "eval_accuracy" in records[-1]
    weights = torch.load(out / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in weights)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["exact"] is True
    # the run folder is never overwritten by a second run without --resume or --force
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_bytes() == before


def test_factory_returning_the_wrong_kind_is_a_user_error(tmp_path):
    recipe = lm_recipe(SGD)
    recipe["model"] = {"factory": "factories:not_a_module"}
    with pytest.raises(UserError, match="model: the factory must return a torch.nn.Module"):
        run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    recipe["model"] = {"factory": "no_such_module_here:model"}
    with pytest.raises(UserError, match="model.factory: cannot import 'no_such_module_here'"):
        run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    assert not (tmp_path / "run").exists()


def test_run_probes_the_micro_batch_when_not_given(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--memory", "600KiB", "--meter", "cpu", "--out", str(out),
              "--max-steps", "2"])
    assert exit_info.value.code == 0
    err = capsys.readouterr().err
    assert "probe: largest micro-batch" in err and "cpu meter" in err
    records = read_metrics(out / "metrics.jsonl")
    micro = records[0]["micro_batch"]
    assert micro < 256 and micro * records[0]["accumulation_steps"] == 256  # probed, and the batch still exact


def test_a_plan_made_without_the_data_runs(tmp_path):
    """`reproduce plan RECIPE --out plan.yaml` does not read the data; `reproduce run plan.yaml` fills in its size."""
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(digits_recipe(SGD, steps=3)))  # no data.train_size
    plan_file = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(recipe), "--micro-batch-max", "16", "--out", str(plan_file)])
    assert exit_info.value.code == 0
    assert yaml.safe_load(plan_file.read_text())["dataset_size"] is None
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(plan_file), "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert exit_info.value.code == 0
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert len(records) == 3 and records[0]["micro_batch"] * records[0]["accumulation_steps"] == 64
    ran = yaml.safe_load((tmp_path / "out" / "plan.yaml").read_text())
    assert ran["dataset_size"] == 1437 and ran["steps_per_epoch"] == 1437 // 64


def test_resume_keeps_the_runs_seed_and_refuses_a_finished_run(tmp_path):
    recipe = digits_recipe(SGD, steps=6, data={"shuffle": True})
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, micro_batch_max=16, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu", seed=5), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", seed=5, max_steps=3), data=data)
    with pytest.raises(UserError, match="`seed`: the run in .* was started with seed 5 \\(got 6\\)"):
        train(plan, RunRequest(tmp_path / "split", device="cpu", seed=6, resume=True), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)  # no --seed: the run's own
    assert_same_model(tmp_path / "full", tmp_path / "split")
    before = (tmp_path / "split" / "summary.json").read_bytes()
    with pytest.raises(UserError, match="has already run 6 of 6 optimizer steps"):
        train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True), data=data)
    assert (tmp_path / "split" / "summary.json").read_bytes() == before


def test_force_clears_the_previous_runs_outputs_only(tmp_path):
    recipe = parse_recipe(digits_recipe(SGD, steps=3))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    out = tmp_path / "out"
    train(plan, RunRequest(out, device="cpu"), data=data)
    (out / "notes.txt").write_text("mine")
    failing = parse_recipe({**digits_recipe(SGD, steps=3), "optimizer": {"name": "sgd", "lr": 1e30}})
    failing_plan = make_plan(failing, micro_batch_max=16, dataset_size=len(data.train))
    from reproduce.errors import TrainingStopped

    previous = {name: (out / name).read_bytes() for name in ("model.pt", "summary.json", "checkpoints/last.pt")}
    with pytest.raises(TrainingStopped):  # step 2 is not finite: before the new run's first checkpoint
        train(failing_plan, RunRequest(out, device="cpu", force=True), data=data)
    assert (out / "notes.txt").read_text() == "mine"
    # the previous run is deleted only once the new run has a checkpoint of its own: here it is back, whole
    assert {name: (out / name).read_bytes() for name in previous} == previous
    train(plan, RunRequest(out, device="cpu", force=True, max_steps=2, checkpoint_every=1), data=data)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
