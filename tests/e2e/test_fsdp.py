"""FSDP2 through torchrun, 2 gloo processes on the CPU: sharded accumulation equals the plain large-batch loop,
sharded checkpoints survive SIGKILL and reshard, model.pt is the whole model, and out of memory never hangs.

Torchrun launches cost seconds each on a busy CPU, so one launch (`distributed_jobs.py`) runs most training jobs
one after another and the tests below check its outputs; the kill / resume tests launch the real CLI.
"""

from __future__ import annotations

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

from helpers import (
    ENV,
    GPT_CLIPPED,
    LAMB_SPEC,
    LARS_SPEC,
    MLP_CLIPPED,
    SGD,
    TESTS,
    assert_same_weights,
    data_of,
    digits_recipe,
    fsdp,
    gpt_recipe,
    job,
    run_plain,
    run_weights,
)
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe
from reproduce.train.trainer import read_metrics

# LARS and LAMB on FSDP2's DTensor shards: their trust ratios need whole-tensor norms
MLP_LARS = fsdp(digits_recipe(LARS_SPEC, effective=64, steps=6))
MLP_LAMB = fsdp(digits_recipe(LAMB_SPEC, effective=64, steps=6))
# Out of memory: a narrow MLP on large micro-batches, so activations dominate its memory; plain SGD (no optimizer
# state to allocate in the first step).
OOM_DDP = digits_recipe({"name": "sgd", "lr": 0.1}, effective=768, steps=2)
OOM_DDP["model"] = {"builtin": "mlp", "kwargs": {"hidden": 64}}
OOM_FSDP = fsdp({**OOM_DDP, "batch": {"effective": 256}})
BATCHNORM = digits_recipe(SGD, model="cnn-bn", effective=32, steps=3)
# The run the kill / resume tests interrupt: no dropout, so resuming on 3 processes draws what 2 would have.
# 12 sequences: 2 x 3 x 2 processes, or 2 x 2 x 3.
KILLED = {**gpt_recipe(steps=16), "batch": {"effective": 12, "sharding": "fsdp"},
          "schedule": {"warmup": {"steps": 3}, "decay": {"kind": "cosine"}, "total": {"steps": 16}}}


JOBS = [
    job("gpt", GPT_CLIPPED, 2),
    job("mlp", MLP_CLIPPED, 8),
    job("mlp-fp32", MLP_CLIPPED, 8, "float32"),
    job("mlp-lars", MLP_LARS, 8),
    job("mlp-lamb", MLP_LAMB, 8),
    job("gpt-bf16", {**GPT_CLIPPED, "precision": "bf16"}, 2, "float32"),
    job("mlp-fp16", {**MLP_CLIPPED, "precision": "fp16"}, 8, "float32"),
    job("bn-fsdp", fsdp(BATCHNORM), 4),
    job("bn-ddp", BATCHNORM, 4),
    job("killed-reference", KILLED, 2, "float32"),
    job("stopped", KILLED, 2, "float32", out="resumed", max_steps=5, checkpoint_every=2),
    job("resumed", KILLED, 2, "float32", resume=True),
    # DDP: rank 1 alone runs out of memory at micro-batch 128 (3 per window), in a micro-batch before the last
    job("ddp-64", OOM_DDP, 64, tracker={"rank": 1}),
    job("ddp-128", OOM_DDP, 128, max_steps=1, tracker={"rank": 1}),
    job("ddp-oom", OOM_DDP, 128, tracker={"rank": 1, "between": ["ddp-64", "ddp-128"]}),
    # FSDP: rank 1 alone runs out of memory in a forward or backward, where the ranks cannot agree: all stop
    job("fsdp-16", OOM_FSDP, 16, max_steps=1, tracker={"rank": 1}),
    job("fsdp-128", OOM_FSDP, 128, max_steps=1, tracker={"rank": 1}),
    job("fsdp-oom", OOM_FSDP, 128, tracker={"rank": 1, "between": ["fsdp-16", "fsdp-128"]}),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every job of JOBS in one 2-process launch; its folder and each rank's results."""
    folder = tmp_path_factory.mktemp("jobs")
    (folder / "jobs.json").write_text(json.dumps(JOBS))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
               str(TESTS / "distributed_jobs.py"), str(folder / "jobs.json"), str(folder)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=folder, timeout=600)
    results = [json.loads((folder / f"rank-{rank}.json").read_text()) if (folder / f"rank-{rank}.json").exists()
               else {} for rank in (0, 1)]
    assert all("fsdp-oom" in r for r in results), done.stdout[-3000:] + done.stderr[-5000:]
    results[0]["launch_seconds"] = time.monotonic() - started
    return folder, results


@pytest.mark.distributed
@pytest.mark.parametrize("name, recipe, steps", [("gpt", GPT_CLIPPED, 3), ("mlp", MLP_CLIPPED, 6)])
def test_sharded_accumulation_equals_the_plain_large_batch_loop_float64(name, recipe, steps, jobs):
    folder, _ = jobs
    reference = run_plain(recipe, data_of(recipe), steps=steps)  # one process, whole batches, clipped
    ours = run_weights(folder / name)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    initial = build_model(parse_recipe(recipe), data_of(recipe).info).double().state_dict()
    assert any(not torch.allclose(initial[k], ours[k]) for k in ours)  # the run did move the weights
    records = read_metrics(folder / name / "metrics.jsonl")
    assert len(records) == steps
    assert all(r["grad_syncs"] == 1 for r in records)  # one reduce-scatter round per optimizer step
    assert all(r["world_size"] == 2 and r["accumulation_steps"] == 4 for r in records)
    assert any(r["grad_norm"] > recipe["clip_grad_norm"] for r in records)  # clipping was really applied
    if name == "gpt":
        assert records[0]["items"] == records[0]["tokens"] > 16  # the window's tokens summed over both ranks


@pytest.mark.distributed
@pytest.mark.parametrize("name, recipe", [("mlp-lars", MLP_LARS), ("mlp-lamb", MLP_LAMB)])
def test_lars_and_lamb_on_sharded_parameters_equal_the_plain_large_batch_loop_float64(name, recipe, jobs):
    folder, _ = jobs
    reference = run_plain(recipe, data_of(recipe), steps=6)  # one process, whole tensors, batches of 64
    assert_same_weights(run_weights(folder / name), reference, rtol=1e-6, atol=1e-12)
    records = read_metrics(folder / name / "metrics.jsonl")
    assert len(records) == 6 and all(r["world_size"] == 2 and r["grad_syncs"] == 1 for r in records)


@pytest.mark.distributed
def test_sharded_float32_within_float32_rounding(jobs):
    folder, _ = jobs
    reference = run_plain(MLP_CLIPPED, data_of(MLP_CLIPPED), steps=6, dtype=torch.float32)
    assert_same_weights(run_weights(folder / "mlp-fp32"), reference, rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
def test_mixed_precision_keeps_fp32_master_weights(jobs):
    folder, _ = jobs
    exact = run_plain(GPT_CLIPPED, data_of(GPT_CLIPPED), steps=3, dtype=torch.float32)
    for name in ("gpt-bf16", "mlp-fp16"):
        ours = run_weights(folder / name)
        assert all(w.dtype == torch.float32 for w in ours.values()), name  # parameters stored in fp32
        records = read_metrics(folder / name / "metrics.jsonl")
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records), name
    bf16 = run_weights(folder / "gpt-bf16")
    moved = max(float((bf16[k] - exact[k]).abs().max()) for k in exact)
    assert 0 < moved < 2e-2  # bf16 compute: near the fp32 run's weights, not equal to them


@pytest.mark.distributed
def test_batchnorm_under_fsdp_keeps_rank_zeros_statistics_as_ddp_does(jobs):
    folder, _ = jobs
    sharded, replicated = run_weights(folder / "bn-fsdp"), run_weights(folder / "bn-ddp")
    assert any("running_mean" in k for k in sharded)
    assert_same_weights(sharded, replicated, rtol=1e-9, atol=1e-12)


@pytest.mark.distributed
def test_model_pt_is_the_whole_model_for_a_fresh_unsharded_one(jobs):
    folder, _ = jobs
    state = run_weights(folder / "gpt")
    model = build_model(parse_recipe(GPT_CLIPPED), data_of(GPT_CLIPPED).info).double()
    assert list(state) == list(model.state_dict())  # the model's own names, head.weight (tied) included
    model.load_state_dict(state)  # strict
    assert torch.equal(model.head.weight, state["head.weight"])
    sharded = [p for p in (folder / "gpt" / "checkpoints").iterdir() if p.is_dir()]
    assert [p.name for p in sharded] == ["sharded-step-00000003"]  # one folder: the one last.pt names
    assert sorted(f.name for f in sharded[0].iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.distributed
def test_out_of_memory_under_ddp_agreed_by_all_ranks_halves_the_micro_batch(jobs):
    folder, results = jobs
    measured = results[1]
    assert measured["ddp-128"]["peak"] > measured["ddp-64"]["peak"]
    assert "stopped" not in results[0]["ddp-oom"] and "stopped" not in measured["ddp-oom"]
    records = read_metrics(folder / "ddp-oom" / "metrics.jsonl")
    events = [r for r in records if "event" in r]
    assert events == [{"event": "out_of_memory", "step": 1, "micro_batch": 64, "accumulation_steps": 6, "was": 128}]
    steps = [r for r in records if "event" not in r]
    assert [(r["micro_batch"], r["accumulation_steps"], r["samples"]) for r in steps] == [(64, 6, 768)] * 2
    # rank 0 never ran out: it changed the micro-batch because the ranks agreed; the updates are those of a run
    # planned at micro-batch 64 from the start
    assert_same_weights(run_weights(folder / "ddp-oom"), run_weights(folder / "ddp-64"), rtol=1e-9, atol=1e-12)


@pytest.mark.distributed
def test_out_of_memory_under_fsdp_stops_every_rank_with_a_message(jobs):
    folder, results = jobs
    alone, other = results[1]["fsdp-oom"]["stopped"], results[0]["fsdp-oom"]["stopped"]
    assert re.match(r"out of memory on rank 1 at optimizer step 1 with micro-batch 128; the ranks cannot agree", alone)
    assert "FSDP gathers parameters" in alone and "--resume --micro-batch-max 64" in alone
    assert other.startswith("rank 0: a collective with the other ranks failed")
    assert results[0]["fsdp-oom"]["seconds"] < 60  # stopped at once, no hang
    assert not (folder / "fsdp-oom" / "model.pt").exists()


# ---- the CLI: --sharding, SIGKILL, resume on the same and on another number of processes -------------------


def cli(recipe: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu", *args]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.distributed
def test_resume_gives_the_uninterrupted_runs_weights_bitwise(jobs):
    folder, _ = jobs
    reference, resumed = run_weights(folder / "killed-reference"), run_weights(folder / "resumed")
    assert resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in resumed)
    assert [r["step"] for r in read_metrics(folder / "resumed" / "metrics.jsonl")] == list(range(1, 17))


@pytest.mark.distributed
@pytest.mark.subprocess
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_sigkill_then_resume_on_three_processes_gives_the_same_weights(jobs, tmp_path):
    """Killed with SIGKILL (launcher, torchrun and both ranks at once, as a lost machine), then resumed through the
    CLI on 3 processes: DCP reshards the checkpoint, N is re-derived, the weights are the uninterrupted run's."""
    folder, _ = jobs
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**KILLED, "batch": {"effective": 12}}))  # sharding from --sharding below
    out, metrics = tmp_path / "out", tmp_path / "out" / "metrics.jsonl"
    kill_at = random.Random().randint(3, 13)  # a random optimizer step, different each run
    launcher = subprocess.Popen(cli(recipe, out, "--micro-batch-max", "2", "--nproc-per-node", "2", "--sharding",
                                    "fsdp", "--checkpoint-every", "2"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 180
    while not metrics.exists() or len(metrics.read_text().splitlines()) < kill_at:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.01)
    for pid in [launcher.pid, *descendants(launcher.pid)]:
        os.kill(pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    checkpoint = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] % 2 == 0 and checkpoint["world_size"] == 2 and checkpoint["sharded"]

    moved = subprocess.run(cli(recipe, out, "--resume", "--nproc-per-node", "3"), capture_output=True, text=True,
                           env=ENV, timeout=300)
    assert moved.returncode == 0, moved.stdout[-2000:] + moved.stderr[-3000:]
    assert "micro 2 x accumulation 2 x world 3 = 12 samples per step" in moved.stdout  # N re-derived
    assert "sharding: fsdp" in moved.stdout  # the run's own sharding, without --sharding
    reference = run_weights(folder / "killed-reference")
    assert_same_weights(run_weights(out), reference, rtol=1e-5, atol=1e-5)  # sums in another order: fp32 rounding
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 17)), f"killed at step {kill_at}"
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == ["sharded-step-00000016"]


# ---- one process: what the FSDP paths rely on, without a launch ---------------------------------------------


def test_one_process_builds_the_whole_model_of_a_sharded_recipe_for_verify_and_the_probe(tmp_path, capsys):
    from reproduce.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(MLP_CLIPPED))
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", str(path), "--micro-batch-max", "16"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert "equivalent" in capsys.readouterr().out


def test_resume_with_a_smaller_micro_batch_keeps_the_batch_and_the_schedule(tmp_path, capsys):
    """What the out-of-memory stop message advises: --resume --micro-batch-max M re-derives N, nothing else."""
    from reproduce.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(digits_recipe(SGD, effective=64, steps=4)))
    out = tmp_path / "out"
    for args in (["--micro-batch-max", "16", "--max-steps", "2"], ["--resume", "--micro-batch-max", "8"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["run", str(path), "--out", str(out), "--device", "cpu", *args])
        assert exit_info.value.code == 0, capsys.readouterr().err
    records = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["micro_batch"], r["accumulation_steps"]) for r in records] == \
        [(1, 16, 4), (2, 16, 4), (3, 8, 8), (4, 8, 8)]
