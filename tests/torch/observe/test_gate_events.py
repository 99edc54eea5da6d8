"""The trackers get each gate as an event: its status and measured value as scalars at the gate's step (MLflow read
back with its own client, TensorBoard with its event reader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import read_scalars
from reproduce.observe.tracker_backends import GATE_STATUS
from reproduce.observe.trackers import Trackers

DIGITS = str(Path(__file__).resolve().parents[3] / "papers" / "digits-mlp.yaml")


class Quiet:
    def __init__(self):
        self.gates = []

    def start(self, start): ...
    def step(self, record): ...
    def message(self, text): ...
    def finish(self, summary): ...

    def gate(self, event):
        self.gates.append(event)


def gated_run(tmp_path, trackers: list[str]) -> tuple[Path, list[dict]]:
    """Five steps of the digits run with two gates (one passes, one warns), logged to `trackers`."""
    from reproduce.plan.overlay import Change, overlay
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe
    from reproduce.train.reporter import Reporters
    from reproduce.train.trainer import RunRequest, train

    gates = [{"name": "low", "at": {"step": 2}, "metric": "loss", "max": 100.0},
             {"name": "high", "at": {"step": 4}, "metric": "loss", "max": 0.01, "action": "warn"}]
    recipe = overlay(load_recipe(DIGITS), [Change("gates", gates)], DIGITS)
    plan = make_plan(recipe, 64, dataset_size=1437, recipe_path=DIGITS)
    out, inner = tmp_path / "run", Quiet()
    with Trackers(trackers, out) as tracked:
        train(plan, RunRequest(out, device="cpu", max_steps=5, no_noise_scale=True), reporter=Reporters(tracked, inner))
    assert [(e["name"], e["status"]) for e in inner.gates] == [("low", "passed"), ("high", "warned")]
    return out, inner.gates


def test_tensorboard_gets_the_gates(tmp_path, one_thread):
    pytest.importorskip("tensorboard")
    out, _ = gated_run(tmp_path, ["tensorboard"])
    scalars = read_scalars(out / "tensorboard")
    assert scalars["train/gate/low/status"] == [(2, 1.0)] and scalars["train/gate/high/status"] == [(4, 0.0)]
    assert len(scalars["train/gate/high/loss"]) == 1 and scalars["train/gate/high/loss"][0][1] > 0.01


def test_mlflow_gets_the_gates(tmp_path, monkeypatch, one_thread):
    pytest.importorskip("mlflow")
    import json

    from mlflow import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    out, gates = gated_run(tmp_path, ["mlflow"])
    state = json.loads((out / "trackers.json").read_text())
    client = MlflowClient(state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    for event in gates:
        status = client.get_metric_history(run_id, f"gate/{event['name']}/status")
        assert [(m.step, m.value) for m in status] == [(event["step"], GATE_STATUS[event["status"]])]
        value = client.get_metric_history(run_id, f"gate/{event['name']}/loss")
        assert [(m.step, m.value) for m in value] == [(event["step"], pytest.approx(event["value"]))]
