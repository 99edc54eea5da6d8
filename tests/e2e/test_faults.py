"""Faults during a run: SIGKILL, SIGINT/SIGTERM, an interrupted checkpoint write, non-finite losses."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from reproduce.data import build_data
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train import trainer

RECIPE = {
    "batch": {"effective": 128},
    "task": "classification",
    "model": {"builtin": "mlp", "kwargs": {"dropout": 0.2}},  # dropout: resume must restore the RNG too
    "data": {"builtin": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"warmup": {"steps": 5}, "decay": {"kind": "cosine"}, "total": {"steps": 60}},
}


def write_recipe(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "recipe.yaml"
    data = {**RECIPE, **changes}
    path.write_text(yaml.safe_dump(data))
    return path


def command(recipe: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
            "--micro-batch-max", "16", *args]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def start_and_stop_at(cmd: list[str], metrics: Path, step: int, signum: int) -> subprocess.Popen:
    """Start a run and send `signum` once it has logged `step` optimizer steps."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while lines(metrics) < step:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.005)
    process.send_signal(signum)
    return process


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("full")
    recipe = write_recipe(tmp)
    subprocess.run(command(recipe, tmp / "out"), check=True, capture_output=True)
    return torch.load(tmp / "out" / "model.pt", weights_only=True)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.subprocess
def test_sigkill_then_resume_gives_the_same_weights(tmp_path, uninterrupted):
    """With DataLoader workers (killed with the run), against the uninterrupted run without: the same weights."""
    recipe, out = write_recipe(tmp_path), tmp_path / "out"
    step = random.Random().randint(4, 50)  # a random step after the first checkpoint's (3) is whole on disk
    process = start_and_stop_at(command(recipe, out, "--checkpoint-every", "3", "--workers", "2"),
                                out / "metrics.jsonl", step, signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    checkpoint = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] <= 60
    resumed = subprocess.run(command(recipe, out, "--resume", "--workers", "1"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise(torch.load(out / "model.pt", weights_only=True), uninterrupted)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61)), f"killed at step {step}"


@pytest.mark.subprocess
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_the_step_checkpoints_and_says_how_to_resume(signum, code, tmp_path, uninterrupted):
    recipe, out = write_recipe(tmp_path), tmp_path / "out"
    process = start_and_stop_at(command(recipe, out), out / "metrics.jsonl", 10, signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    assert "--resume" in stderr and "Traceback" not in stderr
    checkpoint = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == lines(out / "metrics.jsonl") >= 10  # the step in flight finished and was saved
    if signum == signal.SIGTERM:  # (one resume is enough to show the checkpoint is whole; SIGKILL resumes too)
        resumed = subprocess.run(command(recipe, out, "--resume"), capture_output=True, text=True)
        assert resumed.returncode == 0, resumed.stderr
        assert_bitwise(torch.load(out / "model.pt", weights_only=True), uninterrupted)


@pytest.mark.subprocess
def test_ctrl_c_to_the_process_group_with_workers_checkpoints_and_stops(tmp_path):
    """Ctrl-C reaches the DataLoader workers too: they leave it to the run, which finishes its step and stops."""
    recipe, out = write_recipe(tmp_path), tmp_path / "out"
    # micro-batch 4: 32 per step, far more than the 2 the worker keeps ready, so the step needs a live worker
    process = subprocess.Popen(command(recipe, out, "--workers", "1", "--micro-batch-max", "4"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while lines(out / "metrics.jsonl") < 5:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGINT)  # the run and its workers, as a terminal's Ctrl-C does
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "--resume" in stderr and "Traceback" not in stderr and "exited unexpectedly" not in stderr
    checkpoint = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == lines(out / "metrics.jsonl") >= 5


def test_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    from reproduce.errors import DiskFull

    recipe = parse_recipe(RECIPE)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    trainer.train(plan, trainer.RunRequest(tmp_path / "run", device="cpu", max_steps=4), data=data)
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    before = checkpoint.read_bytes()
    real_save = torch.save

    def dies_halfway(state, handle, *args, **kwargs):  # the disk fills in the middle of writing the new checkpoint
        whole = io.BytesIO()
        real_save(state, whole, *args, **kwargs)
        handle.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        handle.write(b"")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.torch, "save", dies_halfway)
    with pytest.raises(DiskFull, match=r"last.pt: cannot write: No space left on device; .* --resume"):
        trainer.train(plan, trainer.RunRequest(tmp_path / "run",
                                               device="cpu", max_steps=6, resume=True, checkpoint_every=1),
                      data=data)
    assert checkpoint.read_bytes() == before
    assert torch.load(checkpoint, weights_only=True)["step"] == 4
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["last.pt"]  # no temporary left behind


def test_non_finite_loss_stops_naming_the_step(tmp_path, capsys):
    from reproduce.cli import main

    recipe, out = write_recipe(tmp_path, optimizer={"name": "sgd", "lr": 1e30}), tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--micro-batch-max", "16",
              "--checkpoint-every", "1"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    match = re.search(r"non-finite loss or gradient at optimizer step (\d+)", err)
    assert match, err
    failed = int(match.group(1))
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == failed - 1  # last good one
    assert lines(out / "metrics.jsonl") == failed - 1


def test_skip_nonfinite_skips_and_counts(tmp_path):
    recipe = parse_recipe({**RECIPE, "optimizer": {"name": "sgd", "lr": 1e30}})
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=16, dataset_size=len(data.train))
    summary = trainer.train(plan, trainer.RunRequest(tmp_path / "run", device="cpu", max_steps=8, skip_nonfinite=True),
                            data=data)
    records = trainer.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["skipped_nonfinite"] == sum(r["skipped"] for r in records) >= 5
    assert len(records) == 8
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())  # skipped steps never touched the weights


@pytest.mark.parametrize("workers", [0, 1])
def test_out_of_memory_mid_run_halves_the_micro_batch_and_keeps_the_batch_exact(workers, tmp_path):
    """Under the probe's CPU memory budget (which raises torch.OutOfMemoryError, as CUDA does). With a worker, the
    loader's prefetched micro-batches of the old size are dropped and it restarts from the redone window."""
    from reproduce.probe.tracker import MemoryTracker

    recipe = parse_recipe({**RECIPE, "model": {"builtin": "mlp", "kwargs": {"hidden": 512}},
                           "schedule": {"total": {"steps": 4}}, "evaluation": {"at_end": False}})
    data = build_data(recipe)

    def peak_of(micro_batch: int, folder: str) -> int:
        plan = make_plan(recipe, micro_batch_max=micro_batch, dataset_size=len(data.train))
        with MemoryTracker() as tracker:
            trainer.train(plan, trainer.RunRequest(tmp_path / folder, device="cpu", max_steps=2, workers=workers),
                          data=data)
        return tracker.peak

    small, large = peak_of(32, "m32"), peak_of(64, "m64")
    assert large > small
    plan = make_plan(recipe, micro_batch_max=64, dataset_size=len(data.train))
    assert (plan.micro_batch, plan.accumulation_steps) == (64, 2)
    with MemoryTracker(budget_bytes=(small + large) // 2):
        summary = trainer.train(plan, trainer.RunRequest(tmp_path / "oom", device="cpu", workers=workers), data=data)
    assert summary["out_of_memory"] == 1
    records = trainer.read_metrics(tmp_path / "oom" / "metrics.jsonl")
    [index] = [i for i, r in enumerate(records) if "event" in r]
    event = records[index]
    assert event == {"event": "out_of_memory", "step": index + 1, "micro_batch": 32, "accumulation_steps": 4,
                     "was": 64}
    steps = [r for r in records if "event" not in r]
    assert [r["micro_batch"] for r in steps] == [64] * index + [32] * (4 - index)
    assert all(r["micro_batch"] * r["accumulation_steps"] == r["samples"] == 128 for r in steps)
    # the same updates as a plain run planned at micro-batch 32: the effective batch never changed
    reference = make_plan(recipe, micro_batch_max=32, dataset_size=len(data.train))
    trainer.train(reference, trainer.RunRequest(tmp_path / "ref", device="cpu"), data=data)
    ours = torch.load(tmp_path / "oom" / "model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum, message", [
    (0.0, "out of memory at optimizer step 1 with micro-batch 1: no smaller"),  # peak in forward/backward
    (0.9, "out of memory in the optimizer step itself"),  # peak when the first step allocates momentum
], ids=["in-backward", "in-optimizer-step"])
def test_out_of_memory_that_cannot_be_recovered_stops_with_a_message(momentum, message, tmp_path):
    from reproduce.errors import TrainingStopped
    from reproduce.probe.tracker import MemoryTracker

    recipe = parse_recipe({**RECIPE, "schedule": {"total": {"steps": 2}},
                           "optimizer": {"name": "sgd", "lr": 0.1, "momentum": momentum}})
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=1, dataset_size=len(data.train))
    with MemoryTracker() as tracker:
        trainer.train(plan, trainer.RunRequest(tmp_path / "measure", device="cpu", max_steps=1), data=data)
    with pytest.raises(TrainingStopped, match=message):
        with MemoryTracker(budget_bytes=tracker.peak - 512):
            trainer.train(plan, trainer.RunRequest(tmp_path / "run", device="cpu"), data=data)
    assert not (tmp_path / "run" / "model.pt").exists()
