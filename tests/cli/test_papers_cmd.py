"""`reproduce papers` and `reproduce papers show NAME`: the shipped recipes, runnable here or plan-only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli
from reproduce.plan import builtin_names
from reproduce.plan.recipe import load_recipe, parse_recipe

PAPERS = Path(__file__).resolve().parents[2] / "papers"


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    return cli(capsys, *args)


def test_builtin_names_equal_the_registries():
    from reproduce.data import DATA
    from reproduce.models import LOSSES, MODELS

    assert set(builtin_names.MODELS) == set(MODELS)
    assert set(builtin_names.LOSSES) == set(LOSSES)
    assert set(builtin_names.DATA) == set(DATA)


@pytest.mark.subprocess
def test_papers_command_imports_no_torch():
    code = "import sys; from reproduce.cli import papers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_list_shows_every_recipe_and_where_it_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))  # the parameter counts are computed, then cached
    code, out, err = run_cli(["papers", "--dir", str(PAPERS)], capsys)
    assert run_cli(["papers", "--dir", str(PAPERS)], capsys)[1] == out and list(tmp_path.glob("*.json"))
    assert code == 0, err
    lines = out.splitlines()
    for path in sorted(PAPERS.glob("*.yaml")):
        assert any(line.startswith(f"│ {path.stem} ") for line in lines), path.stem
    row = {line.split("│")[1].strip(): line for line in lines if line.startswith("│ ") and line.split("│")[1].strip()}
    assert "runnable" in row["digits-mlp"] and "256 samples" in row["digits-mlp"] and "sgd 0.2" in row["digits-mlp"]
    assert "runnable" in row["pysource-gpt"] and "4,096 tokens" in row["pysource-gpt"]
    assert "plan-only" in row["goyal2017-resnet50"] and "8,192 samples" in row["goyal2017-resnet50"]
    assert "2017" in row["goyal2017-resnet50"] and "nesterov 3.2" in row["goyal2017-resnet50"]
    # each model with its parameter count as the recipe builds it (on the meta device), what trains with LoRA
    assert "resnet50 25.6M" in row["goyal2017-resnet50"] and "mlp 26.1k" in row["digits-mlp"]
    assert "llama-7b 6.74B (4.19M trainable)" in row["tloen2023-alpaca-lora"]
    assert "vit-b16 103.2M" in row["dosovitskiy2021-vit-b16"]  # with its 21,843-class head for ImageNet-21k
    # why not runnable, below the table: its data is a format on disk, given at run time
    assert "  goyal2017-resnet50: imagefolder data imagenet-1k not on this machine (reproduce run --data PATH)" in lines
    assert "runnable here" in lines[-1] and "plan-only" in lines[-1]


def test_show_prints_the_recipe_and_a_summary(capsys):
    code, out, err = run_cli(["papers", "--dir", str(PAPERS), "show", "goyal2017-resnet50"], capsys)
    assert code == 0, err
    assert "effective: 8192" in out and "Accurate, Large Minibatch SGD" in out
    assert "effective batch 8,192 samples (paper: 32 per device x 1 accumulation x 256 devices)" in out
    assert "plan-only (imagefolder data imagenet-1k not on this machine (reproduce run --data PATH))" in out
    assert "model: resnet50, 25,557,032 parameters" in out
    assert "--micro-batch-max 32" in out
    code, out, _ = run_cli(["papers", "--dir", str(PAPERS), "show", "digits-mlp.yaml"], capsys)
    assert code == 0 and "here: runnable" in out and "run it:  reproduce run" in out


def test_show_unknown_name_suggests(capsys):
    code, out, err = run_cli(["papers", "--dir", str(PAPERS), "show", "goyal2017"], capsys)
    assert code == 2 and "no recipe 'goyal2017'" in err and "goyal2017-resnet50" in err


def test_invalid_recipe_is_listed_not_fatal(tmp_path, capsys):
    (tmp_path / "good.yaml").write_text((PAPERS / "digits-mlp.yaml").read_text())
    (tmp_path / "bad.yaml").write_text("batch: {effective: -3}\n")
    code, out, err = run_cli(["papers", "--dir", str(tmp_path)], capsys)
    assert code == 0, err
    assert "invalid recipe" in out and "1 runnable here, 0 plan-only, 1 invalid" in out


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"model": {"builtin": "resnet51"}}, "no built-in model resnet51"),
        ({"model": {"builtin": "resnet50"}}, ""),
        ({"task": "custom", "loss": {"builtin": "mae-masked-pixel-mse"}}, ""),
        ({"task": "custom", "loss": {"builtin": "mse"}}, "no built-in loss mse"),
        ({"model": {"factory": "no_such_module_xyz:build"}}, "model factory 'no_such_module_xyz:build' not importable"),
        ({"data": {"name": "imagenet", "available": False}}, "data imagenet not available"),
        ({"data": {"name": "imagenet", "format": "imagefolder", "available": False}},
         "imagefolder data imagenet not on this machine (reproduce run --data PATH)"),
        ({"optimizer": {"name": "lars", "lr": 0.1}}, ""),  # runs: reproduce.train.optim.large_batch
        ({"model": {"hf": "/no/such/model"}}, None),  # transformers missing, or the model is not here
        ({"model": {"factory": "factories:tiny_gpt"}}, ""),
    ],
)
def test_why_not_runnable(change, reason, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    data = {
        "batch": {"effective": 8}, "task": "classification", "model": {"builtin": "mlp"},
        "data": {"builtin": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 3}},
        **change,
    }
    found = builtin_names.why_not_runnable(parse_recipe(data))
    if reason is None:
        assert found in ("transformers is not installed", "Hugging Face model '/no/such/model' is not on this machine")
    else:
        assert (found or "") == reason


def test_shipped_runnable_recipes_really_build():
    """What the list calls runnable builds its data and model here (cheap ones only)."""
    from reproduce.data import build_data
    from reproduce.models import build_model

    recipe = load_recipe(PAPERS / "digits-mlp.yaml")
    assert builtin_names.why_not_runnable(recipe) is None
    data = build_data(recipe)
    assert build_model(recipe, data.info) is not None
