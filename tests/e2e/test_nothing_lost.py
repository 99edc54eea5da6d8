"""Nothing lost: the end of a run, a damaged metrics.jsonl or checkpoint, two runs in one folder, --force,
write errors and a full disk, each done to a real run of the digits MLP and checked for a bitwise resume with
complete outputs, or one line naming what happened with nothing already written lost."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import SGD, cli, digits_recipe, snapshot
from reproduce.storage import files

RECIPE = digits_recipe(SGD, steps=8)
RUN = ("--device", "cpu", "--micro-batch-max", "16", "--checkpoint-every", "2", "--no-noise-scale")


def recipe_file(tmp_path: Path, recipe: dict = RECIPE) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(capsys, tmp_path: Path, out: Path, *args: str, recipe: dict = RECIPE) -> tuple[int, str, str]:
    return cli(capsys, "run", recipe_file(tmp_path, recipe), "--out", out, *RUN, *args)


def model(out: Path) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


def steps_and_losses(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run: 8 steps, a checkpoint every 2."""
    from reproduce.cli import main

    tmp = tmp_path_factory.mktemp("whole")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(recipe_file(tmp)), "--out", str(tmp / "out"), *RUN])
    assert exit_info.value.code == 0
    return tmp / "out"


def assert_same_run(out: Path, whole: Path) -> None:
    ours, theirs = model(out), model(whole)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert steps_and_losses(out) == steps_and_losses(whole)


# ---- 1. the end of a run ----------------------------------------------------------------------------------------

def flip_a_weight(path: Path) -> None:
    """Flip the 8 low bits of a byte inside the file's largest tensor (not in the zip's alignment padding, which
    holds nothing)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        largest = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[largest.header_offset + 26: largest.header_offset + 30])
    start = largest.header_offset + 30 + name_length + extra_length
    data[start + largest.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _lose_the_end(out: Path, how: str) -> None:
    if how == "killed after the last checkpoint":  # nothing of the end was written (5 of 40 kills)
        for name in ("model.pt", "summary.json", "loss.svg"):
            (out / name).unlink(missing_ok=True)
    elif how == "model.pt cut short":
        data = (out / "model.pt").read_bytes()
        (out / "model.pt").write_bytes(data[: len(data) // 2])
    elif how == "model.pt bit flipped":
        flip_a_weight(out / "model.pt")
    else:  # summary.json garbled
        (out / "summary.json").write_text('{"steps": 8, "fin')


@pytest.mark.parametrize("how", ["killed after the last checkpoint", "model.pt cut short", "model.pt bit flipped",
                                 "summary.json garbled"])
def test_resume_at_the_last_step_writes_a_lost_end_again(how, whole, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    _lose_the_end(out, how)
    code, stdout, err = run(capsys, tmp_path, out, "--resume")
    assert code == 0, err
    assert "writing its end again" in err and "Traceback" not in err
    assert_same_run(out, whole)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final"] == json.loads((whole / "summary.json").read_text())["final"]
    assert files.check_torch_file(out / "model.pt") is None
    code, _, err = run(capsys, tmp_path, out, "--resume")  # complete now: nothing to do
    assert code == 2 and "nothing to do" in err


def test_the_end_of_a_run_leaves_no_temporaries(whole):
    names = {p.name for p in whole.rglob("*")}
    assert not [n for n in names if n.endswith(".tmp") or n.startswith(".")], names
    assert json.loads((whole / "summary.json").read_text())["plot"].endswith("loss.svg")


# ---- 2. metrics.jsonl cannot block a resume ---------------------------------------------------------------------

def _damage_metrics(path: Path, how: str) -> None:
    text = path.read_text()
    if how == "deleted":
        path.unlink()
    elif how == "cut mid-line":
        path.write_text(text[: len(text) // 3])
    elif how == "garbage line":
        lines = text.splitlines(keepends=True)
        path.write_text("".join(lines[:1]) + "not json at all\n" + "".join(lines[2:]))
    else:  # lines after the checkpoint (a kill between the metrics line and its checkpoint)
        path.write_text(text + text.splitlines(keepends=True)[-1])


@pytest.mark.parametrize("how", ["deleted", "cut mid-line", "garbage line", "longer"])
def test_a_damaged_metrics_file_never_blocks_a_resume(how, whole, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(capsys, tmp_path, out, "--max-steps", "4")
    assert code == 0, err
    _damage_metrics(out / "metrics.jsonl", how)
    size = (out / "metrics.jsonl").stat().st_size if (out / "metrics.jsonl").exists() else 0
    code, _, err = run(capsys, tmp_path, out, "--resume")
    assert code == 0, err
    assert "Traceback" not in err and b"\0" not in (out / "metrics.jsonl").read_bytes()
    if how in ("deleted", "cut mid-line", "garbage line"):
        assert "rewritten from the checkpoint" in err
        assert "line 2 differs" in err or how != "garbage line"
    assert (out / "metrics.jsonl").stat().st_size > size
    assert_same_run(out, whole)


def test_reading_a_garbled_metrics_line_names_it(tmp_path):
    from reproduce.errors import UserError
    from reproduce.observe.outputs import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(path)


# ---- 3. one run per folder --------------------------------------------------------------------------------------

HOLD = "import fcntl, os, sys, time; d = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(d, fcntl.LOCK_EX)" \
       "; print('held', flush=True); time.sleep(120)"


@pytest.mark.subprocess
def test_a_second_run_into_a_busy_folder_is_refused_until_the_first_is_gone(tmp_path, capsys):
    """Another process holds --out (as a run in progress does): one line, exit 2, nothing written; once that
    process is killed (SIGKILL: no clean-up of its own) the OS has released the lock and the run goes ahead."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / ".reproduce.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, stdout, err = run(capsys, tmp_path, out)
        assert code == 2 and err.strip().count("\n") == 0, err
        assert f"error: --out: another run is using {out.absolute()}" in err
        assert [p.name for p in out.iterdir()] == [".reproduce.lock"]
    finally:
        holder.kill()
        holder.wait()
    code, _, err = run(capsys, tmp_path, out, "--max-steps", "2")
    assert code == 0, err


@pytest.mark.subprocess
def test_two_runs_started_together_into_one_folder_one_runs_one_is_refused(tmp_path):
    recipe, out = recipe_file(tmp_path), tmp_path / "out"
    command = [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), *RUN]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = sorted((p.wait(timeout=300), p.stderr.read()) for p in runs)
    codes = [code for code, _ in results]
    assert codes == [0, 2], results
    refused = results[1][1]
    assert "another run is using" in refused or "is not empty" in refused, refused
    assert "Traceback" not in refused
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == list(range(1, 9))


def test_the_process_that_owns_the_run_takes_the_lock(monkeypatch):
    """One process: it. Under torchrun started by a one-machine `reproduce run --nproc-per-node` (which holds the
    lock for its whole life and says so): no worker. Under torchrun started by hand (SLURM's srun), or by the
    launchers of several nodes: the job's rank 0 alone."""
    from reproduce.storage import lock

    monkeypatch.delenv(lock.HELD_ENV, raising=False)
    assert lock.owns_the_run(False, 0)
    assert [lock.owns_the_run(True, rank) for rank in range(3)] == [True, False, False]
    monkeypatch.setenv(lock.LAUNCHER_ENV, "--nproc-per-node 1 --nnodes 2")  # several nodes: the launchers hold none
    assert [lock.owns_the_run(True, rank) for rank in range(3)] == [True, False, False]
    monkeypatch.setenv(lock.HELD_ENV, "1")
    assert [lock.owns_the_run(True, rank) for rank in range(3)] == [False, False, False]


def test_the_lock_is_taken_once_per_process_and_an_unused_folder_goes_with_it(tmp_path):
    from reproduce.storage import lock

    out = tmp_path / "new"
    with lock.hold(out):
        with pytest.raises(RuntimeError, match="holds its lock already"):  # (the CLI takes it, train does not)
            with lock.hold(out):
                pass
    assert not out.exists()  # created for the run, left empty: removed
    with lock.hold(out):  # released with it: taken again
        pass


# ---- 4. a damaged checkpoint is refused --------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flipped bits", "random bytes", "cut short"])
def test_a_damaged_checkpoint_is_refused_not_trained_on(damage, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(capsys, tmp_path, out, "--max-steps", "4")
    assert code == 0, err
    checkpoint = out / "checkpoints" / "last.pt"
    data = checkpoint.read_bytes()
    if damage == "flipped bits":  # 8 low bits of a weight: torch.load takes it, and 195 of 200 later steps differ
        flip_a_weight(checkpoint)
    elif damage == "random bytes":
        checkpoint.write_bytes(os.urandom(len(data)))
    else:
        checkpoint.write_bytes(data[: len(data) - 100])
    before = snapshot(out)
    code, _, err = run(capsys, tmp_path, out, "--resume")
    assert code == 2
    assert err.startswith(f"error: --resume: {checkpoint}") and err.count("\n") == 1, err
    assert "weights_only" not in err
    assert snapshot(out) == before  # nothing written, nothing lost


def test_a_damaged_model_file_is_refused_as_weights(whole, tmp_path, capsys):
    damaged = tmp_path / "model.pt"
    shutil.copy(whole / "model.pt", damaged)
    flip_a_weight(damaged)
    code, _, err = run(capsys, tmp_path, tmp_path / "out", "--weights", str(damaged), "--max-steps", "1")
    assert code == 2 and "is damaged: its bytes do not match the SHA-256" in err and err.count("\n") == 1, err
    code, _, err = run(capsys, tmp_path, tmp_path / "fine", "--weights", str(whole / "model.pt"), "--max-steps", "1")
    assert code == 0, err


# ---- 5. --force removes the previous run only once the new one has started ---------------------------------------

def test_force_puts_the_previous_run_back_after_a_late_check(whole, tmp_path, capsys):
    """The training set is not the one the plan was made for: found after the model and data are built."""
    from reproduce.plan.planfile import save_plan
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import parse_recipe

    out = tmp_path / "out"
    shutil.copytree(whole, out)
    before = snapshot(out)
    save_plan(make_plan(parse_recipe(RECIPE), micro_batch_max=16, dataset_size=1000), tmp_path / "plan.yaml")
    code, _, err = cli(capsys, "run", tmp_path / "plan.yaml", "--out", out, *RUN, "--force")
    assert code == 2 and "does not match the training set" in err and err.count("\n") == 1, err
    assert snapshot(out) == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_force_puts_the_previous_run_back_when_the_first_step_fails(whole, tmp_path):
    """Out of memory at micro-batch 1 in the first step (the probe's CPU memory budget raises it, as CUDA does)."""
    from reproduce.data import build_data
    from reproduce.errors import TrainingStopped
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import parse_recipe
    from reproduce.probe.tracker import MemoryTracker
    from reproduce.train import trainer

    recipe = parse_recipe(RECIPE)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=1, dataset_size=len(data.train))
    with MemoryTracker() as tracker:
        trainer.train(plan, trainer.RunRequest(tmp_path / "measure", device="cpu", max_steps=1), data=data)
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    before = snapshot(out)
    with pytest.raises(TrainingStopped, match="out of memory .*optimizer step 1"):
        with MemoryTracker(budget_bytes=tracker.peak - 512):
            trainer.train(plan, trainer.RunRequest(out, device="cpu", force=True), data=data)
    assert snapshot(out) == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_force_replaces_the_previous_run_once_the_new_one_has_started(whole, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    (out / "notes.txt").write_text("mine")
    code, _, err = run(capsys, tmp_path, out, "--force", "--max-steps", "3")
    assert code == 0, err
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
    assert (out / "notes.txt").read_text() == "mine"  # not the run's: never touched
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


# ---- 6. write errors are one line ---------------------------------------------------------------------------------

def test_an_unwritable_out_is_one_line_before_anything_is_set_up(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    started = time.perf_counter()
    code, _, err = run(capsys, tmp_path, tmp_path / "a-file" / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert "a-file/out: cannot write: Not a directory" in err
    assert time.perf_counter() - started < 5  # before the model and data are set up


def small_disk(folder: Path, size: int) -> bool:
    """A tmpfs of `size` bytes mounted on `folder`, where the machine lets us mount one (root on Linux)."""
    folder.mkdir()
    return sys.platform == "linux" and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True).returncode == 0


def test_a_full_disk_mid_run_stops_in_one_line_and_resumes_bitwise(whole, tmp_path, capsys, monkeypatch):
    """The disk fills while the second checkpoint is written (a real tmpfs that holds one checkpoint and a half, or
    ENOSPC injected into the write where mounting is not permitted): exit 3, one line naming the file, the previous
    checkpoint whole; once there is space, --resume finishes the run bitwise as the uninterrupted one."""
    checkpoint = (whole / "checkpoints" / "last.pt").stat().st_size
    disk = tmp_path / "disk"
    mounted = small_disk(disk, checkpoint * 3 // 2 + 32 * 1024)
    try:
        if not mounted:
            real_write, written = files._Recording.write, {}

            def fills_up(self, data):  # the second checkpoint's temporary runs out of space half-way
                written[self.handle.name] = written.get(self.handle.name, 0) + len(data)
                if "last.pt" in self.handle.name and len(written) > 1 and written[self.handle.name] > checkpoint // 2:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(self, data)

            monkeypatch.setattr(files._Recording, "write", fills_up)
        out = disk / "out"
        code, _, err = run(capsys, tmp_path, out)
        assert code == 3, err
        [stopped] = [line for line in err.splitlines() if not line.startswith("warning:")]
        assert "Traceback" not in err and "unexpected pos" not in err, err
        assert stopped.startswith(f"stopped: {out}/checkpoints/last.pt: cannot write: No space left on device")
        assert f"--out {out} --resume" in stopped
        assert files.check_torch_file(out / "checkpoints" / "last.pt") is None  # the previous one, whole
        assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
        assert not [p for p in out.rglob("*.tmp")]
        if mounted:
            subprocess.run(["mount", "-o", f"remount,size={checkpoint * 4}", str(disk)], check=True)
        else:
            monkeypatch.undo()
        code, _, err = run(capsys, tmp_path, out, "--resume")
        assert code == 0, err
        assert_same_run(out, whole)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# ---- 7. what the stop and done lines say ---------------------------------------------------------------------------

def test_a_stop_names_a_checkpoint_only_when_one_exists(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path, tmp_path / "out", recipe={**RECIPE, "optimizer": {"name": "sgd", "lr": 1e30}})
    assert code == 1 and "non-finite loss or gradient at optimizer step 2" in err  # before the first checkpoint
    assert not (tmp_path / "out" / "checkpoints" / "last.pt").exists()
    assert "no checkpoint was written yet" in err and "last.pt" not in err
    code, _, err = run(capsys, tmp_path, tmp_path / "again", "--checkpoint-every", "1",
                       recipe={**RECIPE, "optimizer": {"name": "sgd", "lr": 1e30}})
    assert code == 1 and f"the last good checkpoint is {tmp_path / 'again' / 'checkpoints' / 'last.pt'}" in err


def test_skip_nonfinite_says_how_many_steps_it_skipped(tmp_path, capsys):
    code, stdout, err = run(capsys, tmp_path, tmp_path / "out", "--skip-nonfinite",
                            recipe={**RECIPE, "optimizer": {"name": "sgd", "lr": 1e30}})
    assert code == 0, err
    skipped = sum(r["skipped"] for r in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()))
    assert skipped >= 5
    assert f"skipped {skipped} non-finite steps" in stdout


def test_a_checkpoint_from_before_the_metrics_were_kept_never_pads_the_file(tmp_path, capsys):
    """Such a checkpoint holds metrics.jsonl's length alone: a longer file is cut back to it, a shorter one is kept
    as its whole lines (a truncate() to the length padded it with NUL bytes) and the resume goes on."""
    out = tmp_path / "out"
    assert run(capsys, tmp_path, out, "--max-steps", "4")[0] == 0
    checkpoint = out / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=True)
    del state["metrics"], state["extra"]["last_record"]
    torch.save(state, checkpoint)
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:100])
    code, _, err = run(capsys, tmp_path, out, "--resume")
    assert code == 0, err
    assert "is shorter than at the checkpoint" in err and b"\0" not in metrics.read_bytes()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [5, 6, 7, 8]  # line 1 was cut
