"""A newcomer's first hour (issue 25): ordinary mistakes get one `error:` line (exit 2, nothing written, no
traceback), messages point at the real fix, the printed resume command continues the same run, and the run says
what its result means."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml

from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[1]

# the 65-character model of the nanoGPT Shakespeare recipe, made small enough for a test
CHAR_RECIPE = {
    "batch": {"effective": 2048, "unit": "tokens", "sequence_length": 32},
    "task": "language-modeling",
    "model": {"builtin": "gpt-char", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 32}},
    "data": {"name": "shakespeare_char", "available": False, "format": "tokens"},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 5000}},
}
DIGITS = {
    "batch": {"effective": 64},
    "task": "classification",
    "model": {"builtin": "mlp"},
    "data": {"builtin": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"warmup": {"steps": 5}, "total": {"steps": 300}},
}


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def snapshot(folder: Path) -> dict:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def refused(capsys, tmp_path: Path, *args: str) -> str:
    """Run a command that must refuse its input: exit 2, one `error:` line, no traceback, the user's --out folder
    (holding a file of theirs) unchanged. Returns the line."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("the user's own file\n")
    before = snapshot(out)
    if args[0] == "run" and "--force" not in args:  # past the --out check: the user's file stays all the same
        args = (*args, "--force")
    code, _, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert snapshot(out) == before
    return lines[0]


def char_tokens(folder: Path, ids_below: int, count: int = 20_000, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    generator.integers(0, ids_below, count).astype(np.uint16).tofile(folder / "train.bin")
    generator.integers(0, ids_below, count // 4).astype(np.uint16).tofile(folder / "val.bin")
    return folder


# ---- 1. token ids outside the model's vocabulary ---------------------------------------------------------------

def test_gpt2_tokens_given_to_the_character_model_are_refused_before_training(tmp_path, capsys):
    data = char_tokens(tmp_path / "gpt2", 50257)
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16", "--force")
    assert line.startswith(f"error: data.path: {data / 'train.bin'}: token ids up to 5025")
    assert "the model's vocabulary has 65 ids (0-64)" in line
    # the maximum was read once and cached beside the file, keyed by its size and time
    cache = json.loads((data / ".train.bin.max-id.json").read_text())
    assert cache["max_id"] == int(np.fromfile(data / "train.bin", dtype=np.uint16).max())


def test_a_text_file_given_as_tokens_is_refused_naming_meta_pkl(tmp_path, capsys):
    data = tmp_path / "text"
    data.mkdir()
    (data / "train.bin").write_text("First Citizen: Before we proceed any further, hear me speak. " * 40)
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": {0: "\n"}, "stoi": {"\n": 0}}))
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16")
    assert f"data.path: {data / 'train.bin'}: token ids up to " in line
    assert "vocabulary has 65 ids" in line and "meta.pkl beside it says vocab_size 65" in line


def test_evaluation_tokens_are_checked_too(tmp_path, capsys):
    data = char_tokens(tmp_path / "char", 65)
    np.arange(0, 300, dtype=np.uint16).tofile(data / "val.bin")
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16")
    assert line.startswith(f"error: data.eval_path: {data / 'val.bin'}: token ids up to 299")


# ---- 2. a schedule of zero optimizer steps ---------------------------------------------------------------------

@pytest.mark.parametrize("total, reads", [
    ({"tokens": 5000}, "64 sequences (16,384 tokens)"),
    ({"samples": 20}, "64 sequences (16,384 tokens)"),
], ids=["tokens", "samples"])
def test_zero_optimizer_steps_are_refused_by_plan_and_run(total, reads, tmp_path, capsys):
    recipe = dict(CHAR_RECIPE, batch={"effective": 16384, "unit": "tokens", "sequence_length": 256},
                  schedule={"total": total})
    path = write(tmp_path / "short.yaml", recipe)
    line = refused(capsys, tmp_path, "plan", path, "--micro-batch-max", "64")
    expected = f"is less than one optimizer step, which reads {reads}: the run would take 0 optimizer steps"
    assert line.startswith("error: schedule.total: ") and expected in line
    data = char_tokens(tmp_path / "char", 65, count=40_000)
    line = refused(capsys, tmp_path, "run", path, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "64", "--force")
    assert expected in line


def test_a_fraction_of_an_epoch_under_one_step_is_refused(tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", dict(DIGITS, schedule={"total": {"epochs": 0.01}}))
    line = refused(capsys, tmp_path, "plan", path, "--micro-batch-max", "16")
    assert line == ("error: schedule.total: 0.01 epochs is less than one optimizer step, which reads 64 samples; an "
                    "epoch is 22 optimizer steps: the run would take 0 optimizer steps; give a longer total")


def test_a_plan_file_edited_to_zero_steps_is_refused(tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", DIGITS)
    assert cli(capsys, "plan", path, "--micro-batch-max", "16", "--out", tmp_path / "plan.yaml")[0] == 0
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    plan["optimizer_steps"] = 0
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    line = refused(capsys, tmp_path, "run", tmp_path / "plan.yaml", "--out", tmp_path / "out", "--device", "cpu")
    assert "optimizer_steps: must be >= 1 (got 0): one optimizer step reads 64 samples" in line


# ---- 3. data marked available: false -----------------------------------------------------------------------------

def test_unavailable_data_says_to_pass_data_and_its_format(tmp_path, capsys):
    line = refused(capsys, tmp_path, "run", ROOT / "papers" / "nanogpt-shakespeare-char.yaml", "--out",
                   tmp_path / "out", "--micro-batch-max", "4", "--device", "cpu")
    assert line == ("error: data: 'shakespeare_char' is marked available: false: give its path with --data PATH "
                    "(format tokens: a binary file of uint16 token ids, or a nanoGPT data folder holding train.bin "
                    "(and val.bin))")


def test_unavailable_data_without_a_format_says_what_would_make_it_runnable(tmp_path, capsys):
    recipe = dict(DIGITS, data={"name": "imagenet-1k", "available": False, "train_size": 1281167})
    line = refused(capsys, tmp_path, "run", write(tmp_path / "r.yaml", recipe), "--out", tmp_path / "out",
                   "--micro-batch-max", "4", "--device", "cpu")
    assert "marked available: false and names no data.format: this recipe can be planned but not run here" in line
    assert "data.factory" in line and "--data PATH" in line


# ---- 5. --memory without a unit ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "run"])
def test_memory_without_a_unit_is_refused(command, tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", DIGITS)
    extra = ["--out", tmp_path / "out", "--device", "cpu"] if command == "run" else []
    line = refused(capsys, tmp_path, command, path, "--memory", "8", "--meter", "cpu", *extra)
    assert line == "error: --memory: 8 bytes? give a unit, e.g. 8GiB"


def test_memory_sizes_with_units_and_large_byte_counts_still_parse():
    from reproduce.units import parse_size

    assert parse_size("8GiB") == 8 * 2**30 and parse_size("2097152") == 2**21 and parse_size("1MiB") == 2**20
