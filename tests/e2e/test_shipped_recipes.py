"""Recipes by name from any folder, the shipped check suite (`check --shipped`), and both in a built wheel installed
outside this checkout (the package data pyproject.toml declares)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import cli
from reproduce.shipped import checks_folder, papers_folder, resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
GOYAL = "goyal2017-resnet50"


def test_a_shipped_name_plans_from_any_folder_and_the_plan_says_which_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "plan", GOYAL, "--micro-batch-max", "32")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("recipe: ") and first.endswith(f"{GOYAL}.yaml (shipped with reproduce)")
    assert Path(first.removeprefix("recipe: ").removesuffix(" (shipped with reproduce)")).resolve() == (
        ROOT / "papers" / f"{GOYAL}.yaml").resolve()
    assert "32 x 256 x 1 = 8192 samples" in out
    for form in (f"{GOYAL}.yaml", f"papers/{GOYAL}.yaml"):  # the docs' spelling works from any folder too
        assert resolve_recipe(form) == resolve_recipe(GOYAL)
    code, out, err = cli(capsys, "plan", GOYAL, "--micro-batch-max", "32", "--json")  # the file on stderr
    assert code == 0 and out.lstrip().startswith("{") and f"recipe {GOYAL}: " in err


def test_a_file_in_the_current_folder_wins_over_the_shipped_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "papers" / f"{GOYAL}.yaml").read_text(encoding="utf-8")
    Path(f"{GOYAL}.yaml").write_text(text.replace("lr: 3.2", "lr: 1.6"), encoding="utf-8")
    code, out, err = cli(capsys, "plan", GOYAL, "--micro-batch-max", "32")
    assert code == 0, err
    assert out.splitlines()[0] == f"recipe: {GOYAL}.yaml" and "1.6 (exact)" in out
    Path(f"{GOYAL}.yaml").unlink()
    Path("papers").mkdir()
    Path("papers", f"{GOYAL}.yaml").write_text(text.replace("lr: 3.2", "lr: 0.8"), encoding="utf-8")
    code, out, _ = cli(capsys, "plan", GOYAL, "--micro-batch-max", "32")
    assert out.splitlines()[0] == f"recipe: papers/{GOYAL}.yaml" and "0.8 (exact)" in out


def test_an_unknown_name_is_one_line_with_the_closest_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "plan", "goyal2017-resnt50", "--micro-batch-max", "32")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: goyal2017-resnt50: no such recipe file, and no shipped recipe of that name (did you mean "
        "goyal2017-resnet50, he2016-resnet50, you2017-lars-resnet50?)"]


@pytest.mark.parametrize("command", ["probe", "run", "verify", "plan"])
def test_every_recipe_command_takes_a_name_and_says_so_when_there_is_none(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, command, "digits-mpl", *(["--out", "r"] if command == "run" else []))
    assert code == 2 and "digits-mpl: no such " in err and "did you mean digits-mlp" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_verify_by_name_from_another_folder(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "verify", "digits-mlp", "--micro-batch-max", "32")
    assert code == 0, err
    assert err.startswith("recipe digits-mlp: ") and "digits-mlp.yaml (shipped with reproduce)" in err


def test_papers_and_show_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = cli(capsys, "papers", "show", "digits-mlp")
    assert code == 0, err
    assert "  file: " in out and "digits-mlp.yaml (shipped with reproduce)" in out
    assert "  plan it: reproduce plan digits-mlp --micro-batch-max 32" in out


def test_check_shipped_runs_the_suite_by_file_name_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "check", "--shipped", "full-scale-papers", "--summary", "s.md")
    assert code == 0, err
    assert "19 passed, 0 failed" in out and Path("s.md").is_file()
    code, _, err = cli(capsys, "check", "--shipped", "no-such-file")
    assert code == 2 and "--shipped: no shipped check file no-such-file (they are: digits-mlp," in err
    code, _, err = cli(capsys, "check")  # no reproduce/ here: the default's error names --shipped
    assert code == 2 and "--shipped runs the suite shipped with reproduce" in err


def test_the_checkout_ships_every_recipe_and_check_file():
    """The package's shipped/ folders are the top-level papers/ and reproduce/ (links), so nothing is listed twice."""
    assert sorted(p.name for p in papers_folder().glob("*.yaml")) == sorted(p.name for p in (ROOT / "papers").glob(
        "*.yaml"))
    assert sorted(p.name for p in checks_folder().glob("*.yaml")) == sorted(p.name for p in (ROOT / "reproduce").glob(
        "*.yaml"))


@pytest.mark.subprocess
def test_a_built_wheel_installed_elsewhere_lists_plans_and_checks_by_name(tmp_path):
    """Build the wheel from a copy of the sources (as pip does), install it into a temporary target, and run the
    installed package from another folder with none of this checkout on the path."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("papers", "reproduce"):
        shutil.copytree(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == "reproduce_large_batch-0.1.0-py3-none-any.whl"  # the distribution's name (docs/install.md)
    names = zipfile.ZipFile(wheel).namelist()
    assert f"reproduce/shipped/papers/{GOYAL}.yaml" in names
    assert "reproduce/shipped/checks/full-scale-papers.yaml" in names
    assert len([n for n in names if n.startswith("reproduce/shipped/papers/")]) == len(list((ROOT / "papers").glob(
        "*.yaml")))
    target = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target), "REPRODUCE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}

    def reproduce(*args: str) -> str:
        done = subprocess.run([sys.executable, "-c", "from reproduce.cli import main; main()", *args],
                              capture_output=True, text=True, cwd=elsewhere, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = reproduce("papers", "show", GOYAL)
    assert f"  file: {target / 'reproduce' / 'shipped' / 'papers' / GOYAL}.yaml (shipped with reproduce)" in where
    listing = reproduce("papers")
    assert f"\n{GOYAL} " in listing or f"\n  {GOYAL}" in listing or f" {GOYAL} " in listing, listing
    runnable, plan_only = re.search(r"(\d+) runnable here, (\d+) plan-only", listing).groups()
    assert int(runnable) + int(plan_only) == len(list((ROOT / "papers").glob("*.yaml")))
    out = reproduce("plan", GOYAL, "--micro-batch-max", "32")
    assert out.splitlines()[0] == f"recipe: {target / 'reproduce' / 'shipped' / 'papers' / GOYAL}.yaml (shipped with " \
                                  "reproduce)"
    assert "32 x 256 x 1 = 8192 samples" in out
    assert "19 passed, 0 failed" in reproduce("check", "--shipped", "full-scale-papers")
