"""FSDP2 with the memory knobs, 2 gloo processes on the CPU: each gives the plain large-batch loop's weights.

- `batch.sharded_gradients`: each micro-batch's gradients reduce-scattered (a SUM over losses already divided by
  the window's global count) and accumulated as shards: one reduction round per micro-batch;
- `model.activation_checkpointing` under FSDP2 (applied before `fully_shard`: the recomputation gathers the block);
- `batch.offload: cpu`: FSDP2's CPUOffloadPolicy (parameters, gradients, optimizer state on the CPU);
- checkpointing under DDP.
One torchrun launch runs every job (`distributed_jobs.py`), as tests/e2e/test_fsdp.py does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ENV, GPT_CLIPPED, MLP_CLIPPED, TESTS, assert_same_weights, data_of, job, run_plain, run_weights
from reproduce.train.trainer import read_metrics


def knobs(recipe: dict, checkpointing: bool = False, **batch) -> dict:
    model = {**recipe["model"], "activation_checkpointing": True} if checkpointing else recipe["model"]
    return {**recipe, "model": model, "batch": {**recipe["batch"], **batch}}


CASES = {
    "gpt-sharded-grads": (GPT_CLIPPED, knobs(GPT_CLIPPED, sharded_gradients=True), 2, 3),
    "gpt-checkpointed-sharded-grads": (GPT_CLIPPED, knobs(GPT_CLIPPED, True, sharded_gradients=True), 2, 3),
    "mlp-offload": (MLP_CLIPPED, knobs(MLP_CLIPPED, offload="cpu"), 8, 6),
    "gpt-checkpointed-offload-sharded-grads": (
        GPT_CLIPPED, knobs(GPT_CLIPPED, True, offload="cpu", sharded_gradients=True), 2, 3),
    # checkpointing under DDP (applied before the wrapper; no_sync on all but the last micro-batch)
    "gpt-checkpointed-ddp": (GPT_CLIPPED, knobs(GPT_CLIPPED, True, sharding="none"), 2, 3),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded-grads")
    jobs = [job(name, recipe, micro) for name, (_, recipe, micro, _) in CASES.items()]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
               str(TESTS / "distributed_jobs.py"), str(folder / "jobs.json"), str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=folder, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_each_knob_under_fsdp_gives_the_plain_large_batch_loops_weights_float64(name, launched):
    plain_recipe, recipe, micro, steps = CASES[name]
    reference = run_plain(plain_recipe, data_of(plain_recipe), steps=steps)  # one process, whole batches, clipped
    ours = run_weights(launched / name)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    records = read_metrics(launched / name / "metrics.jsonl")
    assert len(records) == steps and all(r["world_size"] == 2 for r in records)
    accumulation = records[0]["accumulation_steps"]
    assert accumulation > 1
    # one reduce-scatter round per micro-batch with sharded gradients, else one per optimizer step
    expected = accumulation if recipe["batch"].get("sharded_gradients") else 1
    assert all(r["grad_syncs"] == expected for r in records), [r["grad_syncs"] for r in records]
    assert any(r["grad_norm"] > plain_recipe["clip_grad_norm"] for r in records)  # clipping applied


def test_the_runs_really_moved_the_weights(launched):
    initial = run_plain(GPT_CLIPPED, data_of(GPT_CLIPPED), steps=0)
    ours = run_weights(launched / "gpt-sharded-grads")
    assert any(not torch.allclose(initial[k], ours[k]) for k in ours)
