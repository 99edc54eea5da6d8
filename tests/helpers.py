"""Helpers shared by the test modules: the digits and language-model recipes, an accumulated run through
`reproduce`'s own trainer, and the one plain large-batch reference loop every exactness test compares with.

Test modules import from here (`from helpers import ...`), never from one another.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from core_helpers import BASE, cli, cli_json, make_recipe, snapshot  # noqa: F401  (the torch-free ones)
from reproduce.data import Datasets, build_data
from reproduce.data.batches import fetch
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.runner import ProbeOptions
from reproduce.train.optim.large_batch import LAMB, LARS
from reproduce.train.optim.optimizers import param_groups
from reproduce.train.trainer import RunRequest, train

TESTS = Path(__file__).parent

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
ADAMW = {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
LARS_SPEC = {"name": "lars", "lr": 2.0, "momentum": 0.9, "weight_decay": 5e-4, "no_decay": ["bias"],
             "trust_coefficient": 0.01}
LAMB_SPEC = {"name": "lamb", "lr": 5e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01,
             "no_decay": ["bias"]}


def digits_recipe(optimizer: dict, model: str = "mlp", effective: int = 64, steps: int = 6, **extra) -> dict:
    """The built-in digits classification recipe (scikit-learn's real digits), unshuffled unless `data` says so."""
    return {
        "batch": {"effective": effective},
        "task": "classification",
        "model": {"builtin": model, **({"norm_layers": ["batchnorm"]} if model == "cnn-bn" else {})},
        "data": {"builtin": "digits", "shuffle": False, **extra.pop("data", {})},
        "optimizer": optimizer,
        "schedule": {"total": {"steps": steps}},
        **extra,
    }


def lm_recipe(optimizer: dict, effective: int = 16, steps: int = 3) -> dict:
    """A tiny GPT on variable-length sequences (tests/factories.py), so the loss is normalised by tokens."""
    return {
        "batch": {"effective": effective},
        "task": "language-modeling",
        "model": {"factory": "factories:tiny_gpt"},
        "data": {"factory": "factories:variable_lm", "shuffle": False},
        "optimizer": optimizer,
        "schedule": {"total": {"steps": steps}},
    }


def run_accumulated(recipe_data: dict, micro_batch: int, tmp_path, dtype=torch.float64, **kwargs):
    """`reproduce`'s trainer on the recipe with micro-batches of `micro_batch` (more than one per step)."""
    recipe = parse_recipe(recipe_data)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=micro_batch, dataset_size=len(data.train))
    assert plan.micro_batch == micro_batch and plan.accumulation_steps > 1
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu", **kwargs), dtype=dtype, data=data)
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    return plan, summary, weights, data


def plain_optimizer(recipe, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The recipe's optimizer built directly: torch's SGD / AdamW, or the LARS / LAMB classes with their groups.
    Only the parameters that train (LoRA's adapters under `model.lora`) are given to it."""
    spec = recipe.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    if spec.name == "sgd":
        return torch.optim.SGD(trainable, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adamw":
        return torch.optim.AdamW(trainable, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    groups = param_groups(model, spec.weight_decay, list(spec.no_decay), layer_adaptation=True)
    if spec.name == "lars":
        return LARS(groups, lr=spec.lr, momentum=spec.momentum, trust_coefficient=spec.trust_coefficient)
    if spec.name == "lamb":
        return LAMB(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)
    raise ValueError(f"no plain reference for optimizer {spec.name}")


def plain_loop(recipe_data: dict, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], info: dict | None = None,
               dtype: torch.dtype = torch.float64) -> dict:
    """The plain large-batch loop: for each optimizer step's whole batch, one forward, the mean cross-entropy over
    its items (tokens for a language model, -100 ignored), one backward, the recipe's clipping, one step.
    Returns the final state_dict."""
    recipe = parse_recipe(recipe_data)
    torch.manual_seed(recipe.seed)
    model = build_model(recipe, info).to(dtype)
    optimizer = plain_optimizer(recipe, model)
    for inputs, target in batches:
        inputs = inputs.to(dtype) if inputs.is_floating_point() else inputs
        output = model(inputs)
        loss = F.cross_entropy(output.flatten(0, -2) if output.ndim > 2 else output, target.flatten(),
                               ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        if recipe.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        optimizer.step()
    return model.state_dict()


def whole_batches(dataset, batch: int, steps: int):
    """The dataset in order, `steps` consecutive batches of `batch` items (the last one partial if it runs out)."""
    for step in range(steps):
        yield fetch(dataset, torch.arange(step * batch, min((step + 1) * batch, len(dataset))))


def run_plain(recipe_data: dict, data: dict, steps: int, dtype=torch.float64) -> dict:
    """The plain loop over the recipe's effective batch, in the data's order."""
    batch = parse_recipe(recipe_data).batch.effective
    return plain_loop(recipe_data, whole_batches(data.train, batch, steps), data.info, dtype)


def assert_same_weights(ours: dict, reference: dict, rtol: float, atol: float) -> None:
    assert ours.keys() == reference.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def reproduce_run(recipe: dict, tmp_path: Path, out: str, *args: str) -> subprocess.CompletedProcess:
    """`reproduce run` in a subprocess (tests/ on its PYTHONPATH for the factories); it must exit 0."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "reproduce", "run", str(path), "--out", str(tmp_path / out), "--device", "cpu",
               *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def reproduce_run_here(recipe: dict, tmp_path: Path, out: str, *args: str) -> None:
    """One process, in this interpreter (faster than a subprocess)."""
    from reproduce.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / out), "--device", "cpu", *args])
    assert exit_info.value.code == 0


def weights(tmp_path: Path, out: str) -> dict:
    """The model.pt a run left in tmp_path / out."""
    return torch.load(tmp_path / out / "model.pt", weights_only=True)


def assert_close_weights(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The same weights within float32 rounding (runs on several processes sum in another order)."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=rtol, atol=atol)


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard folder by tag, as TensorBoard's own event reader reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# ---- FSDP2 runs under torchrun (tests/distributed_jobs.py) -------------------------------------------------

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def fsdp(recipe: dict) -> dict:
    """The recipe sharded with FSDP2."""
    return {**recipe, "batch": {**recipe["batch"], "sharding": "fsdp"}}


def gpt_recipe(optimizer: dict = ADAMW, steps: int = 3, **extra) -> dict:
    """The built-in GPT (two blocks: three FSDP units with the root, tied embedding and head) on padded
    sequences of different lengths."""
    return fsdp({
        "batch": {"effective": 16},
        "task": "language-modeling",
        "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 16, "block_size": 16}},
        "data": {"factory": "factories:variable_lm", "shuffle": False},
        "optimizer": optimizer,
        "schedule": {"total": {"steps": steps}},
        **extra,
    })


MLP_CLIPPED = fsdp(digits_recipe(SGD, effective=64, steps=6, clip_grad_norm=0.25))
GPT_CLIPPED = gpt_recipe(clip_grad_norm=0.05)


def job(name: str, recipe: dict, micro_batch: int, dtype: str = "float64", **extra) -> dict:
    """One run of a launch of tests/distributed_jobs.py."""
    return {"name": name, "recipe": recipe, "micro_batch": micro_batch, "dtype": dtype, **extra}


def run_weights(folder: Path) -> dict:
    """The model.pt of the run in `folder`."""
    return torch.load(folder / "model.pt", weights_only=True)


def data_of(recipe: dict) -> Datasets:
    """The recipe's data, built as the run builds it (tests/ on sys.path for its factories)."""
    sys.path.insert(0, str(TESTS))  # the recipes' factories
    return build_data(parse_recipe(recipe))


def assert_same_model(first: Path, second: Path) -> None:
    """The model.pt of two run folders bitwise equal (an interrupted and resumed run against an uninterrupted one)."""
    a = torch.load(first / "model.pt", weights_only=True)
    b = torch.load(second / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def pretrained_files(root: Path, llama_layers: int = 2, **gpt2: int) -> Path:
    """root/ with tokenizer/ (a 512-token byte-level BPE), tiny-llama/ and tiny-gpt2/ (save_pretrained, random
    weights, the tokenizer beside them) and alpaca.json (24 records): a user's folders and file, small."""
    from reproduce.data.samples import train_tokenizer, write_alpaca_json, write_model

    train_tokenizer(root / "tokenizer", max_bytes=100_000)
    write_model("Llama", root / "tiny-llama", root / "tokenizer", num_hidden_layers=llama_layers)
    write_model("GPT2", root / "tiny-gpt2", root / "tokenizer", **gpt2)
    write_alpaca_json(root / "alpaca.json", limit=24)
    return root


def data_paths(recipe, path, eval_path=None):
    """`recipe` reading its data.format data from `path` (and `eval_path`), as `--data` / `--eval-data` set them."""
    from reproduce.plan.overlay import Change, overlay

    changes = [Change(field, value) for field, value in (("data.path", path), ("data.eval_path", eval_path))
               if value is not None]
    return overlay(recipe, changes, "test recipe")


def weights_of(recipe, path):
    """`recipe` starting from the weights at `path`, as `--weights` sets them."""
    from reproduce.plan.overlay import Change, overlay

    return overlay(recipe, [Change("model.weights", path)], "test recipe")


def with_batchnorm(recipe, mode):
    """`recipe` normalising with `mode`, as `--batchnorm` sets it (the paper's choice kept)."""
    from reproduce.plan.overlay import Change, overlay

    return overlay(recipe, [Change("model.batchnorm", mode)], "test recipe")


# a tiny LLaMA with LoRA on the instruction samples (the `sample_data` fixture): the packing probe's and ways' tests
INSTRUCTIONS_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}
CPU_12MIB = ProbeOptions(memory="12MiB", meter="cpu", time_steps=False)  # 2 rows of the longest (457) fit, 3 do not


def instructions_recipe(sample_data: Path, **data) -> dict:
    return {
        "batch": {"effective": 16}, "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": INSTRUCTIONS_LLAMA,
                  "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "data": {"format": "instructions", "path": str(sample_data / "instructions" / "train.jsonl"),
                 "tokenizer": str(sample_data / "tokenizer"), "max_length": 512, **data},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"total": {"steps": 3}},
    }
