"""`reproduce verify`: the plan's accumulated gradient against the one-pass gradient, on real models and data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from reproduce.cli import main
from reproduce.data import build_data
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe, parse_recipe
from reproduce.verify.accumulation import verify

PAPERS = Path(__file__).resolve().parents[3] / "papers"
DIGITS = PAPERS / "digits-mlp.yaml"


def digits_recipe(**model):
    data = yaml.safe_load(DIGITS.read_text(encoding="utf-8"))
    if model:
        data["model"] = model
    return parse_recipe(data, source="test")


@pytest.fixture(scope="module")
def digits_data():
    return build_data(load_recipe(DIGITS))


def write(tmp_path: Path, recipe) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True)), encoding="utf-8")
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_mlp_float64_accumulation_is_the_large_batch(digits_data):
    recipe = digits_recipe()
    plan = make_plan(recipe, 32, dataset_size=len(digits_data.train))
    result = verify(plan, data=digits_data)
    assert (result.micro_batch, result.micro_batches, result.samples) == (32, 8, 256)
    assert result.reference_chunks == 1 and result.dtype == "float64"
    assert result.within_tolerance and result.verdict == "equivalent"
    assert result.global_relative_error < 1e-12
    assert len(result.parameters) == 6
    assert all(row.relative_error < 1e-12 and row.reference_norm > 0 for row in result.parameters)


def test_partial_micro_batch_chunked_reference_and_two_ranks(digits_data):
    recipe = digits_recipe()
    size = len(digits_data.train)
    # 100 samples in micro-batches of 32, 32, 32, 4: the window count normalises the short one too
    result = verify(make_plan(recipe, 32, dataset_size=size), samples=100, data=digits_data, chunk=48)
    assert (result.samples, result.micro_batches, result.reference_chunks) == (100, 4, 3)
    assert result.global_relative_error < 1e-12
    # two processes: both ranks' micro-batches make the effective batch
    two = verify(make_plan(recipe, 32, world_size=2, dataset_size=size), data=digits_data)
    assert (two.samples, two.micro_batches) == (256, 8) and two.global_relative_error < 1e-12


def test_dropout_is_disabled_for_the_check(digits_data):
    recipe = digits_recipe(builtin="mlp", kwargs={"hidden": 64, "dropout": 0.5})
    result = verify(make_plan(recipe, 32, dataset_size=len(digits_data.train)), data=digits_data)
    assert result.dropout_disabled == ["net.3 (p=0.5)"]
    assert result.global_relative_error < 1e-12


def test_float32_within_its_default_tolerance(digits_data):
    result = verify(make_plan(digits_recipe(), 16, dataset_size=1437), dtype="float32", data=digits_data)
    assert result.tolerance == 1e-5
    assert 0 < result.global_relative_error < 1e-5


def test_batchnorm_is_reported_not_equivalent_with_the_difference(digits_data):
    recipe = digits_recipe(builtin="cnn-bn", norm_layers=["batchnorm"], kwargs={"channels": 8})
    result = verify(make_plan(recipe, 32, dataset_size=len(digits_data.train)), samples=64, data=digits_data)
    assert result.batchnorm and not result.within_tolerance
    assert result.verdict == "NOT equivalent"
    assert "BatchNorm" in result.explanation
    assert result.global_relative_error > 1e-3  # not rounding: a real difference, and its size is reported
    # a conv bias just before BatchNorm has no gradient at all: shown, but judged only within the global error
    assert any(row.negligible for row in result.parameters)


def test_cli_exit_codes(tmp_path, capsys):
    code, out, _ = run_cli(["verify", str(DIGITS), "--micro-batch-max", "32"], capsys)
    assert code == 0
    assert "equivalent: global relative error" in out and "net.1.weight" in out

    bn = write(tmp_path, digits_recipe(builtin="cnn-bn", norm_layers=["batchnorm"], kwargs={"channels": 8}))
    code, out, _ = run_cli(["verify", str(bn), "--micro-batch-max", "32", "--samples", "64", "--json"], capsys)
    assert code == 1
    result = json.loads(out)
    assert result["equivalent"] is False and result["batchnorm"] is True
    assert result["global_relative_error"] > 1e-3

    code, _, err = run_cli(["verify", str(PAPERS / "goyal2017-resnet50.yaml"), "--micro-batch-max", "32"], capsys)
    assert code == 2 and "available: false" in err
    code, _, err = run_cli(["verify", str(DIGITS), "--micro-batch-max", "32", "--tolerance", "0"], capsys)
    assert code == 2 and err.strip() == "error: --tolerance: must be > 0 (got 0.0)"
    code, _, err = run_cli(["verify", str(DIGITS)], capsys)
    assert code == 2 and "--micro-batch-max: required" in err


def test_token_loss_gpt_from_a_plan_file(tmp_path, capsys):
    plan_path = tmp_path / "plan.yaml"
    code, _, _ = run_cli(["plan", str(PAPERS / "pysource-gpt.yaml"), "--micro-batch-max", "4", "--out", str(plan_path)],
                         capsys)
    assert code == 0
    code, out, _ = run_cli(["verify", str(plan_path), "--samples", "10", "--json"], capsys)
    result = json.loads(out)
    assert code == 0, out
    assert (result["samples"], result["micro_batches"]) == (10, 3)  # 4 + 4 + 2 sequences
    assert result["global_relative_error"] < 1e-12


def test_a_plan_with_batch_phases_is_verified_on_its_first_phase(capsys):
    """Batch phases read the data cut at each phase's sequence length (as the run indexes it): verify checks the
    first optimizer step, at the first phase's batch and length (it raised an IndexError before)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "papers/pysource-gpt-phases.yaml", "--micro-batch-max", "16", "--json"])
    assert exit_info.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["equivalent"] and result["samples"] == 128  # the first phase: 128 sequences of 32 tokens
