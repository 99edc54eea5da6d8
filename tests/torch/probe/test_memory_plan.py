"""The plan and the "does not fit" report with the memory knobs (probe/memory_ways.py, probe/memory_plan.py).

Each way out is computed on the user's own configuration (sharding, world size, precision) and what the plan
takes is what a new probe finds: sharded gradients when the whole model's gradients through the window are what
does not fit; checkpointing when the paper's BatchNorm batch fits only with it (both ways shown). The 70B-shaped
recipe (tests/data/llama2-70b-shape.yaml) plans on 64 H100s with checkpointing and sharded gradients (slow: fake
steps of 69B parameters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from reproduce.cli import main
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.runner import ProbeOptions, run_probe
from reproduce.session import plan_and_probe

GPT = {  # tests/cli/test_does_not_fit.py's small GPT: 8.4 MiB of tensors at micro-batch 1
    "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 64},
    "task": "language-modeling",
    "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 128, "vocab_size": 256, "dropout": 0.1}},
    "data": {"name": "a corpus we do not have", "available": False},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 10}},
    "precision": "bf16",
}
CNN_BN = {  # the paper normalised BatchNorm over 64 images a device
    "batch": {"effective": 256, "devices": 4, "per_device": 64},
    "task": "classification",
    "model": {"builtin": "cnn-bn", "norm_layers": ["batchnorm"]},
    "data": {"builtin": "digits", "shuffle": True, "drop_last": True},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"total": {"steps": 10}},
}
# the estimate adds 40.1 MiB (cuBLAS workspaces without --gpu): 44 MiB leaves about 3.7 MiB of tensors
SMALL = ProbeOptions(memory="44MiB", meter="estimate", headroom=0.0)
LLAMA_70B = Path(__file__).parents[2] / "data" / "llama2-70b-shape.yaml"


pytestmark = pytest.mark.usefixtures("isolated")


def sharded_gpt(**batch):
    return parse_recipe({**GPT, "batch": {**GPT["batch"], "sharding": "fsdp", **batch}}, source="test")


@pytest.fixture(scope="module")
def refused():
    """The GPT over 8 ranks: each rank would hold the whole model's gradients through the window."""
    return run_probe(sharded_gpt(), options=SMALL, world_size=8)


def ways(result) -> dict:
    return {way["change"].split(" (")[0]: way for way in result.does_not_fit["ways_out"]}


def test_the_report_offers_sharded_gradients_on_the_users_world_size_and_the_probe_agrees(refused):
    assert refused.micro_batch_max is None and refused.sharding == "fsdp"
    offered = ways(refused)
    sharded = offered["--sharded-gradients"]
    assert sharded["fits"] and sharded["changes"] == {"batch": {"sharded_gradients": True}}
    assert "reduce-scatter per micro-batch" in sharded["detail"]
    assert sharded["peak_bytes"] < refused.does_not_fit["peak_bytes"]
    again = run_probe(sharded_gpt(sharded_gradients=True), options=SMALL, world_size=8)
    assert again.micro_batch_max >= 1
    first = min(again.trials, key=lambda trial: trial.micro_batch)
    assert first.peak_bytes >= sharded["peak_bytes"] if first.micro_batch > 1 else first.peak_bytes == sharded[
        "peak_bytes"]  # the same count
    assert "--offload cpu" in offered and "--activation-checkpointing" in offered


def test_the_bf16_way_out_is_computed_with_the_users_sharding(refused):
    bf16 = next(way for way in refused.does_not_fit["ways_out"] if way["change"].startswith("model.dtype"))
    # fp32 weights, sharded over 8: bf16 weights can only need less (the bug: counted on one whole process)
    assert bf16["peak_bytes"] < refused.does_not_fit["peak_bytes"]


def test_the_plan_takes_sharded_gradients_and_says_why_and_what_it_costs(refused):
    planned = plan_and_probe(sharded_gpt(), "gpt.yaml", None, 8, "exact", probe=SMALL)
    plan, result = planned.plan, planned.probe
    assert plan.recipe.batch.sharded_gradients and not plan.recipe.model.activation_checkpointing
    assert result.micro_batch_max >= 1 and plan.micro_batch == min(result.micro_batch_max, plan.micro_batch)
    (note,) = plan.memory_notes
    assert note.startswith("memory: took --sharded-gradients: without, not even micro-batch 1 fits")
    assert "one reduce-scatter per micro-batch instead of one per optimizer step" in note


def test_the_plan_takes_checkpointing_for_the_papers_batchnorm_batch_and_shows_both_ways():
    recipe = parse_recipe(CNN_BN, source="test")
    assert run_probe(recipe, options=SMALL).micro_batch_max < 64  # without checkpointing 64 does not fit
    planned = plan_and_probe(recipe, "cnn.yaml", None, 1, "exact", probe=SMALL)
    plan, result = planned.plan, planned.probe
    assert plan.recipe.model.activation_checkpointing and result.micro_batch_max >= 64
    assert plan.micro_batch == 64 and plan.accumulation_steps == 4 and plan.batchnorm_warning is None
    (note,) = plan.memory_notes
    assert "BatchNorm batch of 64 fits only with activation checkpointing" in note
    assert "without checkpointing" in note and "64 x 4 x 1 with activation checkpointing" in note
    assert "took with checkpointing: it keeps the paper's BatchNorm batch of 64" in note


def test_offload_is_counted_by_the_estimate():
    plain = run_probe(sharded_gpt(), options=ProbeOptions(memory="1GiB", meter="estimate"), world_size=8)
    offloaded = run_probe(sharded_gpt(offload="cpu"), options=ProbeOptions(memory="1GiB", meter="estimate"),
                          world_size=8)
    first, moved = plain.trials[0].parts["sharded"], offloaded.trials[0].parts["sharded"]
    assert moved["sharded_gradients"] == moved["step_temporaries"] == 0
    assert moved["model_states"] < first["model_states"] and moved["peak"] < first["peak"]
    assert "offloaded to CPU memory" in offloaded.notes[-1]


@pytest.mark.slow
def test_the_70b_shape_plans_on_64_h100s_with_checkpointing_and_sharded_gradients(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(LLAMA_70B), "--gpu", "h100-80gb", "--world-size", "64", "--sharding", "fsdp"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0, out
    assert "memory: took --activation-checkpointing --sharded-gradients" in out
    assert "activation checkpointing" in out and "sharded gradients" in out


def test_the_70b_recipe_file_is_the_issues_shape():
    data = yaml.safe_load(LLAMA_70B.read_text())
    assert data["model"]["kwargs"] == {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                       "num_attention_heads": 64, "num_key_value_heads": 8}
    assert parse_recipe(data).batch.sequence_length == 2048


def test_an_unsharded_run_is_offered_sharding_with_checkpointing_and_the_probe_agrees():
    refused = run_probe(parse_recipe(GPT, source="test"), options=ProbeOptions(memory="48MiB", meter="estimate",
                                                                               headroom=0.0))
    assert refused.micro_batch_max is None
    (way,) = [w for w in refused.does_not_fit["ways_out"] if w["change"].startswith("--sharding fsdp --world-size")
              and "--activation-checkpointing" in w["change"]]
    assert way["fits"] and way["changes"]["model"] == {"activation_checkpointing": True}
    ranks = int(way["change"].split("--world-size ")[1].split()[0])
    changed = {**GPT, "batch": {**GPT["batch"], "effective": 64 * ranks, **way["changes"]["batch"]},
               "model": {**GPT["model"], "activation_checkpointing": True}}
    again = run_probe(parse_recipe(changed, source="test"), options=ProbeOptions(memory="48MiB", meter="estimate",
                                                                                 headroom=0.0), world_size=ranks)
    assert again.micro_batch_max == 1  # (capped at one sequence a process: the step the report counted)
