"""Activation checkpointing (`model.activation_checkpointing`, `--activation-checkpointing`): exact, and counted.

Runs with it give the weights of runs without it (float64, dropout on: the recomputation draws the forward's
masks), on the built-in GPT, the ResNet-50 block structure with BatchNorm (running statistics updated once), and a
transformers model; a resumed run is bitwise the uninterrupted one; the cpu meter and the estimate meter both see
the saved activations drop; a model with nothing to checkpoint is one line, exit 2.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from reproduce.cli import main
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.models.checkpointing import checkpoint_blocks, enable, enabled
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.fake_step import run_fake_step
from reproduce.probe.meters import CpuMeter
from reproduce.probe.workload import Workload
from reproduce.train.trainer import RunRequest, train

ADAMW = {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def checkpointed(recipe: dict) -> dict:
    return {**recipe, "model": {**recipe["model"], "activation_checkpointing": True}}


def gpt_recipe(dropout: float = 0.2, steps: int = 2) -> dict:
    return {
        "batch": {"effective": 16},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 16, "block_size": 16,
                                               "dropout": dropout}},
        "data": {"factory": "factories:variable_lm", "shuffle": True},
        "optimizer": ADAMW,
        "schedule": {"total": {"steps": steps}},
    }


def resnet_recipe() -> dict:
    """torchvision's ResNet-50 ([3, 4, 6, 3] bottlenecks, BatchNorm) on 16 x 16 images, narrow inner widths."""
    return {
        "batch": {"effective": 8, "per_device": 8, "devices": 1},
        "task": "classification",
        "model": {"builtin": "resnet50", "norm_layers": ["batchnorm"], "kwargs": {"width_per_group": 4}},
        "data": {"factory": "memory_factories:small_images", "shuffle": False},
        "optimizer": SGD,
        "schedule": {"total": {"steps": 1}},
    }


def hf_recipe() -> dict:
    """transformers' GPT-2 (nanoGPT's char model, 2 layers of 32) with its dropout of 0.2."""
    return {**gpt_recipe(), "model": {"builtin": "gpt-char", "kwargs": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                                                         "block_size": 16}}}


def trained(recipe: dict, micro_batch: int, folder, **options) -> dict:
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    plan = make_plan(parsed, micro_batch_max=micro_batch, dataset_size=len(data.train))
    assert plan.accumulation_steps > 1
    train(plan, RunRequest(folder, device="cpu", no_noise_scale=True, workers=0, **options),
          dtype=torch.float64, data=data)
    return torch.load(folder / "model.pt", weights_only=True)


def assert_same(ours: dict, reference: dict, tolerance: float = 1e-6) -> None:
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=tolerance, atol=tolerance,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("recipe, micro_batch", [
    pytest.param(gpt_recipe(), 4, id="builtin-gpt-dropout-0.2"),
    pytest.param(resnet_recipe(), 4, id="resnet50-blocks-batchnorm"),
    pytest.param(hf_recipe(), 4, id="transformers-gpt2-dropout-0.2"),
])
def test_a_checkpointed_run_gives_the_weights_of_the_plain_run_float64(recipe, micro_batch, tmp_path):
    plain = trained(recipe, micro_batch, tmp_path / "plain")
    ours = trained(checkpointed(recipe), micro_batch, tmp_path / "checkpointed")
    assert_same(ours, plain)  # BatchNorm's running statistics too: updated once per forward, not again
    changed = [name for name in plain if plain[name].is_floating_point()]
    assert changed  # (the check compares real weights)


def test_the_model_is_checkpointed_per_block_with_its_names_unchanged():
    recipe = parse_recipe(checkpointed(gpt_recipe()))
    model = build_model(recipe, {"vocab_size": 32})
    plain = build_model(parse_recipe(gpt_recipe()), {"vocab_size": 32})
    assert enabled(model) and not enabled(plain)
    assert [type(b).__name__ for b in checkpoint_blocks(model)] == ["Block", "Block"]
    assert model.state_dict().keys() == plain.state_dict().keys()
    copied = copy.deepcopy(model)  # a deep copy is checkpointed on its own blocks, not the original's
    assert all(block.forward.__self__ is block for block in checkpoint_blocks(copied))
    hf = build_model(parse_recipe(checkpointed(hf_recipe())), {"vocab_size": 32})
    assert hf.model.transformer.gradient_checkpointing and enabled(hf)


def test_the_recomputation_saves_activations_on_the_cpu_meter_and_the_estimate_counts_the_same():
    """Built-in GPT: the estimate's fake step (CPU rules) counts what real CPU tensors hold, with and without."""
    peaks = {}
    for on in (False, True):
        recipe = parse_recipe(checkpointed(gpt_recipe()) if on else gpt_recipe())
        workload = Workload(recipe).prepare()
        meter = CpuMeter(workload, 256 * 2**20, 0.0, time_steps=False)
        real = meter.measure(16).peak_bytes
        fake = run_fake_step(workload.plan, workload.data.info,
                             meter.window(16, torch.device("cpu"), torch.float32), None)
        assert abs(fake.peak - real) <= 4096, (on, fake.peak, real)
        peaks[on] = (real, fake.step.activations)
    assert peaks[True][0] < peaks[False][0]
    assert peaks[True][1] < 0.8 * peaks[False][1]  # two blocks: one block's activations at a time


def test_resume_of_a_checkpointed_run_is_bitwise(tmp_path):
    recipe = checkpointed(gpt_recipe(steps=4))
    full = trained(recipe, 4, tmp_path / "full")
    trained(recipe, 4, tmp_path / "split", max_steps=2, checkpoint_every=1)
    split = trained(recipe, 4, tmp_path / "split", resume=True)
    for name in full:
        assert torch.equal(full[name], split[name]), name


def test_verify_with_checkpointing_and_dropout_prints_equivalent(tmp_path, capsys):
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(gpt_recipe()))
    with pytest.raises(SystemExit) as exit_:
        main(["verify", str(path), "--micro-batch-max", "4", "--activation-checkpointing"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert "equivalent" in out and "checkpointing against without (dropout on" in " ".join(out.split())


def test_a_model_without_blocks_is_one_line_naming_what_to_add(tmp_path, capsys):
    with pytest.raises(UserError, match="_no_split_modules"):
        enable(torch.nn.Linear(4, 4), "factories:linear")
    undeclared = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(UserError, match="none declared"):  # layers, but no block list: the factory must say which
        enable(undeclared, "factories:mlp")
    recipe = {**gpt_recipe(), "model": {"factory": "memory_factories:single_linear", "activation_checkpointing": True},
              "task": "classification", "data": {"builtin": "digits"}}
    path = tmp_path / "linear.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(path), "--micro-batch-max", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "memory_factories:single_linear has no blocks to checkpoint" in err[0] and "_no_split_modules" in err[0]


def test_a_factory_model_declaring_its_blocks_is_checkpointed():
    from memory_factories import declared_blocks

    model = declared_blocks()
    assert enable(model, "factory") == 2 and enabled(model)


def test_offload_without_fsdp_is_one_line(tmp_path, capsys):
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(gpt_recipe()))
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(path), "--out", str(tmp_path / "out"), "--micro-batch-max", "4", "--offload", "cpu",
              "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(
        "error: --offload: batch.offload: cpu offloads FSDP2's") and "set sharding: fsdp" in err[0]
    assert not (tmp_path / "out").exists()


def test_the_recomputation_check_fails_when_the_masks_are_not_redrawn(monkeypatch):
    """Without the RNG state kept, the recomputed dropout masks differ: verify's check must then see it."""
    from reproduce import models
    from reproduce.verify.accumulation import recomputation_error

    recipe = parse_recipe(checkpointed(gpt_recipe()))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=4, dataset_size=len(data.train))
    from reproduce.data.batches import collate

    window = [collate([data.train[i] for i in range(j, j + 4)]) for j in (0, 4)]
    error, dropout = recomputation_error(plan, data, window, torch.device("cpu"), torch.float64, 0)
    assert dropout and error == 0.0
    forget = models.checkpointing.checkpoint

    def without_rng_state(*args, **kwargs):
        return forget(*args, **{**kwargs, "preserve_rng_state": False})

    monkeypatch.setattr(models.checkpointing, "checkpoint", without_rng_state)
    error, _ = recomputation_error(plan, data, window, torch.device("cpu"), torch.float64, 0)
    assert error > 1e-3


def test_run_with_the_option_says_so_and_resumes_with_it_from_its_plan(tmp_path, capsys):
    path, out = tmp_path / "gpt.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(gpt_recipe(steps=2)))
    common = ["run", str(path), "--out", str(out), "--micro-batch-max", "4", "--device", "cpu", "--workers", "0",
              "--no-noise-scale"]
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--activation-checkpointing", "--max-steps", "1", "--checkpoint-every", "1"])
    assert exit_.value.code == 0
    assert "memory: activation checkpointing" in capsys.readouterr().out
    saved = yaml.safe_load((out / "plan.yaml").read_text())
    assert saved["recipe"]["model"]["activation_checkpointing"] is True
    with pytest.raises(SystemExit) as exit_:
        main([*common, "--resume"])  # the recipe file has no checkpointing: the run keeps its own
    assert exit_.value.code == 0, capsys.readouterr().err
    assert "memory: activation checkpointing" in capsys.readouterr().out


def test_every_emitted_form_says_the_memory_knobs():
    from reproduce.export import FORMATS, export

    recipe = parse_recipe({**checkpointed(gpt_recipe()), "batch": {"effective": 16, "sharding": "fsdp",
                                                                   "sharded_gradients": True, "offload": "cpu"}})
    plan = make_plan(recipe, micro_batch_max=2, world_size=2, dataset_size=48)
    for name in FORMATS:
        text = " ".join(export(plan, name).text.split())
        assert "model.activation_checkpointing" in text and "use_reentrant" in text, name
        assert "batch.sharded_gradients" in text and "CPUOffloadPolicy" in text, name
