"""Several processes through torchrun (gloo on CPU): DDP with accumulation equals one process, exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    SGD,
    assert_close_weights,
    digits_recipe,
    lm_recipe,
    reproduce_run,
    reproduce_run_here,
    run_plain,
    weights,
)
from reproduce.data import build_data
from reproduce.plan.recipe import parse_recipe
from reproduce.train.trainer import read_metrics

TESTS = Path(__file__).parents[1]


@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_processes_equal_one_process_with_twice_the_accumulation(tmp_path):
    """Each rank reads its own share through its own DataLoader worker; one process reads in-process."""
    recipe = digits_recipe(SGD, effective=128, steps=5, data={"shuffle": True})
    two = reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "16", "--nproc-per-node", "2", "--workers", "1")
    assert "torch.distributed.run" in two.stdout and "micro 16 x accumulation 4 x world 2 = 128" in two.stdout
    assert "--workers 1" in two.stdout  # forwarded to every rank
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "16")
    assert_close_weights(weights(tmp_path, "two"), weights(tmp_path, "one"))
    records = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(records) == 5  # rank 0 alone writes
    assert all(r["grad_syncs"] == 1 for r in records)  # no_sync: one gradient all-reduce per optimizer step
    assert all(r["samples"] == 128 and r["world_size"] == 2 and r["accumulation_steps"] == 4 for r in records)


@pytest.mark.distributed
@pytest.mark.subprocess
def test_token_normalisation_across_ranks_with_different_lengths(tmp_path):
    recipe = lm_recipe(SGD, effective=16, steps=3)
    reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "4", "--nproc-per-node", "2")
    sys.path.insert(0, str(TESTS))
    data = build_data(parse_recipe(recipe))
    reference = run_plain(recipe, data, steps=3, dtype=torch.float32)  # one large batch, mean over its tokens
    assert_close_weights(weights(tmp_path, "two"), reference)
    records = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert records[0]["tokens"] == records[0]["items"] > 16  # the global token count, not one rank's


@pytest.mark.distributed
@pytest.mark.subprocess
def test_resume_on_another_world_size_rederives_accumulation(tmp_path):
    recipe = digits_recipe(SGD, effective=128, steps=6, data={"shuffle": True})
    reproduce_run(recipe, tmp_path, "moved", "--micro-batch-max", "16", "--nproc-per-node", "2", "--max-steps", "3")
    resumed = reproduce_run(recipe, tmp_path, "moved", "--resume")  # one process now: N goes from 4 to 8
    assert "micro 16 x accumulation 8 x world 1 = 128" in resumed.stdout
    reproduce_run_here(recipe, tmp_path, "straight", "--micro-batch-max", "16")
    assert_close_weights(weights(tmp_path, "moved"), weights(tmp_path, "straight"))
    steps = [r["step"] for r in read_metrics(tmp_path / "moved" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_launcher_needs_rendezvous_for_several_nodes(tmp_path, capsys):
    from reproduce.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(digits_recipe(SGD)))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "x"), "--micro-batch-max", "8", "--nproc-per-node", "2",
              "--nnodes", "2"])
    assert exit_info.value.code == 2
    assert "--rdzv-endpoint: required" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_processes_agree_on_sorted_token_budget_with_a_given_micro_batch_max(tmp_path, sample_data, probe_cache):
    """`--micro-batch-max` with `--memory` under two processes: every rank searches sorted's T for that memory and
    all take the smallest, the micro-batch stays the one given; a probed run (no maximum) plans with what the ranks
    agreed on and no longer says its memory was not used."""
    from helpers import instructions_recipe

    recipe = instructions_recipe(sample_data, packing="sorted")
    options = ("--memory", "12MiB", "--meter", "cpu", "--max-steps", "1", "--nproc-per-node", "2")
    given = reproduce_run(recipe, tmp_path, "given", "--micro-batch-max", "4", *options)
    plan = yaml.safe_load((tmp_path / "given" / "plan.yaml").read_text())
    budget = plan["recipe"]["data"]["token_budget"]
    assert plan["micro_batch_max"] == 4 and 2 * 457 <= budget < 3 * 457  # (2 rows of the longest example fit)
    said = given.stdout + given.stderr
    assert said.count(f"the token budget, searched for it: {budget:,} tokens per micro-batch (sorted)") == 1
    probed = reproduce_run(recipe, tmp_path, "probed", *options)
    assert "probe: largest micro-batch 2" in probed.stdout + probed.stderr
    assert "not used" not in probed.stdout + probed.stderr
