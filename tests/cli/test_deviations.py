"""`deviations:` in a recipe: what it does differently from the paper, printed by `plan` and `papers show`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import cli
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe

PAPERS = Path(__file__).resolve().parents[2] / "papers"


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    return cli(capsys, *args)


@pytest.mark.parametrize("name, words", [
    ("hu2021-lora-gpt2m-e2e", ["fused c_attn", "query, key and value", "query and value only"]),
    ("brown2020-gpt3-small", ["524,288", "0.5M"]),
    ("you2017-lars-resnet50", ["lr 34", "12 warm-up epochs", "one revision"]),
    ("goyal2017-resnet50", ["zero-initialised gamma"]),
])
def test_the_audits_findings_are_declared(name, words):
    text = " ".join(load_recipe(PAPERS / f"{name}.yaml").deviations)
    for word in words:
        assert word in text, (name, word)


def test_goyal_names_its_gpus():
    batch = load_recipe(PAPERS / "goyal2017-resnet50.yaml").batch
    assert (batch.device, batch.devices, batch.per_device) == ("P100-SXM2-16GB", 256, 32)


def test_plan_prints_each_deviation_as_a_warning(capsys):
    recipe = load_recipe(PAPERS / "hu2021-lora-gpt2m-e2e.yaml")
    warnings = make_plan(recipe, micro_batch_max=8).warnings
    for text in recipe.deviations:
        assert f"deviation from the paper: {text}" in warnings
    code, out, err = run_cli(["plan", str(PAPERS / "hu2021-lora-gpt2m-e2e.yaml"), "--micro-batch-max", "8"], capsys)
    assert code in (0, None) and err.count("warning: deviation from the paper:") == len(recipe.deviations)
    assert "fused c_attn" in err.replace("\n", " ")


def test_papers_show_lists_the_deviations(capsys):
    code, out, _ = run_cli(["papers", "--dir", str(PAPERS), "show", "brown2020-gpt3-small"], capsys)
    lines = [line for line in out.splitlines() if line.startswith("  deviation from the paper: ")]
    assert code in (0, None) and len(lines) == len(load_recipe(PAPERS / "brown2020-gpt3-small.yaml").deviations)
    assert "  plan it: reproduce plan brown2020-gpt3-small --micro-batch-max 16" in out  # its header's, by name


def test_a_recipe_without_deviations_plans_without_such_warnings():
    recipe = load_recipe(PAPERS / "digits-mlp.yaml")
    assert recipe.deviations == [] and not any("deviation" in w for w in make_plan(recipe, micro_batch_max=32).warnings)


@pytest.mark.parametrize("value, message", [
    (["  "], "deviations.0: an empty sentence; say what differs from the paper"),
    ("one sentence", "deviations: expected a list (got 'one sentence')"),
    ([3], "deviations.0: expected a string (got 3)"),
])
def test_bad_deviations_are_one_line_and_exit_2(tmp_path, capsys, value, message):
    data = yaml.safe_load((PAPERS / "digits-mlp.yaml").read_text())
    data["deviations"] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    out_file = tmp_path / "plan.yaml"
    code, _, err = run_cli(["plan", str(path), "--micro-batch-max", "8", "--out", str(out_file)], capsys)
    assert code == 2 and err.strip() == f"error: {path}: {message}" and not out_file.exists()
