"""`reproduce report`: real runs' folders into one self-contained HTML file (read back with html.parser) and its
Markdown twin; runs overlaid, the paper's metric and its verdict, runs still going or resumed, folders that are
not runs."""

from __future__ import annotations

import base64
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[2]
NO_PLOTS = "matplotlib is the plots extra (make setup installs it)"


class Page(HTMLParser):
    """What a browser would show: the images' sources, the tables' rows (with their classes), the text."""

    def __init__(self, text: str):
        super().__init__()
        self.images, self.tables, self.text, self.tags = [], [], [], []
        self._row = self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "img":
            self.images.append(attrs)
        elif tag == "table":
            self.tables.append({"class": attrs.get("class"), "rows": []})
        elif tag == "tr":
            self._row = {"class": attrs.get("class"), "cells": []}
            self.tables[-1]["rows"].append(self._row)
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._row["cells"].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def table(self, css: str) -> list[dict]:
        return next(t["rows"] for t in self.tables if t["class"] == css)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three short real runs: goyal-mini's baseline (batch 32) and 8x (256), and the digits MLP with the paper's
    metrics stated in its recipe (one within its tolerance, one outside it, one the run does not measure)."""
    import torch

    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe
    from reproduce.train.trainer import RunRequest, train

    root = tmp_path_factory.mktemp("runs")
    data = yaml.safe_load((ROOT / "papers" / "digits-mlp.yaml").read_text())
    data["reported"] = [{"metric": "top1_accuracy", "value": 50.0, "split": "test", "tolerance": 100.0},
                        {"metric": "top1_error", "value": 2.0, "tolerance": 0.5},
                        {"metric": "bleu", "value": 70.4, "evaluated": False}]
    (root / "digits-reported.yaml").write_text(yaml.safe_dump(data))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, recipe, micro, steps in (("base", ROOT / "papers" / "goyal-mini-digits-base.yaml", 32, 16),
                                           ("8x", ROOT / "papers" / "goyal-mini-digits-8x.yaml", 64, 2),
                                           ("stated", root / "digits-reported.yaml", 128, 2)):
            plan = make_plan(load_recipe(recipe), micro, dataset_size=1437, recipe_path=str(recipe))
            train(plan, RunRequest(root / name, device="cpu", max_steps=steps))
    finally:
        torch.set_num_threads(threads)
    return root


def report(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["report", *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_the_report_overlays_the_runs_in_one_self_contained_page(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason=NO_PLOTS)
    out = tmp_path / "report.html"
    code, stdout, _ = report([str(runs / "base"), str(runs / "8x"), "--out", str(out)], capsys)
    assert code == 0 and f"report written to {out}" in stdout
    page = Page(out.read_text())
    # nothing fetched: no script, no stylesheet link, every image embedded as PNG data
    assert not [tag for tag, _ in page.tags if tag in ("script", "link", "iframe")]
    assert page.images and all(img["src"].startswith("data:image/png;base64,") for img in page.images)
    for img in page.images:
        assert base64.b64decode(img["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    alts = [img["alt"] for img in page.images]
    assert alts == ["loss", "accuracy (evaluation)", "learning rate", "gradient norm", "throughput",
                    "gradient noise scale against the effective batch"]
    text = " ".join(page.text)
    assert "Runs: base, 8x." in text  # each figure names the runs it overlays
    rows = page.table("runs")
    assert [row["cells"][0] for row in rows[1:]] == ["base", "8x"]
    assert rows[0]["cells"][:4] == ["run", "folder", "status", "steps"]
    assert rows[1]["cells"][3] == "16 / 1,320" and rows[2]["cells"][3] == "2 / 150"
    assert "stopped early by --max-steps: 16 of 1320 optimizer steps" in rows[1]["cells"][2]
    plans = [t for t in page.tables if t["class"] == "plan"]
    assert len(plans) == 2
    base_plan = {row["cells"][0]: row["cells"][1:] for row in plans[0]["rows"][1:]}
    assert base_plan["effective batch"][1] == "32 x 1 x 1 = 32 samples"
    eight = {row["cells"][0]: row["cells"][1:] for row in plans[1]["rows"][1:]}
    assert eight["effective batch"] == ["256 samples = 8 devices x 32", "64 x 4 x 1 = 256 samples"]
    assert eight["warm-up"][1] == "10 optimizer steps from lr 0.05"
    assert "The recipe reports no metric to compare with" in text
    # the Markdown twin: the same tables, the plots as files beside it
    markdown = (tmp_path / "report.md").read_text()
    assert "| base |" in markdown and "| 8x |" in markdown
    links = [line[line.index("](") + 2:-1] for line in markdown.splitlines() if line.startswith("![")]
    assert len(links) == 6 and all((tmp_path / link).is_file() for link in links)


def test_runs_of_different_batches_share_an_epoch_axis_and_one_batch_the_step(runs):
    from reproduce.report import load_runs
    from reproduce.report.figures import x_axis

    assert x_axis(load_runs([runs / "base", runs / "8x"])) == "epoch"
    assert x_axis(load_runs([runs / "8x"])) == "step"


def test_the_papers_metric_beside_the_runs_final_value_with_the_verdict(runs, tmp_path, capsys):
    out = tmp_path / "stated.html"
    code, stdout, _ = report([str(runs / "stated"), "--out", str(out), "--no-plots"], capsys)
    assert code == 0
    accuracy = json.loads((runs / "stated" / "summary.json").read_text())["final"]["eval_accuracy"]
    page = Page(out.read_text())
    assert page.images == []
    rows = page.table("verdict")
    assert rows[0]["cells"] == ["run", "paper's metric", "paper", "tolerance", "this run", "verdict", "note"]
    found = {row["cells"][1]: (row["class"], row["cells"]) for row in rows[1:]}
    css, cells = found["top1_accuracy (test)"]
    assert css == "pass" and cells[5] == "within tolerance" and cells[2] == "0.5" and cells[3] == "+- 1"
    assert cells[4] == f"{accuracy:.4g} (eval_accuracy, step 2)"  # one scale: fractions, as the run records them
    assert "has not trained the paper's 300 steps" in cells[6]
    css, cells = found["top1_error"]
    assert css == "fail" and cells[5] == "outside tolerance"
    assert cells[4] == f"{1 - accuracy:.4g} (1 - eval_accuracy, step 2)"
    css, cells = found["bleu"]
    assert css == "none" and cells[5] == "not measured by this run" and cells[4] == "-"
    assert f"top1_accuracy: paper 0.5 +- 1, this run {accuracy:.4g}: within tolerance" in stdout


def test_a_run_still_going_and_a_resumed_run_are_reported_as_far_as_they_got(runs, tmp_path, capsys):
    from reproduce.plan.planfile import load_plan
    from reproduce.train.trainer import RunRequest, train

    going = tmp_path / "going"
    shutil.copytree(runs / "8x", going)
    (going / "summary.json").unlink()
    with open(going / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "loss": 1.2')  # the line being written right now
    code, _, _ = report([str(going), "--no-plots"], capsys)
    assert code == 0
    rows = Page((going / "report.html").read_text()).table("runs")
    assert rows[1]["cells"][2] == "in progress or stopped: 2 of 150 optimizer steps so far"

    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "8x", resumed)
    train(load_plan(resumed / "plan.yaml"), RunRequest(resumed, device="cpu", max_steps=3, resume=True))
    code, _, _ = report([str(resumed), "--no-plots"], capsys)
    rows = Page((resumed / "report.html").read_text()).table("runs")
    assert rows[1]["cells"][2] == "stopped early by --max-steps: 3 of 150 optimizer steps (resumed after step 2)"
    assert rows[1]["cells"][3] == "3 / 150"


@pytest.mark.parametrize("case", ["not a run", "empty", "missing", "a file"])
def test_a_folder_that_is_not_a_run_is_one_line_exit_2(case, tmp_path, capsys):
    folder = tmp_path / "folder"
    if case == "not a run":
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    elif case == "empty":
        folder.mkdir()
    elif case == "a file":
        folder.write_text("x")
    code, _, err = report([str(folder)], capsys)
    expected = {"not a run": "not a run of reproduce (no plan.yaml; it holds notes.txt)",
                "empty": "not a run of reproduce (no plan.yaml; it is empty)", "missing": "no such folder",
                "a file": "not a folder"}[case]
    assert code == 2 and err.count("\n") == 1 and expected in err and err.startswith(f"error: {folder}: ")
    if folder.is_dir():
        assert sorted(p.name for p in folder.iterdir()) == (["notes.txt"] if case == "not a run" else [])


def test_a_folder_of_runs_names_the_runs_to_give(runs, capsys):
    code, _, err = report([str(runs)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"it holds run folders: give them, e.g. reproduce report {runs / '8x'} {runs / 'base'}" in err


def test_the_report_never_writes_over_the_runs_own_files(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / "8x", run)
    before = (run / "metrics.jsonl").read_bytes()
    code, _, err = report([str(run), "--out", str(run / "metrics.html"), "--markdown", str(run / "metrics.jsonl")],
                          capsys)
    assert code == 2 and "is one of the run's own files" in err and (run / "metrics.jsonl").read_bytes() == before
    code, _, err = report([str(run), str(runs / "base")], capsys)
    assert code == 2 and "--out: required with several runs" in err


def test_check_writes_the_report_of_its_checks_beside_its_junit_file(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason=NO_PLOTS)
    check = tmp_path / "mini.yaml"
    check.write_text(f"""\
recipe: {ROOT / "papers" / "digits-mlp.yaml"}
budget: {{micro_batch_max: 64, max_steps: 3}}
runs:
  plain: {{budget: {{micro_batch_max: 256}}}}
checks:
  - {{kind: metric, name: learns something, metric: eval_accuracy, min: 0.05}}
  - {{kind: metric, name: too good to be true, metric: eval_accuracy, min: 0.99}}
  - {{kind: compare, a: main, b: plain, metric: loss, tolerance: 1.0e-4}}
""")
    junit = tmp_path / "out" / "junit.xml"
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(check), "--junit", str(junit)])
    assert exit_.value.code == 1
    assert f"HTML report written to {tmp_path / 'out' / 'junit.html'}" in capsys.readouterr().out
    page = Page((tmp_path / "out" / "junit.html").read_text())
    assert "reproduce check: 2 passed, 1 failed" in " ".join(page.text)
    rows = page.table("checks")
    assert [(row["class"], row["cells"][2]) for row in rows[1:]] == [
        ("pass", "learns something"), ("fail", "too good to be true"), ("pass", "loss: main vs plain")]
    assert [img["alt"] for img in page.images][:2] == ["mini: loss", "mini: accuracy (evaluation)"]
    assert "Runs: main/seed-0, plain/seed-0." in " ".join(page.text)  # the two runs overlaid
    assert not list((tmp_path / "out").glob("*/seed-0"))  # the temporary runs are gone, their curves kept
