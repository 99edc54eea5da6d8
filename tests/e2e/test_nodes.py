"""Several machines: two torchrun launchers on this machine as two nodes (c10d rendezvous on 127.0.0.1, gloo), a run
that continues by itself (--auto-resume), and torchrun restarting a group after a worker was SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import ENV, SGD, assert_close_weights, digits_recipe, reproduce_run, reproduce_run_here, weights
from reproduce.cli import main
from reproduce.train.trainer import read_metrics


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(recipe_path: Path, out: Path, port: int, *args: str) -> subprocess.Popen:
    """One node of a two-node job: `reproduce run --nproc-per-node 1 --nnodes 2` with the c10d rendezvous here."""
    command = [sys.executable, "-m", "reproduce", "run", str(recipe_path), "--out", str(out), "--device", "cpu",
               "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=recipe_path.parent)


def two_nodes(tmp_path: Path, recipe: dict, out: Path, first: list[str], second: list[str]) -> list[tuple]:
    """Both nodes' (exit code, stdout, stderr), started together."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    port = free_port()
    nodes = [start_node(path, out, port, *args) for args in (first, second)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs, strict=True)]


@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_nodes_equal_one_process_with_the_same_effective_batch(tmp_path):
    """Two launchers, one process each, sharing --out (a filesystem both nodes see): the job's rank 0 alone writes
    and reports, and the weights are one process's with twice the accumulation."""
    recipe = digits_recipe(SGD, effective=128, steps=5, data={"shuffle": True})
    nodes = two_nodes(tmp_path, recipe, tmp_path / "nodes", ["--micro-batch-max", "16"], ["--micro-batch-max", "16"])
    for code, stdout, stderr in nodes:
        assert code == 0, stdout[-2000:] + stderr[-3000:]
        assert "--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:" in stdout
    reports = [stdout for _, stdout, _ in nodes if "done: 5 steps" in stdout]
    assert len(reports) == 1 and "micro 16 x accumulation 4 x world 2 = 128" in reports[0]  # rank 0's node alone
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "16")  # micro 16 x accumulation 8 x world 1
    assert_close_weights(weights(tmp_path, "nodes"), weights(tmp_path, "one"))
    records = read_metrics(tmp_path / "nodes" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # one writer: each step once
    assert all(r["world_size"] == 2 and r["accumulation_steps"] == 4 and r["grad_syncs"] == 1 for r in records)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_a_node_started_with_another_plan_is_refused_by_the_job(tmp_path):
    recipe = digits_recipe(SGD, effective=128, steps=3)
    out = tmp_path / "nodes"
    nodes = two_nodes(tmp_path, recipe, out, ["--micro-batch-max", "16"], ["--micro-batch-max", "8"])
    assert all(code != 0 for code, _, _ in nodes)
    for _, _, stderr in nodes:  # every rank says it, naming the node that differs from rank 0's
        assert "with another plan than rank 0's" in stderr and "error: plan: node " in stderr
    assert not out.exists()  # refused before rank 0 wrote anything


# ---- --auto-resume, in this process ------------------------------------------------------------------------------

def run_here(recipe: dict, tmp_path: Path, out: str, *args: str) -> int:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / out), "--device", "cpu", "--micro-batch-max", "16", *args])
    return exit_info.value.code


def test_auto_resume_starts_continues_and_then_has_nothing_to_do(tmp_path, capsys, one_thread):
    recipe = digits_recipe(SGD, effective=64, steps=6, data={"shuffle": True})
    assert run_here(recipe, tmp_path, "auto", "--auto-resume", "--max-steps", "3") == 0  # an empty folder: starts
    assert run_here(recipe, tmp_path, "auto", "--auto-resume") == 0  # unfinished: resumes after step 3
    assert "holds a checkpoint to continue from: resuming" in capsys.readouterr().out
    before = (tmp_path / "auto" / "metrics.jsonl").read_text()
    assert run_here(recipe, tmp_path, "auto", "--auto-resume") == 0  # finished: nothing to do, nothing written
    assert "the run in" in capsys.readouterr().out and (tmp_path / "auto" / "metrics.jsonl").read_text() == before
    run_here(recipe, tmp_path, "straight")
    straight, auto = weights(tmp_path, "straight"), weights(tmp_path, "auto")
    assert all(torch.equal(auto[name], straight[name]) for name in straight)  # bitwise: one process both times
    assert [r["step"] for r in read_metrics(tmp_path / "auto" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_auto_resume_starts_again_a_run_that_never_checkpointed(tmp_path, capsys, one_thread):
    recipe = digits_recipe(SGD, effective=64, steps=2)
    assert run_here(recipe, tmp_path, "auto", "--max-steps", "1") == 0
    (tmp_path / "auto" / "checkpoints" / "last.pt").unlink()  # killed before its first checkpoint
    (tmp_path / "auto" / "summary.json").unlink()
    assert run_here(recipe, tmp_path, "auto", "--auto-resume") == 0
    assert "no checkpoint yet: starting again" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "auto" / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("args, expected", [
    (["--auto-resume"], "--auto-resume: {out} holds the run of another plan, which it neither resumes nor overwrites "
                        "(--resume: the recipe in"),
    (["--auto-resume", "--resume"], "--auto-resume: it decides between starting and resuming by itself; without "
                                    "--resume"),
    (["--max-restarts", "2"], "--max-restarts: torchrun restarts the processes it launched; give --nproc-per-node"),
])
def test_auto_resume_bad_input(tmp_path, capsys, one_thread, args, expected):
    run_here(digits_recipe(SGD, effective=64, steps=1), tmp_path, "taken")
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "taken").rglob("*")}
    other = digits_recipe({**SGD, "lr": SGD["lr"] * 2}, effective=64, steps=1)  # another recipe's run is there
    assert run_here(other, tmp_path, "taken", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + expected.format(out=tmp_path / "taken")) and "\n" not in err
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "taken").rglob("*")} == before


# ---- torchrun --max-restarts: a SIGKILLed worker, the group restarted, the run continued ---------------------------

def children(pid: int) -> list[int]:
    """The processes `pid` started (from /proc: Linux)."""
    tasks = Path(f"/proc/{pid}/task")
    found = []
    for task in tasks.iterdir() if tasks.is_dir() else []:
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_a_worker_killed_under_max_restarts_ends_bitwise_equal(tmp_path):
    recipe = digits_recipe(SGD, effective=128, steps=60, data={"shuffle": True})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "reproduce", "run", str(path), "--out", str(out), "--device", "cpu",
               "--micro-batch-max", "16", "--nproc-per-node", "2", "--checkpoint-every", "5", "--max-restarts", "1"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 12):  # past the checkpoint at 10
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
        time.sleep(0.05)
    (torchrun,) = children(launcher.pid)
    worker = children(torchrun)[0]
    os.kill(worker, signal.SIGKILL)
    log = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, log[-3000:]
    assert "--max-restarts=1" in log and "exitcode: -9" in log
    assert "holds a checkpoint to continue from: resuming" in log and "resuming after step " in log
    reproduce_run(recipe, tmp_path, "straight", "--micro-batch-max", "16", "--nproc-per-node", "2")
    straight, killed = weights(tmp_path, "straight"), weights(tmp_path, "killed")
    assert all(torch.equal(killed[name], straight[name]) for name in straight)  # bitwise: the same world size
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 61))


# ---- SLURM: `reproduce plan --emit slurm` -------------------------------------------------------------------------

def slurm_script(tmp_path: Path, recipe: dict, *args: str) -> str:
    """The sbatch script `reproduce plan --emit slurm` prints, and the plan saved as tmp_path/plan.yaml."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "reproduce", "plan", str(path), "--micro-batch-max", "16", "--emit", "slurm",
               "--out", str(tmp_path / "plan.yaml"), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_emit_slurm_writes_an_sbatch_script_bash_accepts(tmp_path):
    script = slurm_script(tmp_path, digits_recipe(SGD, effective=128, steps=3), "--world-size", "32")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert lines[1].startswith("# reproduce plan: micro-batch 4 x accumulation 1 x world 32")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "trap stop_and_requeue USR1"):
        assert line in lines
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert srun == ("srun --kill-on-bad-exit=1 python -m torch.distributed.run --nproc-per-node=8 --nnodes=4 "
                    "--rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=$SLURM_JOB_ID --max-restarts=3 "
                    "-m reproduce run plan.yaml --out runs/recipe --auto-resume &")
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0  # the shell parses it
    six = slurm_script(tmp_path, digits_recipe(SGD, effective=128, steps=3), "--world-size", "12",
                       "--gpus-per-node", "4")
    assert "#SBATCH --nodes=3" in six and "#SBATCH --gpus-per-node=4" in six


def test_emit_slurm_for_one_process_says_it_needs_none(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(digits_recipe(SGD, effective=128, steps=3)))
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(path), "--micro-batch-max", "16", "--emit", "slurm"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: --emit slurm: the plan runs on 1 process, which needs no launcher: plan it for several (--world-size) "
        "or submit `reproduce run` itself (sbatch --gpus=1 --wrap '...')")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_the_slurm_scripts_torchrun_line_runs_as_two_local_nodes(tmp_path):
    """No SLURM here: the script's srun line without srun, started twice (what srun does, one task per node) with the
    job's first host 127.0.0.1; the run equals one process, and the same line again finds it finished."""
    recipe = digits_recipe(SGD, effective=128, steps=4, data={"shuffle": True})
    script = slurm_script(tmp_path, recipe, "--world-size", "2", "--gpus-per-node", "1")
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    line = srun.removeprefix("srun --kill-on-bad-exit=1 python").removesuffix(" &").replace(":29500",
                                                                                            f":{free_port()}")
    env = {**ENV, "HEAD_NODE": "127.0.0.1", "SLURM_JOB_ID": "4242"}

    def node() -> subprocess.Popen:
        return subprocess.Popen(f"{sys.executable} {line}", shell=True, cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    nodes = [node(), node()]
    logs = [started.communicate(timeout=300)[0] for started in nodes]
    assert [started.returncode for started in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "16")
    assert_close_weights(weights(tmp_path, "runs/recipe"), weights(tmp_path, "one"))
    records = read_metrics(tmp_path / "runs" / "recipe" / "metrics.jsonl")
    assert [(r["step"], r["world_size"], r["accumulation_steps"]) for r in records] == [(s, 2, 4) for s in range(1, 5)]
    again = [node(), node()]  # a requeued job whose run had finished
    logs = [started.communicate(timeout=300)[0] for started in again]
    assert [started.returncode for started in again] == [0, 0]
    assert any("--auto-resume: the run in runs/recipe is finished (4 of 4 optimizer steps run)" in log for log in logs)


def test_the_plan_says_what_the_cluster_costs_in_gpu_hours(tmp_path, capsys, isolated):
    """The same recipe on one node of 8 and on four: the predicted time and GPUs x hours, with the nodes."""
    def plan(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "digits-mlp", "--micro-batch-max", "16", "--gpu", "a100-80gb", *args])
        assert exit_info.value.code in (0, None)
        return capsys.readouterr().out

    summary = json.loads(plan("--world-size", "16", "--json"))
    assert summary["gpu_hours"] == pytest.approx(summary["predicted_seconds"] * 16 / 3600)
    assert "; {:.3g} GPU-hours (2 nodes x 8 GPUs)".format(summary["gpu_hours"]) in plan("--world-size", "16")
    assert "GPU-hours (4 nodes x 4 GPUs)" in plan("--world-size", "16", "--gpus-per-node", "4")
    one = json.loads(plan("--world-size", "2", "--json"))  # fewer GPUs, longer: the same FLOPs, the same GPU-hours
    assert one["gpu_hours"] == pytest.approx(summary["gpu_hours"])
    assert one["predicted_seconds"] == pytest.approx(summary["predicted_seconds"] * 8)


def slurm_absent() -> str | None:
    """Why no job can be submitted here (None: an idle SLURM node answers)."""
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (Debian: apt-get install slurm-wlm munge, and a slurmctld + slurmd)"
    states = subprocess.run(["sinfo", "-h", "-o", "%T %G"], capture_output=True, text=True, timeout=30)
    if states.returncode != 0 or "idle" not in states.stdout or "gpu:2" not in states.stdout:
        return f"no idle SLURM node with 2 GPUs (sinfo: {(states.stdout + states.stderr).strip()[:200]})"
    return None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_the_slurm_script_runs_under_sbatch(tmp_path):
    """Submitted for real, to a one-node cluster (its 2 GPUs GRES entries: the processes run on the CPU here)."""
    why = slurm_absent()
    if why:
        pytest.skip(why)
    recipe = digits_recipe(SGD, effective=128, steps=4, data={"shuffle": True})
    (tmp_path / "job.sbatch").write_text(slurm_script(tmp_path, recipe, "--world-size", "2", "--gpus-per-node", "2"))
    env = {**ENV, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run(["sbatch", "--wait", "--parsable", "job.sbatch"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    job = done.stdout.strip()
    log = (tmp_path / f"reproduce-recipe-{job}.out").read_text()
    assert done.returncode == 0, done.stderr + log[-3000:]
    assert "micro 16 x accumulation 4 x world 2 = 128" in log and "done: 4 steps" in log
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "16")
    assert_close_weights(weights(tmp_path, "runs/recipe"), weights(tmp_path, "one"))


def test_the_launch_line_takes_an_elastic_range_and_restarts():
    from reproduce.errors import UserError
    from reproduce.plan.launch import node_range, node_split, torchrun_command

    assert node_range("2") == (2, 2) and node_range("1:4") == (1, 4)
    for bad in ("0", "2:1", "a", "1:2:3", ""):
        with pytest.raises(UserError, match="^`nnodes`: "):
            node_range(bad)
    command = torchrun_command(["plan.yaml"], 8, "1:4", None, "h:29500", "python", 2, "77")
    assert command[3:9] == ["--nproc-per-node=8", "--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29500",
                            "--rdzv-id=77", "--max-restarts=2"]
    assert [node_split(w) for w in (2, 8, 12, 32, 5)] == [(1, 2), (1, 8), (2, 6), (4, 8), (1, 5)]


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 120) -> None:
    """Until something listens on 127.0.0.1:port (the first node's torchrun, hosting the c10d store)."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "the first node stopped or never listened"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_an_elastic_job_that_loses_a_node_continues_on_fewer(tmp_path):
    """--nnodes 1:2 --max-restarts 1: the second node (launcher, torchrun and worker) SIGKILLed after step 12, the
    first node's torchrun restarts its group alone, and --auto-resume continues on world 1 with the accumulation
    re-derived (16 x 4 x 2 -> 16 x 8 x 1): bitwise the weights of the same moves made by hand, two processes up to
    the checkpoint the job resumed from, then one process resuming it.

    Not the one-process run's from step 0: on this recipe any 1-ulp change of the step-10 weights (the two ranks'
    gradient sum rounds so) ends 2.3e-4 away at step 40 (a ReLU flips at step 17), a one-process run's own too;
    test_resume_on_another_world_size_rederives_accumulation (test_distributed.py) compares with it over 6 steps."""
    recipe = digits_recipe(SGD, effective=128, steps=40, data={"shuffle": True})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out, port = tmp_path / "elastic", free_port()
    args = ["--micro-batch-max", "16", "--max-restarts", "1", "--checkpoint-every", "5"]

    def node() -> subprocess.Popen:
        command = [sys.executable, "-m", "reproduce", "run", str(path), "--out", str(out), "--device", "cpu",
                   "--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", *args]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)

    first = node()
    wait_for_port(port, first)  # the first node hosts the store: the node that leaves must not be that one
    second = node()
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 12):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.05)
    (torchrun,) = children(second.pid)
    for pid in [*children(torchrun), torchrun, second.pid]:
        os.kill(pid, signal.SIGKILL)
    second.wait()
    log = first.communicate(timeout=400)[0]
    assert first.returncode == 0, log[-3000:]
    assert "micro 16 x accumulation 8 x world 1 = 128" in log
    (resumed_at,) = re.findall(r"resuming after step (\d+)", log)  # the checkpoint at 10 or 15
    reproduce_run(recipe, tmp_path, "by-hand", "--micro-batch-max", "16", "--nproc-per-node", "2",
                  "--max-steps", resumed_at)
    reproduce_run_here(recipe, tmp_path, "by-hand", "--resume")  # one process now: N goes from 4 to 8
    by_hand, elastic = weights(tmp_path, "by-hand"), weights(tmp_path, "elastic")
    assert all(torch.equal(elastic[name], by_hand[name]) for name in by_hand)  # bitwise
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, 41))
    assert {(r["world_size"], r["accumulation_steps"]) for r in records} == {(2, 4), (1, 8)}
