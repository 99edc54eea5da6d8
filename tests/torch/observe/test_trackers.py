"""`reproduce run --log-to tensorboard,wandb,mlflow` (observe/trackers.py) on real runs and the real libraries.

MLflow's own client reads its store back; W&B's offline run files are read with W&B's own protobuf records;
TensorBoard's event reader reads its folder. Never on the network: W&B offline, MLflow in the run folder.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

from reproduce.cli import main
from reproduce.errors import UserError
from reproduce.observe.tracker_backends import MlflowTracker, wandb_mode
from reproduce.observe.trackers import (
    STATE,
    Trackers,
    numeric,
    parse_log_to,
)

DIGITS = str(Path(__file__).resolve().parents[3] / "papers" / "digits-mlp.yaml")
NOT_INSTALLED = "the {} extra is not installed (make setup installs it: pip install -e .[wandb,mlflow])"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No API key, no network: W&B offline; MLflow in the run folder; nothing read from the user's settings."""
    for name in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)  # anything a library writes to its working directory lands here, not in the repo


def test_log_to_names_and_the_tensorboard_alias():
    assert parse_log_to(["mlflow,wandb"], tensorboard=True) == ["tensorboard", "wandb", "mlflow"]
    assert parse_log_to([" MLflow ", "mlflow"]) == ["mlflow"]
    assert parse_log_to(None) == []
    with pytest.raises(UserError, match="`log_to`: unknown tracker 'neptune'; expected .*tensorboard, wandb, mlflow"):
        parse_log_to(["mlflow,neptune"])


def test_every_numeric_field_is_logged_whatever_its_name():
    record = {"step": 4, "loss": 0.5, "partial": True, "samples_per_second": 812.5, "micro_batch": 32, "note": "x",
              "peak_memory_bytes": None, "mfu": 0.41}
    assert numeric(record) == {"loss": 0.5, "partial": 1.0, "samples_per_second": 812.5, "micro_batch": 32.0,
                               "mfu": 0.41}


def test_wandb_is_offline_without_an_api_key(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_a_missing_package_is_one_line_naming_the_extra_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UserError,
                       match=r"`log_to` wandb: the wandb package is not installed; .*reproduce-large-batch\[wandb\]"):
        parse_log_to(["tensorboard,wandb"])
    with pytest.raises(SystemExit) as exit_:
        main(["run", DIGITS, "--micro-batch-max", "64", "--out", str(tmp_path / "run"),
              "--log-to", "wandb"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'reproduce-large-batch[wandb]'" in err[0]
    assert not (tmp_path / "run").exists()


def wandb_records(out: Path) -> list:
    """Every record of the W&B offline runs in OUT/wandb, in the order they were written (resumed runs after the
    first), read from W&B's own transaction log: the LevelDB log format around W&B's `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        position, payload = 7, b""  # the file's header: ':W&B', magic 0xBEE1, version
        while position + 7 <= len(data):
            if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
                position += 32768 - position % 32768
                continue
            crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
            if length == 0 and kind == 0:
                break
            fragment = data[position + 7:position + 7 + length]
            assert zlib.crc32(bytes([kind]) + fragment) == crc, f"{path}: a torn record at byte {position}"
            payload += fragment
            position += 7 + length
            if kind in (1, 4):  # a whole record, or a record's last fragment
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                payload = b""
                records.append(record)
    return records


def items(entries) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in entries}


def wandb_history(out: Path) -> list[dict]:
    return [items(r.history.item) for r in wandb_records(out) if r.WhichOneof("record_type") == "history"]


def digits_plan(recipe_path=DIGITS):
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe

    return make_plan(load_recipe(recipe_path), 64, dataset_size=1437, recipe_path=recipe_path)


class Quiet:
    """The run's own reporter: keeps the messages, and can stop the run (raise) after a given step."""

    def __init__(self, stop_after: int | None = None):
        self.messages, self.stop_after = [], stop_after

    def start(self, start): ...

    def step(self, record):
        if self.stop_after is not None and record.step == self.stop_after:
            raise RuntimeError("the machine went away")

    def message(self, text):
        self.messages.append(text)

    def finish(self, summary): ...


def run(out: Path, names: list[str], reporter=None, backends=None, **options) -> dict:
    from reproduce.train.reporter import Reporters
    from reproduce.train.trainer import RunRequest, train

    reporter = reporter or Quiet()  # the trackers beside the run's own reporter, neither wrapping the other
    with Trackers(names, out, backends=backends) as trackers:
        return train(digits_plan(), RunRequest(out, device="cpu", **options), reporter=Reporters(trackers, reporter))


def test_mlflow_wandb_and_tensorboard_get_every_step_of_a_real_run(tmp_path, offline, one_thread):
    for module in ("mlflow", "wandb", "tensorboard", "matplotlib"):
        pytest.importorskip(module, reason=NOT_INSTALLED.format(module))
    from mlflow import MlflowClient

    from helpers import read_scalars
    from reproduce.observe.outputs import read_metrics

    out = tmp_path / "run"
    run(out, ["tensorboard", "wandb", "mlflow"], max_steps=5)
    records = read_metrics(out / "metrics.jsonl")
    state = json.loads((out / STATE).read_text())
    assert state["mlflow"]["tracking_uri"] == f"sqlite:///{out.absolute()}/mlflow/mlflow.db"
    assert {name: state[name]["step"] for name in state} == {"tensorboard": 5, "wandb": 5, "mlflow": 5}

    client = MlflowClient(state["mlflow"]["tracking_uri"])
    found = client.get_run(state["mlflow"]["run_id"])
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    params = found.data.params
    assert params["arithmetic"] == "64 x 4 x 1 = 256" and params["lr_rule"] == "exact"
    assert params["recipe.optimizer.lr"] == "0.2"
    assert params["plan.schedule.end_step"] == str(digits_plan().optimizer_steps)  # the plan file's parts
    for field in ("loss", "lr", "grad_norm", "samples", "seconds", "noise_scale", "eval_accuracy"):
        history = client.get_metric_history(found.info.run_id, field)
        assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r[field]))
                                                         for r in records if field in r], field
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"plan.yaml", "summary.json", "loss.svg", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(found.info.run_id, "plots")}
    assert plots == {f"plots/{name}.png" for name in ("loss", "eval_accuracy", "lr", "grad_norm", "throughput",
                                                      "noise_scale")}
    assert Path(found.info.artifact_uri.removeprefix("file://")).parent.parent.parent == out.absolute() / "mlflow"
    assert not (tmp_path / "mlruns").exists()  # nothing in the working directory

    rows = wandb_history(out)
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["loss"] for row in rows] == pytest.approx([r["loss"] for r in records])
    assert rows[-1]["eval_accuracy"] == pytest.approx(records[-1]["eval_accuracy"])
    files = list((out / "wandb").glob(f"offline-run-*-{state['wandb']['id']}/run-{state['wandb']['id']}.wandb"))
    assert len(files) == 1
    logged = wandb_records(out)
    config = items(next(r for r in logged if r.WhichOneof("record_type") == "run").run.config.update)
    assert config["arithmetic"] == "64 x 4 x 1 = 256" and config["recipe"]["optimizer"]["lr"] == 0.2
    artifact = next(r.artifact for r in logged if r.WhichOneof("record_type") == "artifact")
    assert {"plan.yaml", "summary.json", "plots/loss.png", "plots/noise_scale.png"} <= {
        entry.path for entry in artifact.manifest.contents}

    scalars = read_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]


def test_resume_continues_the_same_tracker_runs_without_a_duplicate_step(tmp_path, offline, one_thread):
    for module in ("mlflow", "wandb"):
        pytest.importorskip(module, reason=NOT_INSTALLED.format(module))
    from mlflow import MlflowClient

    from reproduce.observe.outputs import read_metrics

    out = tmp_path / "run"
    # checkpoint at step 3; the trackers log steps 4 and 5, then the run dies: they hold 1-5, metrics.jsonl 1-3
    with pytest.raises(RuntimeError, match="the machine went away"):
        run(out, ["wandb", "mlflow"], reporter=Quiet(stop_after=5), max_steps=8, checkpoint_every=3)
    state = json.loads((out / STATE).read_text())
    client = MlflowClient(state["mlflow"]["tracking_uri"])
    assert client.get_run(state["mlflow"]["run_id"]).info.status == "FAILED"
    run(out, ["wandb", "mlflow"], max_steps=8, resume=True)
    again = json.loads((out / STATE).read_text())
    assert again["mlflow"]["run_id"] == state["mlflow"]["run_id"] and again["wandb"]["id"] == state["wandb"]["id"]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    history = client.get_metric_history(state["mlflow"]["run_id"], "loss")
    assert [m.step for m in history] == list(range(1, 9))  # each step once
    # steps 4 and 5 keep the values logged before the crash: the resumed run recomputed them bitwise equal
    assert [m.value for m in history] == [r["loss"] for r in records]
    assert client.get_run(state["mlflow"]["run_id"]).info.status == "FINISHED"
    assert len({m.value for m in client.get_metric_history(state["mlflow"]["run_id"], "eval_accuracy")}) == 1

    folders = sorted((out / "wandb").glob(f"offline-run-*-{state['wandb']['id']}*"))
    assert len(folders) == 2  # the same W&B run id twice: `wandb sync` uploads them in order into one run
    rows = wandb_history(out)
    assert [row["_step"] for row in rows] == list(range(1, 9))
    assert [row["loss"] for row in rows] == pytest.approx([r["loss"] for r in records], rel=0, abs=0)


def test_a_tracker_added_on_resume_catches_up_from_metrics_jsonl(tmp_path, offline, one_thread):
    pytest.importorskip("mlflow", reason=NOT_INSTALLED.format("mlflow"))
    from mlflow import MlflowClient

    out = tmp_path / "run"
    run(out, [], max_steps=3)
    assert not (out / STATE).exists() and not (out / "mlflow").exists()  # no tracker: nothing of theirs
    run(out, ["mlflow"], max_steps=5, resume=True)
    state = json.loads((out / STATE).read_text())
    steps = [m.step for m in MlflowClient(state["mlflow"]["tracking_uri"]).get_metric_history(
        state["mlflow"]["run_id"], "loss")]
    assert steps == [1, 2, 3, 4, 5]


class DiskFull(MlflowTracker):
    """The real MLflow tracker, whose store fills up at step 3."""

    def log(self, step, values):
        if step >= 3:
            raise OSError(28, "No space left on device")
        super().log(step, values)


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, offline, one_thread):
    pytest.importorskip("mlflow", reason=NOT_INSTALLED.format("mlflow"))
    from mlflow import MlflowClient

    from reproduce.observe.outputs import read_metrics

    reporter = Quiet()
    out = tmp_path / "run"
    summary = run(out, ["mlflow"], reporter=reporter, backends={"mlflow": DiskFull}, max_steps=6)
    assert summary["steps"] == 6 and [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 7))
    warnings = [m for m in reporter.messages if m.startswith("warning: mlflow")]  # (a busy machine may add one
    assert len(warnings) == 1  # about the data loader)
    assert "mlflow logging stopped (step 3: OSError: [Errno 28] No space left on device)" in warnings[0]
    assert "metrics.jsonl has every step" in warnings[0]
    state = json.loads((out / STATE).read_text())
    client = MlflowClient(state["mlflow"]["tracking_uri"])
    assert [m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "loss")] == [1, 2]
    assert client.get_run(state["mlflow"]["run_id"]).info.status == "FAILED"  # closed, not left running


def test_the_cli_logs_to_mlflow_and_force_removes_the_old_tracker_runs(tmp_path, offline, capsys, monkeypatch):
    pytest.importorskip("mlflow", reason=NOT_INSTALLED.format("mlflow"))
    import mlflow

    out = tmp_path / "x"
    args = ["run", DIGITS, "--micro-batch-max", "64", "--out", str(out), "--max-steps", "2",
            "--log-to", "mlflow"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--tensorboard"])
    assert exit_.value.code == 0
    assert (out / "tensorboard").is_dir() and (out / "mlflow" / "mlflow.db").is_file()
    with pytest.raises(SystemExit):
        main([*args, "--force"])
    assert not (out / "tensorboard").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{out}/mlflow/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["digits-mlp"], output_format="list")
    assert len(runs) == 1 and sorted(runs[0].data.metrics) == sorted(numeric(json.loads(
        (out / "metrics.jsonl").read_text().splitlines()[-1])))


def test_mlflow_tracking_uri_and_experiment_name_send_the_run_elsewhere(tmp_path, offline, monkeypatch, one_thread):
    pytest.importorskip("mlflow", reason=NOT_INSTALLED.format("mlflow"))
    import mlflow

    store = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "large-batch")
    out = tmp_path / "run"
    run(out, ["mlflow"], max_steps=2)
    assert not (out / "mlflow").exists() and json.loads((out / STATE).read_text())["mlflow"]["tracking_uri"] == store
    found = mlflow.search_runs(experiment_names=["large-batch"], output_format="list")
    assert len(found) == 1 and found[0].info.run_name == "run" and found[0].data.params["arithmetic"]
