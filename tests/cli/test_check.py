"""`reproduce check`: strict check files, real checks end to end, JUnit XML and Markdown reports, exit codes."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from reproduce.check import merge
from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ROOT / "papers"
SUITE = ROOT / "reproduce"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    cases = root.findall("./testsuite/testcase")
    return {
        "tests": int(root.get("tests")), "failures": int(root.get("failures")), "errors": int(root.get("errors")),
        "cases": len(cases), "failed": [c.get("name") for c in cases if c.find("failure") is not None],
        "errored": [c.get("name") for c in cases if c.find("error") is not None],
    }


BAD_SCHEMA = f"""\
recipe: {PAPERS / "digits-mlp.yaml"}
budget: {{micro_batch_max: 0, devce: cpu}}
runs:
  plain: {{budget: {{micro_batch_max: 256}}, overides: {{}}}}
checks:
  - {{kind: verfy}}
  - {{kind: metric, metric: eval_accuracy}}
  - {{kind: metric, metric: eval_accuracy, mn: 3}}
  - {{kind: compare, a: main, b: plain, tolerance: -1}}
  - {{metric: x}}
"""


def test_schema_errors_exit_2_one_line_each(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", BAD_SCHEMA)
    code, out, err = run_cli(["check", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"error: {path}: budget.micro_batch_max: must be > 0 (got 0)",
        f"error: {path}: budget.devce: unknown key (did you mean 'device'?)",
        f"error: {path}: runs.plain.overides: unknown key (did you mean 'overrides'?)",
        f"error: {path}: checks[0].kind: expected one of plan, verify, metric, compare (got 'verfy'; "
        "did you mean 'verify'?)",
        f"error: {path}: checks[1]: give min, max, baseline with min_ratio/max_ratio, reported, or drift",
        f"error: {path}: checks[2].mn: unknown key (did you mean 'min'?)",
        f"error: {path}: checks[3].tolerance: must be >= 0.0 (got -1)",
        f"error: {path}: checks[4].kind: required: one of plan, verify, metric, compare",
    ]



def test_an_unknown_key_is_named_as_written_whatever_it_reads(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", f"recipe: {PAPERS / 'digits-mlp.yaml'}\nchecks: [{{kind: verify}}]\n"
                                       "foo[0]: 1\nlist: 2\n")
    code, out, err = run_cli(["check", str(path)], capsys)
    assert code == 2 and out == ""
    assert [line.split(": unknown key")[0] for line in err.splitlines()] == [
        f"error: {path}: foo[0]", f"error: {path}: list"]


BAD_REFERENCES = f"""\
recipe: {PAPERS / "goyal2017-resnet50.yaml"}
budget: {{micro_batch_max: 32}}
runs:
  small: {{overrides: {{optimizer: {{lr: -1}}}}}}
  other: {{recipe: no-such-recipe.yaml}}
  nobudget: {{budget: {{micro_batch_max: null}}}}
checks:
  - {{kind: plan, run: smal}}
  - {{kind: plan, expect: {{micro_bach: 32}}}}
  - {{kind: metric, metric: eval_accuracy, min: 0.5}}
  - {{kind: metric, metric: top1_error, reported: top1_accuracy}}
  - {{kind: plan, run: nobudget}}
"""


def test_reference_errors_exit_2_one_line_each(tmp_path, capsys):
    path = write(tmp_path, "refs.yaml", BAD_REFERENCES)
    code, _, err = run_cli(["check", str(path)], capsys)
    assert code == 2
    assert err.splitlines() == [
        f"error: {path}: runs.small.overrides: optimizer.lr: must be > 0.0 (got -1)",
        f"error: {path}: runs.other.recipe: no recipe file 'no-such-recipe.yaml' (looked beside the check file, "
        "in the working directory and among the shipped recipes)",
        f"error: {path}: checks[0].run: no run named 'smal' (did you mean 'small'?)",
        f"error: {path}: checks[1].expect.micro_bach: not a plan field (did you mean 'micro_batch'?)",
        f"error: {path}: checks[2].kind: a metric check trains run 'main', but its data 'imagenet-1k' is "
        "available: false; use a plan check",
        f"error: {path}: checks[2].kind: a metric check trains run 'main', but its data 'imagenet-1k' is "
        "available: false; use a plan check".replace("checks[2]", "checks[3]"),
        f"error: {path}: checks[3].reported: the recipe reports no 'top1_accuracy' (it reports: top1_error)",
        f"error: {path}: checks[4]: budget.micro_batch_max: required to plan run 'nobudget' (the largest "
        "micro-batch that fits one device)",
    ]


def test_errors_of_every_file_before_anything_runs(tmp_path, capsys):
    write(tmp_path, "a.yaml", "recipe: x.yaml\nchecks: []\n")
    write(tmp_path, "b.yaml", "- not a mapping\n")
    write(tmp_path, "notes.md", "not a check file\n")
    code, _, err = run_cli(["check", str(tmp_path)], capsys)
    assert code == 2
    assert err.splitlines() == [
        f"error: {tmp_path / 'a.yaml'}: checks: expected at least 1 item (got [])",
        f"error: {tmp_path / 'b.yaml'}: expected a mapping of check fields at the top level (got list)",
    ]


PLAN_ONLY = f"""\
# Goyal et al. on one node of 8 GPUs that fit the paper's 32 per GPU
recipe: {PAPERS / "goyal2017-resnet50.yaml"}
budget: {{micro_batch_max: 32, world_size: 8, memory: 80GiB}}
checks:
  - kind: plan
    expect: {{micro_batch: 32, accumulation_steps: 32, effective_batch: 8192, exact: true, lr: 3.2,
             optimizer_steps: 14040, warmup_steps: 780, decay_milestones: [4680, 9360, 12480]}}
  - kind: plan
    name: wrong on purpose
    expect: {{accumulation_steps: 16, lr: 0.1}}
"""


def test_plan_checks_pass_and_fail_with_reports(tmp_path, capsys):
    path = write(tmp_path, "goyal.yaml", PLAN_ONLY)
    junit, summary = tmp_path / "out" / "junit.xml", tmp_path / "out" / "summary.md"
    code, out, _ = run_cli(["check", str(path), "--junit", str(junit), "--summary", str(summary)], capsys)
    assert code == 1
    assert "1 passed, 1 failed" in out
    counts = junit_counts(junit)
    assert (counts["tests"], counts["failures"], counts["errors"], counts["cases"]) == (2, 1, 0, 2)
    assert counts["failed"] == ["wrong on purpose"]
    failure = ET.parse(junit).getroot().find("./testsuite/testcase/failure")
    assert "accumulation_steps: expected 16, the plan has 32" in failure.text
    assert "lr: expected 0.1, the plan has 3.2" in failure.text
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("## reproduce check: 1 passed, 1 failed")
    assert "| status | file | check | measured | expected | seconds |" in text
    assert "32 x 32 x 8 = 8192 samples, lr 3.2, 14040 steps" in text
    assert "### Failures" in text and "wrong on purpose" in text


def test_shipped_digits_check_end_to_end(tmp_path, capsys):
    """The real check `make test` runs: train, verify, compare, and both reports."""
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    work = tmp_path / "work"
    code, out, err = run_cli(
        ["check", str(SUITE / "digits-mlp.yaml"), "--junit", str(junit), "--summary", str(summary),
         "--work", str(work)], capsys,
    )
    assert code == 0, out + err
    counts = junit_counts(junit)
    assert counts["failures"] == counts["errors"] == 0 and counts["tests"] == counts["cases"] >= 5
    text = summary.read_text(encoding="utf-8")
    assert "| ✅ pass | digits-mlp.yaml | eval_accuracy |" in text
    assert (work / "digits-mlp" / "main" / "seed-0" / "metrics.jsonl").is_file()
    assert (work / "digits-mlp" / "plain" / "seed-0" / "summary.json").is_file()


FAILING = f"""\
recipe: {PAPERS / "digits-mlp.yaml"}
budget: {{micro_batch_max: 64, max_steps: 3}}
checks:
  - {{kind: metric, name: too good to be true, metric: eval_accuracy, min: 0.99}}
  - {{kind: metric, metric: eval_recall, min: 0.5}}
  - {{kind: metric, metric: eval_accuracy, max: 0.99}}
"""


def test_failing_and_erroring_checks_exit_1(tmp_path, capsys):
    path = write(tmp_path, "fails.yaml", FAILING)
    junit = tmp_path / "junit.xml"
    code, out, err = run_cli(["check", str(path), "--junit", str(junit)], capsys)
    assert code == 1
    counts = junit_counts(junit)
    assert (counts["tests"], counts["failures"], counts["errors"]) == (3, 1, 1)
    assert counts["failed"] == ["too good to be true"] and counts["errored"] == ["eval_recall"]
    assert "metric 'eval_recall': not in the run's results" in out
    assert "1 passed, 1 failed, 1 errors" in out
    assert "training 'main' seed 0: 64 x 4 x 1 = 256, 3 steps" in err  # trained once, shared by the checks


def test_never_writes_over_user_files(tmp_path, capsys):
    path = write(tmp_path, "goyal.yaml", PLAN_ONLY)
    original = path.read_text(encoding="utf-8")
    code, _, err = run_cli(["check", str(path), "--junit", str(path)], capsys)
    assert code == 2 and "--junit" in err and "the input file itself" in err
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me", encoding="utf-8")
    code, _, err = run_cli(["check", str(path), "--work", str(folder)], capsys)
    assert code == 2 and "holds other files" in err
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "keep me"
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert path.read_text(encoding="utf-8") == original


def test_overrides_merge_and_remove():
    base = {"optimizer": {"name": "sgd", "lr": 0.4}, "schedule": {"warmup": {"epochs": 2}, "total": {"epochs": 30}}}
    merged = merge(base, {"optimizer": {"lr": 0.05}, "schedule": {"warmup": None}})
    assert merged == {"optimizer": {"name": "sgd", "lr": 0.05}, "schedule": {"total": {"epochs": 30}}}
    assert base["optimizer"]["lr"] == 0.4  # the original is untouched


def test_every_shipped_check_file_is_valid(capsys):
    from reproduce.check import collect, load_all

    files = load_all(collect([SUITE]))
    assert len(files) >= 4
    kinds = {check.kind for f in files for check in f.spec.checks}
    assert kinds == {"plan", "verify", "metric", "compare"}


REPORTED = f"""\
recipe: {PAPERS / "digits-mlp.yaml"}
budget: {{micro_batch_max: 64, max_steps: 2}}
runs:
  reported:
    overrides:
      reported: [{{metric: eval_accuracy, value: 0.5, tolerance: 0.5}},
                 {{metric: accuracy_percent, value: 150, evaluated: false}}]
checks:
  - {{kind: metric, run: reported, name: within the reported tolerance, metric: eval_accuracy,
     reported: eval_accuracy}}
  - {{kind: metric, run: reported, name: as a percentage, metric: eval_accuracy, scale: 100,
     reported: accuracy_percent, tolerance: 150}}
  - {{kind: metric, run: reported, name: outside it, metric: eval_accuracy, scale: 100,
     reported: accuracy_percent, tolerance: 49}}
"""


def test_metric_relative_to_the_reported_value(tmp_path, capsys):
    path = write(tmp_path, "reported.yaml", REPORTED)
    junit = tmp_path / "junit.xml"
    code, out, _ = run_cli(["check", str(path), "--junit", str(junit)], capsys)
    assert code == 1
    counts = junit_counts(junit)
    assert (counts["tests"], counts["failures"], counts["errors"]) == (3, 1, 0)
    assert counts["failed"] == ["outside it"]
    assert "reported 150 +- 49" in out


def test_sample_data_is_written_first_and_given_as_the_data_path(tmp_path, capsys):
    """`sample_data: segmentation`: the shape scenes in a temporary VOC folder, the file's recipe (data not here,
    available: false) planned and run on it; without the field the same file is refused (data not here)."""
    from reproduce.check import load_check_file
    from reproduce.errors import UserError

    text = f"""\
recipe: {PAPERS / "shapes-mini-segmentation.yaml"}
sample_data: segmentation
budget: {{micro_batch_max: 2, device: cpu}}
checks:
  - {{kind: plan, expect: {{micro_batch: 2, accumulation_steps: 8, exact: true}}}}
  - {{kind: verify, samples: 4}}
"""
    loaded = load_check_file(write(tmp_path, "seg.yaml", text))
    data = loaded.runs["main"].recipe.data
    assert data.available and (Path(data.path) / "ImageSets" / "Segmentation" / "train.txt").is_file()
    assert len((Path(data.path) / "ImageSets" / "Segmentation" / "val.txt").read_text().split()) == 40
    code, out, err = run_cli(["check", str(tmp_path / "seg.yaml")], capsys)
    assert code == 0, out + err
    assert "2 passed" in out
    with pytest.raises(UserError) as refused:
        load_check_file(write(tmp_path, "no-data.yaml", text.replace("sample_data: segmentation\n", "")))
    assert "data 'shape-scenes' is" in refused.value.lines[0]
