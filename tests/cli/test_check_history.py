"""`reproduce check --history FILE` end to end: each check's value appended with the commit, date and machine, and
a `drift:` check failing in one line when its value left the band of its own history (one short training run; the
band's arithmetic is tests/core/test_drift_band.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[2]

# one run (3 steps), compared with itself: a - b is exactly 0 on every rerun, so the history decides the verdict
CHECKS = """\
recipe: recipe.yaml
budget: {micro_batch_max: 64, max_steps: 3}
checks:
  - {kind: plan}
  - {kind: metric, name: accuracy, metric: eval_accuracy, drift: {tolerance: 0.01}}
  - {kind: compare, name: steady, a: main, b: main, metric: loss, drift: {tolerance: 0.01}}
  - {kind: compare, name: moved, a: main, b: main, metric: loss, drift: {last: 3, tolerance: 0.01}}
"""


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


# the digits recipe with a paper's value for its accuracy (made up: the demo has no paper), which the history keeps
REPORTED = "\nreported: [{metric: eval_accuracy, value: 0.95, tolerance: 0.02}]\n"


def files(tmp_path: Path) -> Path:
    recipe = (ROOT / "papers" / "digits-mlp.yaml").read_text(encoding="utf-8") + REPORTED
    (tmp_path / "recipe.yaml").write_text(recipe, encoding="utf-8")
    path = tmp_path / "checks.yaml"
    path.write_text(CHECKS, encoding="utf-8")
    return path


def test_history_records_every_value_and_a_value_beyond_its_band_fails(tmp_path, capsys, one_thread):
    """...and `report --history` draws each check's values beside the paper's."""
    path = files(tmp_path)
    history = tmp_path / "history" / "checks.jsonl"
    history.parent.mkdir()
    earlier = [{"file": "checks.yaml", "check": "steady", "value": v, "status": "pass"} for v in (0.0, 0.005)]
    earlier += [{"file": "checks.yaml", "check": "moved", "value": v, "status": "pass"} for v in (0.3, 0.5, 0.4, 0.5)]
    history.write_text("".join(json.dumps(r) + "\n" for r in earlier), encoding="utf-8")
    junit = tmp_path / "junit.xml"
    code, out, err = run_cli(["check", str(path), "--history", str(history), "--junit", str(junit)], capsys)
    assert code == 1, out + err
    assert "3 passed, 1 failed" in out and "4 values appended to the history" in out
    assert "[4/4] checks.yaml: moved: FAIL" in err
    failure = junit.read_text(encoding="utf-8")
    assert (f"drift: 0 moved -0.467 from 0.4667 +- 0.01 of its last 3 passing runs in {history} (0.4 .. 0.5), "
            "beyond the band") in failure
    assert f"drift: 0 within 0.0025 +- 0.01 of its last 2 passing runs in {history}" in failure
    assert f"drift: not checked yet: 0 passing value(s) in {history}, the band needs 2" in failure
    records = [json.loads(line) for line in history.read_text(encoding="utf-8").splitlines()]
    assert len(records) == len(earlier) + 4 and records[:len(earlier)] == earlier  # appended, the rest kept
    new = {r["check"]: r for r in records[len(earlier):]}
    assert new["plan invariants"]["value"] is None and new["moved"]["status"] == "fail"
    assert new["moved"]["value"] == 0.0 and new["moved"]["values"][0] == new["moved"]["values"][1]
    accuracy = new["accuracy"]
    assert accuracy["metric"] == "eval_accuracy" and 0 <= accuracy["value"] <= 1 and accuracy["status"] == "pass"
    assert accuracy["commit"] is None or len(accuracy["commit"]) == 40  # (tmp_path: outside any git checkout)
    assert accuracy["date"].endswith("+00:00") and accuracy["machine"]["cpus"] >= 1
    assert accuracy["machine"]["torch"] and accuracy["reproduce"]
    assert accuracy["paper"] == {"metric": "eval_accuracy", "value": 0.95, "tolerance": 0.02}
    assert new["steady"]["paper"] is None and new["accuracy"]["band"] is None  # (no history for it yet)
    assert new["moved"]["band"] == {"mean": pytest.approx(0.4666667), "half_width": 0.01, "runs": 3}

    code, out, err = run_cli(["report", "--history", str(history), "--out", str(tmp_path / "drift.html")], capsys)
    assert code == 0, err
    written = f"report written to {tmp_path / 'drift.html'} and {tmp_path / 'drift.md'} (+ 3 plots)"
    assert written in " ".join(out.split())
    markdown = (tmp_path / "drift.md").read_text(encoding="utf-8")
    assert "## Drift across reruns (checks.jsonl)" in markdown
    assert f"| checks.yaml | accuracy | eval_accuracy | 1 | {accuracy['value']:.4g} .. " in markdown
    assert "| 0.95 +- 0.02 |" in markdown and "| checks.yaml | moved | loss | 5 | 0 .. 0.5 | 0 (fail) | - |" in markdown
    pngs = sorted(p.name for p in (tmp_path / "drift_files").iterdir())
    assert pngs == ["history_1.png", "history_2.png", "history_3.png"]
    assert (tmp_path / "drift_files" / "history_1.png").read_bytes().startswith(b"\x89PNG")
    assert 'alt="checks.yaml: accuracy"' in (tmp_path / "drift.html").read_text(encoding="utf-8")


def test_a_bad_history_is_refused_before_anything_runs(tmp_path, capsys):
    path = files(tmp_path)
    history = tmp_path / "h.jsonl"
    history.write_text('{"file": "checks.yaml", "check": "moved", "value": 1}\nnot json\n', encoding="utf-8")
    code, out, err = run_cli(["check", str(path), "--history", str(history)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: --history: {history}: line 2: not JSON")
    code, _, err = run_cli(["check", str(path), "--history", str(path)], capsys)
    assert code == 2 and "the input file itself" in err
    code, _, err = run_cli(["check", str(path), "--history", str(tmp_path)], capsys)
    assert code == 2 and "is a folder" in err
    code, _, err = run_cli(["report", "--history", str(history), "--out", str(tmp_path / "r.html")], capsys)
    assert code == 2 and err.strip().startswith(f"error: --history: {history}: line 2: not JSON")
    good = tmp_path / "good.jsonl"
    good.write_text('{"file": "checks.yaml", "check": "moved", "value": 1}\n', encoding="utf-8")
    code, _, err = run_cli(["report", "--history", str(good)], capsys)
    assert code == 2 and "--out: required with several runs or none" in err
    assert not (tmp_path / "r.html").exists()
