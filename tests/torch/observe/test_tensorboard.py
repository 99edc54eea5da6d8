"""The TensorBoard tracker: metrics records as TensorBoard scalars (skips without tensorboard)."""

from __future__ import annotations

import sys

import pytest

from helpers import read_scalars
from reproduce.errors import UserError
from reproduce.observe.tracker_backends import TensorboardTracker
from reproduce.observe.trackers import numeric, parse_log_to

NO_TENSORBOARD = "tensorboard not installed (optional extra: pip install -e .[tensorboard]; make setup installs it)"


def test_missing_tensorboard_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match="`log_to` tensorboard: the tensorboard package is not installed"):
        parse_log_to([], tensorboard=True)


def test_every_numeric_field_at_its_step(tmp_path):
    pytest.importorskip("tensorboard", reason=NO_TENSORBOARD)
    tracker = TensorboardTracker()
    tracker.open(None, tmp_path, 0, None)
    tracker.log(1, numeric({"step": 1, "loss": 2.0, "lr": 0.01, "skipped": False, "data": "x", "samples": 64}))
    tracker.log(2, numeric({"step": 2, "loss": 1.5, "lr": 0.02, "skipped": False, "eval_loss": 1.7}))
    tracker.finish({}, {})
    found = read_scalars(tmp_path / "tensorboard")
    assert found["train/loss"] == [(1, 2.0), (2, 1.5)] and found["train/samples"] == [(1, 64.0)]
    assert found["train/lr"] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02))]
    assert found["eval/loss"] == [(2, pytest.approx(1.7))] and found["train/skipped"] == [(1, 0.0), (2, 0.0)]
    assert "train/data" not in found


def test_the_tracker_logs_a_real_run(tmp_path, one_thread):
    pytest.importorskip("tensorboard", reason=NO_TENSORBOARD)
    from reproduce.observe.trackers import Trackers
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe
    from reproduce.train.reporter import Reporters, run_start
    from reproduce.train.trainer import RunRequest, SilentReporter, read_metrics, train

    recipe = load_recipe("papers/digits-mlp.yaml")
    plan = make_plan(recipe, 64, dataset_size=1437)
    reporter = Reporters(Trackers(["tensorboard"], tmp_path / "run"), SilentReporter())
    train(plan, RunRequest(tmp_path / "run", device="cpu", max_steps=3), reporter=reporter)
    found = read_scalars(tmp_path / "run" / "tensorboard")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [step for step, _ in found["train/loss"]] == [1, 2, 3]
    assert [value for _, value in found["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    # resumed after a checkpoint at step 2: TensorBoard drops the old step 3 and keeps the new one
    train(plan, RunRequest(tmp_path / "again", device="cpu", max_steps=2, checkpoint_every=1))
    first = Trackers(["tensorboard"], tmp_path / "again")
    first.start(run_start(plan, 2, 0))
    for record in read_metrics(tmp_path / "again" / "metrics.jsonl"):
        first.log({**record, "loss": 99.0})
    first.log({"step": 3, "loss": 99.0})  # logged, then lost: the run died before its checkpoint
    first.__exit__(None, None, None)  # (closed as a killed run's are)
    resumed = Reporters(Trackers(["tensorboard"], tmp_path / "again"), SilentReporter())
    train(plan, RunRequest(tmp_path / "again", device="cpu", max_steps=3, resume=True), reporter=resumed)
    losses = read_scalars(tmp_path / "again" / "tensorboard")["train/loss"]
    assert [step for step, _ in losses] == [1, 2, 3]  # one value per step: the stale step 3 was purged
    assert losses[0][1] == losses[1][1] == 99.0 and losses[2][1] != 99.0
