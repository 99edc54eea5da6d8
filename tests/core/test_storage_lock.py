"""The lock on `--out` (storage/lock.py) in real processes: its file deleted under a holder, a holder's forked child
outliving it, a dead writer's temporaries removed by the next holder. Torch-free, a second each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reproduce.errors import UserError
from reproduce.storage import lock

SRC = str(Path(__file__).resolve().parents[2] / "src")
HOLDER = """
import os, sys, time
from reproduce.storage import lock
with lock.hold(sys.argv[1]):
    if sys.argv[2] == "fork":  # a child as a DataLoader worker: it outlives the holder
        ready, started = os.pipe()
        if os.fork() == 0:
            os.write(started, b"x")  # (running: the fork's handlers are done, as in a worker that loads data)
            time.sleep(60)
            os._exit(0)
        os.read(ready, 1)
    print("held", flush=True)
    time.sleep(60)
"""


def holder(out: Path, how: str = "plain") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), how], stdout=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    assert process.stdout.readline() == "held\n"
    return process


def test_a_deleted_lock_file_lets_no_second_holder_in(tmp_path):
    out = tmp_path / "out"
    first = holder(out)
    try:
        (out / lock.LOCK_NAME).unlink()
        with pytest.raises(UserError, match="another run is using"):
            with lock.hold(out):
                pass
    finally:
        first.kill()
        first.wait()
    with lock.hold(out):  # gone with its holder
        pass


def test_a_forked_child_does_not_keep_the_folder_locked_after_its_parent_is_killed(tmp_path):
    out = tmp_path / "out"
    first = holder(out, "fork")
    try:
        first.kill()  # SIGKILL: no clean-up of its own; its forked child lives on
        first.wait()
        started = time.monotonic()
        with lock.hold(out):
            assert time.monotonic() - started < 1
    finally:
        os.killpg(first.pid, signal.SIGKILL)


def test_the_next_holder_removes_a_dead_writers_temporaries_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    litter = [out / ".plan.yaml.ab12cd_9.tmp", out / "checkpoints" / ".last.pt.0123abcd.tmp",
              out / ".trackers.json.tmp"]
    kept = [out / "notes.tmp", out / ".hidden", out / "plan.yaml", out / "checkpoints" / "last.pt"]
    for path in litter + kept:
        path.write_text("x")
    (out / ".adapter.zzzzzzzz.tmp").mkdir()
    with lock.hold(out):
        assert sorted(p.name for p in out.rglob("*") if p.is_file() and p.name != lock.LOCK_NAME) == sorted(
            p.name for p in kept)
        assert not (out / ".adapter.zzzzzzzz.tmp").exists()
