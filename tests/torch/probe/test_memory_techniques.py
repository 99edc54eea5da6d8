"""The chunked language-model loss (`model.loss_chunks`), activation offloading (`model.offload_activations`) and
selective checkpointing (`model.selective_checkpointing`): exact in a run (float64, the plain loop's weights),
counted by the estimate and the cpu meter, offered when a micro-batch does not fit."""

from __future__ import annotations

import pytest
import torch

from helpers import cli
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.meters import CpuMeter, EstimateMeter
from reproduce.probe.workload import Workload
from reproduce.train.trainer import RunRequest, train

MiB = 2**20


def lm_recipe(builtin: str = "gpt", **model) -> dict:
    kwargs = ({"layers": 2, "heads": 2, "dim": 16, "block_size": 16, "dropout": 0.1} if builtin == "gpt" else
              {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16})
    return {"batch": {"effective": 16}, "task": "language-modeling",
            "model": {"builtin": builtin, "kwargs": kwargs, **model},
            "data": {"factory": "factories:variable_lm", "shuffle": True},
            "optimizer": {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
            "schedule": {"total": {"steps": 2}}}


def trained(recipe: dict, micro_batch: int, folder) -> dict:
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, micro_batch_max=micro_batch, dataset_size=len(data.train))
    train(plan, RunRequest(folder, device="cpu", no_noise_scale=True, workers=0), dtype=torch.float64, data=data)
    return torch.load(folder / "model.pt", weights_only=True)


@pytest.mark.parametrize("builtin", ["gpt", "gpt-char"])  # the built-in GPT (tied head), transformers' GPT-2
@pytest.mark.parametrize("model", [{"loss_chunks": 3}, {"offload_activations": True},
                                   {"activation_checkpointing": True, "selective_checkpointing": True}])
def test_a_run_with_the_technique_gives_the_plain_loops_weights(builtin, model, tmp_path):
    """Accumulated micro-batches of 4 with the technique against the same run without, float64, dropout on (the
    same masks drawn): the same weights. The state dict keeps its names (the head stays where it was)."""
    ours = trained(lm_recipe(builtin, **model), 4, tmp_path / "ours")
    reference = trained(lm_recipe(builtin), 4, tmp_path / "reference")
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-10, atol=1e-10)


def big_vocab(**model) -> dict:
    return {"batch": {"effective": 16, "sequence_length": 64}, "task": "language-modeling",
            "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 64, "dropout": 0.0,
                                                   "vocab_size": 4096}, **model},
            "data": {"name": "synthetic", "available": False, "train_size": 1000},
            "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"total": {"steps": 4}}}


def test_the_chunked_loss_shrinks_the_cpu_meters_real_peak_and_the_estimate_alike(tensors_only):
    """8 sequences of 64 tokens over 4096 words: fp32 logits of 8 MiB a micro-batch, their log-softmax and its
    gradient. Chunked in 8, what the loss holds drops to about an eighth, on real CPU tensors and on the estimate."""
    peaks = {}
    for chunks in (None, 8):
        workload = Workload(parse_recipe(big_vocab(**({"loss_chunks": chunks} if chunks else {}))), None).prepare()
        real = CpuMeter(workload, 512 * MiB, 0.1, time_steps=False).measure(8)
        fake = EstimateMeter(workload, 512 * MiB, 0.1).measure(8)
        peaks[chunks] = real.peak_bytes, fake.tensor_bytes, fake.parts["loss_bytes"]
    (real, fake, loss), (real8, fake8, loss8) = peaks[None], peaks[8]
    logits = 8 * 64 * 4096 * 4
    assert loss >= 2 * logits and loss8 < loss / 4
    assert real - real8 > 2 * logits and fake - fake8 > 2 * logits
    assert abs(fake8 - real8) < 0.01 * real8


def test_offloading_shrinks_the_estimates_activations_and_not_a_cpus():
    """On the estimate (a GPU's memory) what the forward saves leaves the device; on a CPU it is already in CPU memory:
    the real CPU step holds the same."""
    results = {}
    for offload in (False, True):
        recipe = big_vocab(loss_chunks=8, offload_activations=offload)
        recipe["model"]["kwargs"].update(layers=4, vocab_size=256)
        workload = Workload(parse_recipe(recipe), None).prepare()
        real = CpuMeter(workload, 512 * MiB, 0.1, time_steps=False).measure(8)
        fake = EstimateMeter(workload, 512 * MiB, 0.1).measure(8)
        results[offload] = real.peak_bytes, fake.parts["step"]["activations"]
    assert results[True][0] == results[False][0]
    assert results[True][1] < 0.4 * results[False][1]


def test_the_does_not_fit_report_offers_each_with_its_cost(capsys, isolated, tmp_path):
    import yaml

    """Sequences of 1024 tokens over 4096 words: micro-batch 1 needs 106 MiB on the estimate, most of it the logits;
    chunked in 8 it fits 72 MiB."""
    recipe = big_vocab()
    recipe["batch"]["sequence_length"] = 1024
    (tmp_path / "lm.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    code, out, err = cli(capsys, "probe", "lm.yaml", "--memory", "72MiB", "--headroom", "0")
    assert code == 3, err
    lines = [line for line in err.splitlines() if any(
        name in line for name in ("model.loss_chunks: 8", "offload_activations", "selective_checkpointing"))]
    assert len(lines) == 3
    assert lines[0].startswith("  [fits] model.loss_chunks: 8") and "costs one more output-head matmul" in lines[0]
    assert "costs every saved activation copied" in lines[1]
    assert "costs the ops between each block's matrix products recomputed" in lines[2]


@pytest.mark.parametrize("change, expected", [
    ({"model": {"builtin": "gpt", "selective_checkpointing": True}},
     r"model.selective_checkpointing: chooses what a checkpointed block keeps"),
    ({"task": "classification", "model": {"builtin": "mlp", "loss_chunks": 4}, "data": {"builtin": "digits"}},
     r"model.loss_chunks: chunks a language model's next-token loss \(task is classification\)"),
    ({"model": {"builtin": "gpt", "offload_activations": True},
      "batch": {"effective": 16, "sharding": "fsdp"}}, r"model.offload_activations: not with batch.sharding: fsdp"),
])
def test_bad_technique_inputs_are_one_line(change, expected):
    data = {**lm_recipe(), **change}
    with pytest.raises(UserError, match=expected):
        parse_recipe(data)


def test_optimizer_in_backward_is_refused_on_the_command_line(capsys, isolated, tmp_path):
    import yaml

    recipe = lm_recipe()
    recipe["optimizer"]["in_backward"] = True
    (tmp_path / "lm.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    code, out, err = cli(capsys, "plan", "lm.yaml", "--micro-batch-max", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "optimizer.in_backward" in err


def test_selective_checkpointing_keeps_between_none_and_whole_blocks():
    """A 4-layer GPT at 8 x 64 tokens (dropout on): whole-block checkpointing keeps the least, selective keeps the
    blocks' matrix products too, no checkpointing the most; on real CPU tensors and on the estimate alike."""
    results = []
    for model in ({}, {"activation_checkpointing": True, "selective_checkpointing": True},
                  {"activation_checkpointing": True}):
        recipe = big_vocab(**model)
        recipe["model"]["kwargs"].update(layers=4, dim=128, vocab_size=256, dropout=0.1)
        workload = Workload(parse_recipe(recipe), None).prepare()
        real = CpuMeter(workload, 512 * MiB, 0.1, time_steps=False).measure(8)
        fake = EstimateMeter(workload, 512 * MiB, 0.1).measure(8)
        results.append((real.peak_bytes, fake.parts["step"]["activations"]))
    (plain, plain_fake), (selective, selective_fake), (whole, whole_fake) = results
    assert plain > selective > whole and plain_fake > selective_fake > whole_fake


def test_the_plan_states_each_technique():
    from reproduce.plan.memory_options import memory_summary

    recipe = lm_recipe(activation_checkpointing=True, selective_checkpointing=True, loss_chunks=4,
                       offload_activations=True)
    recipe["optimizer"]["implementation"] = "fused"
    summary = " ".join(memory_summary(parse_recipe(recipe)))
    for phrase in ("selective activation checkpointing", "chunked loss (the output head and cross-entropy over 4 "
                   "chunks", "activation offloading", "optimizer kernels: fused"):
        assert phrase in summary


def test_a_chunked_loss_on_a_model_with_its_own_pretraining_loss_is_one_line():
    from reproduce.models import build_model
    from reproduce.plan.recipe import load_recipe

    data = load_recipe("papers/pysource-bert.yaml").model_dump(mode="json", exclude_unset=True)
    data["model"]["loss_chunks"] = 4
    with torch.device("meta"), pytest.raises(UserError, match=r"model.loss_chunks: bert-base trains with its own "
                                                                r"pre-training loss"):
        build_model(parse_recipe(data), {"vocab_size": 200})
