"""Signals in every phase, the litter of killed writers, `--force` all or nothing, and a lock that survives its file:
each a real `reproduce run` subprocess stopped at an exact point (`REPRODUCE_FAULT_AT`, storage/signals.py: the
process sends itself the signal there) or killed from outside, then continued with the command it printed and
compared with the uninterrupted run, byte for byte."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import SGD, digits_recipe, snapshot

pytestmark = pytest.mark.subprocess

RECIPE = digits_recipe(SGD, steps=8)
RUN = ("--device", "cpu", "--micro-batch-max", "16", "--checkpoint-every", "2", "--no-noise-scale")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def recipe_file(tmp: Path, recipe: dict = RECIPE) -> Path:
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def reproduce(*args: object, fault: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**ENV, "REPRODUCE_FAULT_AT": fault} if fault else ENV
    return subprocess.run([sys.executable, "-m", "reproduce", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def run(tmp: Path, out: Path, *args: str, fault: str | None = None, recipe: dict = RECIPE):
    return reproduce("run", recipe_file(tmp, recipe), "--out", out, *RUN, *args, fault=fault)


def printed_command(stderr: str, words: str) -> list[str]:
    """The command the stop line gives after `words`, as arguments for `python -m reproduce`."""
    [line] = [line for line in stderr.splitlines() if words in line]
    command = shlex.split(line.split(words, 1)[1])
    assert command[0] == "reproduce"
    return command[1:]


def one_stop_line(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert line.startswith("interrupted: "), result.stderr
    return line


def outputs(out: Path) -> dict:
    """The run's outputs as they must match the uninterrupted run's: every file's name (not the lock), model.pt's
    bytes, each step's loss and lr, and summary.json's steps and final loss and evaluation."""
    summary = json.loads((out / "summary.json").read_text())
    final = {k: v for k, v in summary["final"].items() if k.startswith("eval_") or k in ("loss", "lr", "step")}
    return {"files": sorted(name for name in snapshot(out) if name != ".reproduce.lock"),
            "model.pt": (out / "model.pt").read_bytes(), "records": records(out),
            "summary": (summary["steps"], final)}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("whole")
    result = run(tmp, tmp / "out")
    assert result.returncode == 0, result.stderr
    return tmp / "out"


def records(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in
            map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def same_end(out: Path, whole: Path) -> None:
    assert outputs(out) == outputs(whole)
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".previous-run.")]


# ---- 5. signals everywhere ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault, code", [
    ("write:model.pt:SIGINT", 130),  # inside the final torch.save of model.pt (a traceback before)
    # after the last step, before the end is written (no word before): slow, the same deferred stop as model.pt's, and
    # SIGTERM's line and 143 are test_a_signal_before_the_first_step_leaves_the_folder_as_it_was's
    pytest.param("end:SIGTERM", 143, marks=pytest.mark.slow),
    # (the same stop between two files of the end: the model.pt case above is the faster proof)
    pytest.param("write:loss.svg:SIGTERM", 143, marks=pytest.mark.slow),
])
def test_a_signal_while_the_end_is_written_stops_in_one_line_and_the_resume_writes_it(fault, code, whole, tmp_path):
    out = tmp_path / "out"
    line = one_stop_line(run(tmp_path, out, fault=fault), code)
    assert "while the run's end was written" in line and "checkpoint after optimizer step 8 of 8 is whole" in line
    assert not (out / "summary.json").exists() and not list(out.rglob("*.tmp"))
    resumed = reproduce(*printed_command(line, "Continue with: "))
    assert resumed.returncode == 0, resumed.stderr
    assert "writing its end again" in resumed.stderr
    same_end(out, whole)


def test_a_signal_after_the_last_write_says_the_run_is_complete(whole, tmp_path):
    out = tmp_path / "out"
    line = one_stop_line(run(tmp_path, out, fault="write:summary.json:SIGINT"), 130)
    assert line == f"interrupted: SIGINT after the run finished: its outputs in {out} are complete"
    same_end(out, whole)


@pytest.mark.parametrize("signum", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])  # (SIGINT: as SIGTERM)
def test_a_signal_before_the_first_step_leaves_the_folder_as_it_was(signum, whole, tmp_path):
    """Set up, plan.yaml written, no step yet: the folder is as before (here: none), and the command as typed
    starts the run again."""
    out = tmp_path / "out"
    line = one_stop_line(run(tmp_path, out, fault=f"start:{signum}"), {"SIGTERM": 143, "SIGINT": 130}[signum])
    assert line.startswith(f"interrupted: {signum} before the first optimizer step; nothing of this run was kept")
    assert not out.exists()
    again = reproduce(*printed_command(line, "Start again with: "))
    assert again.returncode == 0, again.stderr
    same_end(out, whole)


def test_a_signal_while_a_resume_starts_keeps_the_checkpoint_and_gives_the_resume(whole, tmp_path):
    out = tmp_path / "out"
    assert run(tmp_path, out, "--max-steps", "4").returncode == 0
    before = snapshot(out)
    line = one_stop_line(run(tmp_path, out, "--resume", fault="start:SIGTERM"), 143)
    assert f"{out / 'checkpoints' / 'last.pt'} is as it was. Continue with: reproduce run" in line
    after = snapshot(out)
    assert after.pop("plan.yaml") == before.pop("plan.yaml") and after == before  # (rewritten, the same)
    resumed = reproduce(*printed_command(line, "Continue with: "))
    assert resumed.returncode == 0, resumed.stderr
    same_end(out, whole)


# ---- 4. no stuck folders, no litter ------------------------------------------------------------------------------

def test_a_run_killed_while_writing_plan_yaml_leaves_a_new_run(whole, tmp_path):
    """Only `.plan.yaml.*.tmp` (and the lock file) are left: a plain rerun and --auto-resume both start anew."""
    for again in ((), ("--auto-resume",)):
        out = tmp_path / f"out{len(again)}"
        killed = run(tmp_path, out, fault="write:plan.yaml:SIGKILL")
        assert killed.returncode == -signal.SIGKILL
        assert [p.name for p in out.iterdir() if p.name.startswith(".plan.yaml.")], list(out.iterdir())
        result = run(tmp_path, out, *again)
        assert result.returncode == 0, result.stderr
        same_end(out, whole)


@pytest.mark.parametrize("how", ["--resume", pytest.param("--auto-resume", marks=pytest.mark.slow)])  # (as --resume)
def test_a_run_killed_while_writing_a_checkpoint_resumes_and_its_temporary_goes(how, whole, tmp_path):
    out = tmp_path / "out"
    killed = run(tmp_path, out, fault="write:last.pt#2:SIGKILL")  # the second checkpoint, half-written
    assert killed.returncode == -signal.SIGKILL
    [litter] = list((out / "checkpoints").glob(".last.pt.*.tmp"))
    assert litter.stat().st_size > 0
    result = run(tmp_path, out, how)
    assert result.returncode == 0, result.stderr
    same_end(out, whole)


@pytest.mark.slow  # (the same sweep as test_a_run_killed_while_writing_plan_yaml_leaves_a_new_run, in a resume)
def test_a_resume_killed_while_writing_plan_yaml_resumes(whole, tmp_path):
    out = tmp_path / "out"
    assert run(tmp_path, out, "--max-steps", "4").returncode == 0
    assert run(tmp_path, out, "--resume", fault="write:plan.yaml:SIGKILL").returncode == -signal.SIGKILL
    assert list(out.glob(".plan.yaml.*.tmp"))
    result = run(tmp_path, out, "--resume")
    assert result.returncode == 0, result.stderr
    same_end(out, whole)


# ---- 6. --force is all or nothing --------------------------------------------------------------------------------

@pytest.fixture
def previous(whole, tmp_path) -> tuple[Path, dict]:
    """A finished run in a folder, and its files."""
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    return out, snapshot(out)


@pytest.mark.parametrize("signum", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])  # (as SIGINT)
def test_a_signal_while_force_moves_the_previous_run_aside_puts_it_back(signum, previous, tmp_path):
    """The previous run is aside (one rename), its files not yet removed from the folder: the signal waits for the
    move, then everything is put back, byte for byte."""
    out, before = previous
    code = {"SIGINT": 130, "SIGTERM": 143}[signum]
    line = one_stop_line(run(tmp_path, out, "--force", fault=f"aside:{signum}"), code)
    assert "the previous run is back in place" in line and line.endswith("--force")
    assert snapshot(out) == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


# first-checkpoint: slow, the same put-back by the next command as moving-aside's (the previous run waits whole in
# .previous-run.*), and a new run failing before its first checkpoint is the test below
@pytest.mark.parametrize("fault", ["aside:SIGKILL", pytest.param("write:last.pt:SIGKILL", marks=pytest.mark.slow)],
                         ids=["moving-aside", "first-checkpoint"])
def test_a_force_run_killed_before_its_first_checkpoint_gives_the_previous_run_back(fault, previous, tmp_path):
    """SIGKILL half-way through the move, or at step 4 inside the new run's first checkpoint: the next command in the
    folder puts the previous run back (a note says so) before it decides anything."""
    out, before = previous
    killed = run(tmp_path, out, "--force", "--checkpoint-every", "4", fault=fault)
    assert killed.returncode == -signal.SIGKILL
    assert list(out.glob(".previous-run.*"))
    result = run(tmp_path, out, "--resume")  # the previous run is finished: nothing to do, said in one line
    assert result.returncode == 2 and "nothing to do" in result.stderr, result.stderr
    assert "note: " in result.stderr and "is back in place" in result.stderr
    assert snapshot(out) == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_force_run_that_fails_before_its_first_checkpoint_gives_the_previous_run_back(previous, tmp_path):
    """A diverging LR: step 1 runs, step 2 is not finite, no checkpoint yet (every 4): the previous run is back."""
    out, before = previous
    result = run(tmp_path, out, "--force", "--checkpoint-every", "4",
                 recipe={**RECIPE, "optimizer": {"name": "sgd", "lr": 1e30}})
    assert result.returncode == 1 and "non-finite loss" in result.stderr, result.stderr
    assert snapshot(out) == before
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


# ---- 8. the lock survives its file --------------------------------------------------------------------------------

def test_deleting_the_lock_file_under_a_live_run_lets_no_second_run_in(tmp_path):
    out = tmp_path / "out"
    # (far more steps than the test lasts: the first run must still be training when the second starts; it is
    # killed below, and 400 steps ended before the second's start on an idle machine)
    recipe = recipe_file(tmp_path, {**RECIPE, "schedule": {"total": {"steps": 100_000}}})
    first = subprocess.Popen([sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), *RUN],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "last.pt").is_file():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (out / ".reproduce.lock").unlink()
        second = reproduce("run", out / "plan.yaml", "--out", out, *RUN, "--resume")
        assert second.returncode == 2, second.stderr
        assert second.stderr == f"error: --out: another run is using {out} (it holds .reproduce.lock's lock); wait " \
                                "for it to end, or choose another folder\n"
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()


# ---- 7. several processes ------------------------------------------------------------------------------------------

LONG = {**RECIPE, "schedule": {"total": {"steps": 400}}}


def processes_of(out: Path) -> list[int]:
    """The processes whose command line names `out` (the launcher, torchrun, its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(out).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def launched_until(tmp: Path, out: Path, steps: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "reproduce", "run", str(recipe_file(tmp, LONG)), "--out", str(out), *RUN,
               "--nproc-per-node", "2"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < steps:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.05)
    return launcher


@pytest.mark.distributed
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_both_ranks_with_one_line(signum, code, tmp_path):
    """Before: the resume command from both ranks on one interleaved line, torchrun's traceback, exit 1."""
    out = tmp_path / "out"
    launcher = launched_until(tmp_path, out, 3)
    launcher.send_signal(signum)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == code, stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr
    [line] = [line for line in stderr.splitlines() if not line.startswith("warning:")]
    assert line.startswith(f"interrupted: {signal.Signals(signum).name} after optimizer step "), stderr
    assert line.count("Continue with:") == 1 and "--resume --nproc-per-node 2" in line
    assert not processes_of(out)


@pytest.mark.distributed
def test_the_workers_die_with_a_launcher_killed_with_sigkill(tmp_path):
    """Before: torchrun and its workers went on training into a folder whose lock was free."""
    out = tmp_path / "out"
    launcher = launched_until(tmp_path, out, 3)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while processes_of(out):
        assert time.monotonic() < deadline, f"still running: {processes_of(out)}"
        time.sleep(0.1)
    lines = len((out / "metrics.jsonl").read_text().splitlines())
    time.sleep(1)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == lines


@pytest.mark.slow  # (the refusal path of one process: tests/e2e/test_nothing_lost.py; the launcher's own: above)
@pytest.mark.distributed
def test_a_refusal_inside_the_ranks_is_said_once_with_its_code(tmp_path):
    result = run(tmp_path, tmp_path / "out", "--nproc-per-node", "2", "--merged")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("error: --merged: the recipe trains no LoRA adapters") == 1, result.stderr
    assert "Traceback" not in result.stderr
