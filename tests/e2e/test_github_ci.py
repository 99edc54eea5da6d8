"""The GitHub Actions workflow of examples/ci/ (shown in docs/checks.md): its `reproduce check` step run here with the
environment variables GitHub sets ($GITHUB_WORKSPACE, $GITHUB_STEP_SUMMARY, ...), on a user's check folder with one
stale stated value: exit 1, an `::error` annotation on that value's line, the job summary appended to, the JUnit XML
and HTML reports where the upload step looks for them."""

from __future__ import annotations

import os
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from helpers import cli

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "examples" / "ci" / "reproduce-check.yml"
CHECK = """\
recipe: recipes/digits.yaml
budget: {micro_batch_max: 32, device: cpu}
checks:
  - kind: plan
    name: the paper's split
    expect: {micro_batch: 32, accumulation_steps: 8,
             optimizer_steps: 301}
  - kind: plan
    name: the batch
    expect: {effective_batch: 256}
"""


def steps() -> dict[str, dict]:
    spec = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    return {step.get("name", step.get("uses")): step for step in spec["jobs"]["check"]["steps"]}, spec["env"]


def test_the_docs_show_the_example_workflow_as_it_is():
    docs = (ROOT / "docs" / "checks.md").read_text(encoding="utf-8")
    assert WORKFLOW.read_text(encoding="utf-8") in docs


def test_the_workflows_check_step_under_githubs_environment(tmp_path, monkeypatch, capsys):
    found, env = steps()
    command = found["reproduce check"]["run"]
    assert "--annotations github" in command and '--summary "$GITHUB_STEP_SUMMARY"' in command
    uploaded = found["Keep the reports"]["with"]["path"].split()
    # the user's repository, checked out in $GITHUB_WORKSPACE: a check folder and the recipe it names
    (tmp_path / "checks" / "recipes").mkdir(parents=True)
    (tmp_path / "checks" / "recipes" / "digits.yaml").write_bytes((ROOT / "papers" / "digits-mlp.yaml").read_bytes())
    (tmp_path / "checks" / "digits.yaml").write_text(CHECK, encoding="utf-8")
    runner_files = tmp_path / "_runner_file_commands"
    runner_files.mkdir()
    summary = runner_files / "step_summary_1"
    summary.write_text("an earlier step's summary\n", encoding="utf-8")  # the runner makes the file; steps append
    github = {"GITHUB_ACTIONS": "true", "CI": "true", "GITHUB_WORKSPACE": str(tmp_path),
              "GITHUB_STEP_SUMMARY": str(summary), "RUNNER_TEMP": str(tmp_path / "_temp"), **env}
    for name, value in github.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(os.path.expandvars(command))
    assert argv[0] == "reproduce"
    code, out, err = cli(capsys, *argv[1:])
    assert code == 1, err  # a failing check fails the step
    errors = [line for line in out.splitlines() if line.startswith("::error ")]
    stale = CHECK.splitlines().index("             optimizer_steps: 301}") + 1
    assert errors == [
        f"::error file=checks/digits.yaml,line={stale},title=reproduce check%3A digits.yaml%3A the paper's split "
        "(fail)::measured 32 x 8 x 1 = 256 samples, lr 0.2, 300 steps; expected invariants + 3 stated values "
        "(m <= 32, W = 1)%0Aoptimizer_steps: expected 301, the plan has 300%0Aplan warning: the last window of each "
        "epoch holds 157 of 256 samples: dropped (drop_last)%0Astated: micro_batch 32, "
        "accumulation_steps 8, optimizer_steps 301"]
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("an earlier step's summary\n## reproduce check: 1 passed, 1 failed in ")
    assert "| ❌ FAIL | digits.yaml | the paper's split |" in text
    assert "runs/check/junit.xml" in uploaded and "runs/check/junit.html" in uploaded
    cases = ET.parse(tmp_path / "runs" / "check" / "junit.xml").getroot().iter("testcase")
    assert [c.get("name") for c in cases] == ["the paper's split", "the batch"]
    assert (tmp_path / "runs" / "check" / "junit.html").is_file()


def test_a_summary_that_is_not_githubs_is_replaced_not_appended(tmp_path, monkeypatch, capsys):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "digits.yaml").write_bytes((ROOT / "papers" / "digits-mlp.yaml").read_bytes())
    (tmp_path / "c.yaml").write_text(CHECK.replace("optimizer_steps: 301", "optimizer_steps: 300"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    Path("s.md").write_text("old\n", encoding="utf-8")
    code, out, _ = cli(capsys, "check", "c.yaml", "--summary", "s.md", "--annotations", "github")
    assert code == 0 and "::error" not in out
    assert Path("s.md").read_text(encoding="utf-8").startswith("## reproduce check: 2 passed, 0 failed")
