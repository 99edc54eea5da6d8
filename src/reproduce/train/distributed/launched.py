"""A one-machine `reproduce run --nproc-per-node` launcher and its torchrun workers: one job, one voice.
- Workers die with their launcher (parent-death signals on torchrun and on each worker), so a launcher killed with
  SIGKILL, which frees `--out`'s lock, leaves no process training into the folder.
- SIGINT / SIGTERM to the launcher go to the workers alone (their pids in the launch's folder), never to torchrun,
  which runs in its own session.
- A worker's handled ending is written to the launch's folder and the worker exits 0; the launcher says the one
  that matters once (interruption, refusal, stop, "another rank stopped"; lowest rank first) with its exit code. A
  crash still fails torchrun.
No torch: the CLI's `main` reads it for every error it prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPORTS_ENV = "REPRODUCE_RANK_REPORTS"  # the launch's folder, set by the launcher for its workers
PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the OS send `signum` to this process when its parent dies (Linux); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _folder() -> Path | None:
    """The launch's folder, in a worker a launcher started (None elsewhere)."""
    folder = os.environ.get(REPORTS_ENV)
    return Path(folder) if folder and "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def join_launcher() -> None:
    """In a worker: die with torchrun, and register this process for the launcher's signals."""
    folder = _folder()
    if folder is None:
        return
    die_with_parent()
    if os.getppid() == 1:  # torchrun is gone already
        os._exit(137)
    rank = os.environ["RANK"]
    with contextlib.suppress(FileNotFoundError):
        (folder / f"rank-{rank}.json").unlink()  # (an earlier attempt's, under --max-restarts)
    (folder / f".pid-{rank}.tmp").write_text(str(os.getpid()))
    os.replace(folder / f".pid-{rank}.tmp", folder / f"pid-{rank}")


def report(lines: list[str], code: int, peer: bool = False) -> bool:
    """In a worker a launcher started: its ending written for the launcher to say (True); elsewhere False."""
    folder = _folder()
    if folder is None:
        return False
    rank = int(os.environ["RANK"])
    text = json.dumps({"rank": rank, "code": code, "lines": lines, "peer": peer})
    (folder / f".rank-{rank}.tmp").write_text(text)
    os.replace(folder / f".rank-{rank}.tmp", folder / f"rank-{rank}.json")
    return True


def quiet_rank() -> bool:
    """A worker other than rank 0 under a torchrun started by hand: rank 0 says the interruption they all share."""
    return os.environ.get("RANK", "0") != "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _weight(report: dict) -> tuple[int, int]:
    code = report["code"]
    kind = 0 if code in (130, 143) else 1 if code in (2, 3) else 3 if report["peer"] else 2
    return kind, report["rank"]


def run_launched(command: list[str], typed: str) -> int:
    """Run torchrun's `command` as the launcher: the workers' signals and endings as above; its exit code."""
    folder = Path(tempfile.mkdtemp(prefix="reproduce-launch-"))
    env = {**os.environ, REPORTS_ENV: str(folder), "REPRODUCE_COMMAND": typed}
    pending: list[int] = []
    signalled: set[int] = set()

    def forward(signum, frame) -> None:
        if not pending:
            pending.append(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = child.wait(timeout=0.1)
                break
            if pending:
                for path in folder.glob("pid-*"):
                    with contextlib.suppress(ValueError, OSError):
                        pid = int(path.read_text())
                        if pid not in signalled:
                            signalled.add(pid)
                            os.kill(pid, pending[0])
        reports = []
        for path in sorted(folder.glob("rank-*.json")):
            with contextlib.suppress(ValueError, OSError):
                reports.append(json.loads(path.read_text()))
        said = sorted((r for r in reports if r["code"]), key=_weight)
        if said:
            for line in said[0]["lines"]:
                print(line, file=sys.stderr, flush=True)
            return int(said[0]["code"])
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(folder, ignore_errors=True)
