"""The project's own reproduction suite (reproduce/*.yaml) in `make test`: every plan and verify case of every shipped
check file runs here (seconds in all), so a stated value that no longer matches the plan fails CI. The cases that
train (metric, compare: minutes) stay in `make check`. The GPT-3 Small step counts the suite states are re-derived
here from the paper's numbers, independently of the planner."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import yaml

from reproduce.check import Runner, collect, load_all, load_check_file
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "reproduce"
FAST = ("plan", "verify")  # what `make test` runs; metric and compare train (make check)


def _cases() -> list:
    """(file name, check index) of every plan and verify check, read without validation (a file that does not
    validate fails its cases, and test_check.py's test_every_shipped_check_file_is_valid, not the collection)."""
    cases = []
    for path in sorted(SUITE.glob("*.yaml")):
        checks = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("checks") or []
        for index, check in enumerate(checks):
            if isinstance(check, dict) and check.get("kind") in FAST:
                name = check.get("name") or f"{check['kind']} #{index}"
                cases.append(pytest.param(path.name, index, id=f"{path.stem}: {name}"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """One runner for the module: the data each check file builds is built once."""
    return Runner(tmp_path_factory.mktemp("check-work"))


@pytest.fixture(scope="module")
def loaded():
    return {f.path.name: f for f in load_all(collect([SUITE]))}


@pytest.mark.parametrize(("file", "index"), CASES)
def test_shipped_plan_and_verify_cases_pass(file, index, loaded, runner, one_thread):
    result = runner.evaluate(loaded[file], index)
    assert result.status == "pass", f"{file}: {result.name}: {result.status}\n" + "\n".join(result.details)


def test_every_shipped_file_has_fast_cases_and_the_rest_are_trained():
    """Each file contributes its plan and verify cases here; every other case is a metric or compare (make check)."""
    assert len(CASES) >= 30
    for path in sorted(SUITE.glob("*.yaml")):
        kinds = [c["kind"] for c in yaml.safe_load(path.read_text(encoding="utf-8"))["checks"]]
        assert any(kind in FAST for kind in kinds), path.name
        assert set(kinds) <= {"plan", "verify", "metric", "compare"}, path.name


def test_a_stale_stated_value_fails(tmp_path, runner):
    """A scratch copy of the suite with one stated value changed: its case fails, naming the field and both values."""
    scratch = tmp_path / "reproduce"
    shutil.copytree(SUITE, scratch)
    shutil.copytree(ROOT / "papers", tmp_path / "papers")
    path = scratch / "full-scale-papers.yaml"
    text = path.read_text(encoding="utf-8")
    assert text.count("optimizer_steps: 589212") == 1
    path.write_text(text.replace("optimizer_steps: 589212", "optimizer_steps: 585599"), encoding="utf-8")
    file = load_check_file(path)
    index = next(i for i, name in enumerate(file.names) if name == "gpt3-small on 8 GPUs")
    result = runner.evaluate(file, index)
    assert result.status == "fail"
    assert "optimizer_steps: expected 585599, the plan has 589212" in result.details


# ---- GPT-3 Small: the suite's step counts from the paper (Brown et al. 2020, App. B) ----------------------------

CONTEXT = 2048
BATCH = 524_288 // CONTEXT  # "0.5M" tokens read as 2^19 (the recipe's stated reading): 256 sequences
START = 32_768 // CONTEXT  # "from a small value (32k tokens)": 16 sequences
RAMP = 4e9 / CONTEXT  # "over the first 4-12 billion tokens": 4B for the smallest model, in sequences
WARMUP = 375e6 / CONTEXT  # "linear LR warmup over the first 375 million tokens"
TOTAL = 300e9 / CONTEXT  # "a total of 300 billion tokens"


def paper_steps(grain: int) -> tuple[int, int]:
    """(optimizer steps, warm-up steps) of the paper's schedule, step by step: each step's batch is the ramp's value
    at the data read so far, rounded down to a multiple of `grain` sequences (at least one grain)."""
    read, steps, warmup = 0.0, 0, None
    while read < RAMP:
        wanted = START + (BATCH - START) * read / RAMP
        batch = min(BATCH, max(grain, int(wanted // grain) * grain))
        if warmup is None and read + batch > WARMUP:  # the warm-up ends inside this step: nearest whole step
            warmup = steps + round((WARMUP - read) / batch)
        read, steps = read + batch, steps + 1
    return steps + round((TOTAL - read) / BATCH), warmup


def stated(run: str) -> dict:
    spec = yaml.safe_load((SUITE / "full-scale-papers.yaml").read_text(encoding="utf-8"))
    return next(c["expect"] for c in spec["checks"] if c.get("run") == run)


def test_gpt3_steps_are_the_papers_tokens_under_its_ramp():
    """589,212 steps (8,435 warm-up) on 8 GPUs and 587,381 (7,296) on 1 are the paper's 300B tokens and 375M warm-up
    tokens read under its batch ramp, each step's batch rounded down to whole sequences per process. The rounding is
    why the count depends on the number of processes, and only on it: not on the micro-batch that fits."""
    recipe = load_recipe(ROOT / "papers" / "brown2020-gpt3-small.yaml")
    for world, run in ((8, "gpt3"), (1, "gpt3-1")):
        steps, warmup = paper_steps(grain=world)
        expect = stated(run)
        assert (expect["optimizer_steps"], expect["warmup_steps"]) == (steps, warmup)
        for micro in (1, 8, 64):
            p = make_plan(recipe, micro, world)
            assert (p.optimizer_steps, p.warmup_steps) == (steps, warmup), (world, micro)
    assert paper_steps(8) == (589_212, 8_435) and paper_steps(1) == (587_381, 7_296)
    # Unrounded, the ramp takes integral dx / b(x) = RAMP / 240 x ln 16 steps: rounding down only adds steps, fewer
    # with a finer grain; the old stated 585,599 (batches in multiples of 64, the micro-batch x 8 GPUs) is below it.
    ramp_limit = RAMP / (BATCH - START) * math.log(BATCH / START)
    limit = ramp_limit + (TOTAL - RAMP) / BATCH
    assert round(limit) == 587_139
    assert limit < paper_steps(1)[0] < paper_steps(2)[0] < paper_steps(8)[0] < paper_steps(16)[0]
    assert paper_steps(8)[0] / paper_steps(1)[0] - 1 < 0.004  # 0.3%
    warm_limit = RAMP / (BATCH - START) * math.log((START + (BATCH - START) * WARMUP / RAMP) / START)
    assert round(warm_limit) == 7_146 and warm_limit < paper_steps(1)[1] < paper_steps(8)[1]
    assert round(WARMUP / BATCH) == 715  # the warm-up at the full batch, without the ramp
