"""Drift across reruns (check/history.py): the JSONL history's band of a check's last passing values, the `drift:`
schema, and a bad history refused in one line. The end-to-end run is tests/cli/test_check_history.py (`check
--history`, `report --history`)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from reproduce.check.history import History, drift_verdict
from reproduce.check.schema import Drift, MetricCheck
from reproduce.errors import UserError


def write_history(path, values, check="accuracy", status="pass"):
    with path.open("a", encoding="utf-8") as handle:
        for value in values:
            handle.write(json.dumps({"file": "a.yaml", "check": check, "value": value, "status": status}) + "\n")


def test_the_band_is_the_mean_of_the_last_passing_values_plus_the_widest_width(tmp_path):
    path = tmp_path / "h.jsonl"
    write_history(path, [0.50, 0.90, 0.91, 0.93])
    write_history(path, [0.10], status="fail")  # recorded, not counted
    write_history(path, [7.0], check="other")  # another check's
    history = History(path)
    band, runs = history.band("a.yaml", "accuracy", Drift(last=3, tolerance=0.01))
    assert runs == 3 and band.mean == pytest.approx(0.9133333) and band.half_width == 0.01
    assert (band.low, band.high) == (0.90, 0.93)
    band, _ = history.band("a.yaml", "accuracy", Drift(last=3, tolerance=0.01, rel_tolerance=0.05, sigmas=1))
    assert band.half_width == pytest.approx(0.05 * 0.9133333)  # the widest of 0.01, 5 % and 1 sigma (0.0153)
    band, _ = history.band("a.yaml", "accuracy", Drift(last=3, sigmas=3))
    assert band.half_width == pytest.approx(3 * 0.0152753, rel=1e-4)


def test_a_slow_creep_is_caught_once_it_leaves_the_band(tmp_path):
    """Each rerun 0.002 lower, well within a band of +- 0.005 around the last 5 runs' mean, yet caught at the fourth
    (0.008 below where it started); the values that failed stay out of the band, which stops following them."""
    path = tmp_path / "h.jsonl"
    drift = Drift(last=5, tolerance=0.005)
    write_history(path, [0.95] * 5)
    value, verdicts = 0.95, []
    for _ in range(6):
        value -= 0.002
        holds, _, line, _ = drift_verdict(History(path), "a.yaml", "accuracy", value, drift)
        verdicts.append(holds)
        write_history(path, [value], status="pass" if holds else "fail")
    assert verdicts == [True, True, True, False, False, False]
    holds, expected, line, band = drift_verdict(History(path), "a.yaml", "accuracy", 0.94, drift)
    assert not holds and band.to_json() == {"mean": pytest.approx(0.9476), "half_width": 0.005, "runs": 5}
    assert line.startswith("drift: 0.94 moved -0.0076 from 0.9476 +- 0.005 of its last 5 passing runs in ")
    assert line.endswith("(0.944 .. 0.95), beyond the band") and expected.startswith("within 0.9476 +- 0.005")


def test_too_few_values_or_no_history_is_not_checked(tmp_path):
    path = tmp_path / "h.jsonl"
    write_history(path, [0.9])
    assert drift_verdict(History(path), "a.yaml", "accuracy", 0.1, Drift(tolerance=0.01))[:2] == (
        True, "drift: 1 of 2 runs")
    holds, _, line, _ = drift_verdict(None, "a.yaml", "accuracy", 0.1, Drift(tolerance=0.01))
    assert holds and "give --history FILE" in line
    assert History(tmp_path / "new.jsonl").records == []


@pytest.mark.parametrize("drift, message", [
    ({"last": 3}, "give tolerance, rel_tolerance or sigmas"),
    ({"tolerance": 0.1, "last": 2, "min_runs": 3}, "min_runs: 3 is more than the last 2 values"),
    ({"sigmas": 2, "min_runs": 1}, "min_runs: sigmas needs a standard deviation"),
    ({"tolerance": -1}, "greater than 0"),
    ({"tolerance": 0.1, "lats": 3}, "lats"),
])
def test_a_bad_drift_is_refused(drift, message):
    with pytest.raises(ValidationError, match=message):
        MetricCheck(kind="metric", metric="eval_accuracy", drift=drift)
    assert MetricCheck(kind="metric", metric="loss", drift={"tolerance": 0.1}).drift == Drift(tolerance=0.1)


def test_a_history_line_that_is_not_a_record_is_one_line(tmp_path):
    path = tmp_path / "h.jsonl"
    write_history(path, [0.9])
    with path.open("a", encoding="utf-8") as handle:
        handle.write("{not json\n")
    with pytest.raises(UserError) as caught:
        History(path)
    assert caught.value.lines == [f"`history`: {path}: line 2: not JSON (Expecting property name enclosed in double "
                                  "quotes); a history holds one JSON object a line, as `history` of reproduce check "
                                  "writes them"]
    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 1: expected an object with file, check and value"):
        History(path)
