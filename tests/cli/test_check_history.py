"""`reproduce check --history FILE` end to end: each check's value appended with the commit, date and machine, and
a `drift:` check failing in one line when its value left the band of its own history (one short training run; the
band's arithmetic is tests/core/test_check_history.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproduce.cli import main

ROOT = Path(__file__).resolve().parents[2]

# one run (3 steps), compared with itself: a - b is exactly 0 on every rerun, so the history decides the verdict
CHECKS = f"""\
recipe: {ROOT / "papers" / "digits-mlp.yaml"}
budget: {{micro_batch_max: 64, max_steps: 3}}
checks:
  - {{kind: plan}}
  - {{kind: metric, name: accuracy, metric: eval_accuracy, drift: {{tolerance: 0.01}}}}
  - {{kind: compare, name: steady, a: main, b: main, metric: loss, drift: {{tolerance: 0.01}}}}
  - {{kind: compare, name: moved, a: main, b: main, metric: loss, drift: {{last: 3, tolerance: 0.01}}}}
"""


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_history_records_every_value_and_a_value_beyond_its_band_fails(tmp_path, capsys, one_thread):
    path = tmp_path / "checks.yaml"
    path.write_text(CHECKS, encoding="utf-8")
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


def test_a_bad_history_is_refused_before_anything_runs(tmp_path, capsys):
    path = tmp_path / "checks.yaml"
    path.write_text(CHECKS, encoding="utf-8")
    history = tmp_path / "h.jsonl"
    history.write_text('{"file": "checks.yaml", "check": "moved", "value": 1}\nnot json\n', encoding="utf-8")
    code, out, err = run_cli(["check", str(path), "--history", str(history)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: --history: {history}: line 2: not JSON")
    code, _, err = run_cli(["check", str(path), "--history", str(path)], capsys)
    assert code == 2 and "the input file itself" in err
    code, _, err = run_cli(["check", str(path), "--history", str(tmp_path)], capsys)
    assert code == 2 and "is a folder" in err
