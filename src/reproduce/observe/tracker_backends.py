"""The experiment trackers behind `--log-to` (trackers.Trackers sends them the run): the `Tracker` interface and
its backends on the real libraries, TensorBoard, W&B and MLflow."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path


def flatten(data, prefix: str = "") -> dict[str, object]:
    """Nested mappings as dotted keys (`recipe.optimizer.lr`), lists as their JSON text."""
    flat: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


HEADLINE = ("recipe_path", "arithmetic", "micro_batch", "accumulation_steps", "world_size", "effective_batch",
            "paper_effective_batch", "exact", "lr")  # the plan's fields trackers show first


def plan_config(plan) -> dict:
    """The run's configuration as trackers show it: the plan's headline numbers, then the whole plan."""
    data = plan.model_dump(mode="json")
    return {
        "paper": plan.recipe.paper.title if plan.recipe.paper else None,
        **{name: getattr(plan, name) for name in HEADLINE},
        "lr_rule": plan.lr_scaling.rule,
        "optimizer_steps": plan.optimizer_steps,
        "warmup_steps": plan.warmup_steps,
        "plan": {key: value for key, value in data.items() if key != "recipe"},
        "recipe": data["recipe"],
    }


def experiment_name(plan) -> str:
    """The recipe file's name (`digits-mlp`), the tracker-side name that groups the runs of one recipe."""
    return Path(plan.recipe_path).stem if plan.recipe_path else "reproduce"


GATE_STATUS = {"passed": 1.0, "warned": 0.0, "accepted": 0.0, "paused": -1.0}


class Tracker:
    """One experiment tracker. `open` returns what `trackers.json` keeps to continue the same run later."""

    name = ""

    def open(self, plan, out: Path, first_step: int, saved: dict | None) -> dict:
        raise NotImplementedError

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, summary: dict, files: dict[str, Path]) -> None:
        """The summary and the artifacts (name in the tracker's run -> local file); the run closed as finished."""
        raise NotImplementedError

    def close(self, status: str) -> None:
        """End the run early (`status`: failed / killed); nothing if it was finished."""

    def event(self, step: int, event: dict) -> None:
        """A gate's outcome (train/gates.py) at its step: its measured value and its status as scalars
        `gate/NAME/METRIC` and `gate/NAME/status` (1 passed, 0 warned or accepted, -1 paused), beside the curves."""
        values = {f"gate/{event['name']}/status": GATE_STATUS.get(event["status"], 0.0)}
        if event.get("value") is not None:
            values[f"gate/{event['name']}/{event['metric']}"] = float(event["value"])
        self.log(step, values)

    def resumes(self, first_step: int, saved: dict) -> int:
        """The last step this tracker holds once opened on a run resumed after `first_step`."""
        return saved.get("step", 0)


class TensorboardTracker(Tracker):
    """Scalars in OUT/tensorboard: `train/NAME` for each numeric field, `eval/NAME` for the `eval_*` ones. Nothing
    is written before `open` (the --out check sees an empty folder); a run resumed after step K opens with
    `purge_step=K+1`, dropping events past the checkpoint; a fresh run replaces earlier event files."""

    name = "tensorboard"

    def open(self, plan, out, first_step, saved):
        from torch.utils.tensorboard import SummaryWriter

        folder = out / "tensorboard"
        if first_step == 0 and folder.is_dir():
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=first_step + 1 if first_step else None)
        return {}

    def resumes(self, first_step, saved):
        return min(saved.get("step", 0), first_step)  # purge_step dropped what it logged past the checkpoint

    def log(self, step, values):
        for key, value in values.items():
            self.writer.add_scalar(f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}", value,
                                   global_step=step)
        self.writer.flush()  # once per optimizer step: an interrupted run keeps what it logged

    def finish(self, summary, files):
        self.writer.close()

    def close(self, status):
        self.writer.close()


def wandb_mode() -> str:
    """WANDB_MODE when set; otherwise online with an API key (WANDB_API_KEY or `wandb login`'s netrc), else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbTracker(Tracker):
    """A W&B run with its files in OUT/wandb; project WANDB_PROJECT (default: the recipe's name)."""

    name = "wandb"

    def open(self, plan, out, first_step, saved):
        import wandb

        run_id = saved["id"] if saved else uuid.uuid4().hex[:12]
        mode = wandb_mode()
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        project = saved["project"] if saved else os.environ.get("WANDB_PROJECT") or experiment_name(plan)
        options = dict(project=project, name=out.name, id=run_id,
                       dir=str(out), config=plan_config(plan), resume="allow" if saved else None,
                       settings=wandb.Settings(silent=True, console="off"))
        try:
            self.run = wandb.init(mode=mode, **options)
        except Exception:
            if mode != "online":
                raise
            self.run = wandb.init(mode="offline", **options)  # no network, or the key was refused
        return {"id": run_id, "project": options["project"], "mode": self.run.settings.mode}

    def log(self, step, values):
        self.run.log(values, step=step)

    def finish(self, summary, files):
        import wandb

        self.run.summary.update({key: value for key, value in flatten(summary).items()
                                 if isinstance(value, (int, float)) and not isinstance(value, bool)})
        artifact = wandb.Artifact(f"run-outputs-{self.run.id}", type="reproduce-run")
        for name, path in files.items():
            artifact.add_file(str(path), name=name)
        self.run.log_artifact(artifact)
        self.run.finish()
        self.run = None

    def close(self, status):
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None


class MlflowTracker(Tracker):
    """An MLflow run in OUT/mlflow (SQLite, MLflow 3's recommended store, artifacts beside it) unless
    MLFLOW_TRACKING_URI is set; experiment MLFLOW_EXPERIMENT_NAME, default the recipe's name."""

    name = "mlflow"
    PARAMS_PER_CALL = 100  # MLflow's limit per log_batch
    IN_FLIGHT = 8
    pending: list
    PARAM_LENGTH = 6000

    def open(self, plan, out, first_step, saved):
        import logging

        from mlflow import MlflowClient
        from mlflow.entities import Param

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial ... tables"

        self.pending = []
        if saved:
            uri = saved["tracking_uri"]
            self.client = MlflowClient(uri)
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return dict(saved)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:
            (out / "mlflow").mkdir(parents=True, exist_ok=True)
            uri = "sqlite:///" + str((out / "mlflow" / "mlflow.db").absolute())
            artifacts = (out / "mlflow" / "artifacts").absolute().as_uri()
        self.client = MlflowClient(uri)
        config = plan_config(plan)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name(plan)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            name, artifact_location=artifacts)
        run = self.client.create_run(experiment_id, run_name=out.name,
                                     tags={"reproduce.out": str(out.absolute()), "paper": config["paper"] or ""})
        self.run_id = run.info.run_id
        params = [Param(key, "" if value is None else str(value)[: self.PARAM_LENGTH])
                  for key, value in flatten(config).items()]
        for start in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start:start + self.PARAMS_PER_CALL])
        self.client.log_artifact(self.run_id, str(out / "plan.yaml"))
        return {"run_id": self.run_id, "tracking_uri": uri, "experiment_id": experiment_id}

    def log(self, step, values):
        """On MLflow's background queue (synchronous=False): a store write (38 ms a step on SQLite here) does not
        hold up training. Past IN_FLIGHT steps the oldest is waited for, raising its failure if any."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending.append(self.client.log_batch(
            self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()], synchronous=False))
        while len(self.pending) > self.IN_FLIGHT:
            self.pending.pop(0).wait()

    def _drain(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()

    def finish(self, summary, files):
        self._drain()
        for name, path in files.items():
            self.client.log_artifact(self.run_id, str(path), artifact_path=str(Path(name).parent).strip(".") or None)
        self.client.set_terminated(self.run_id, "FINISHED")
        self.run_id = None

    def close(self, status):
        if self.run_id is not None:
            try:
                self._drain()  # what was logged before the end
            finally:
                self.client.set_terminated(self.run_id, status.upper())
            self.run_id = None


BACKENDS = {"tensorboard": TensorboardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
