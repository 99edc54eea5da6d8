"""Hugging Face models: `model: {hf: NAME_OR_LOCAL_PATH, kind: ...}`, loaded from this machine only.

The schema tests need nothing; the rest use a tiny randomly initialised GPT-2 saved to a temporary folder and
skip only when transformers is missing (a dependency of reproduce since the paper architectures).
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import ADAMW, SGD, assert_same_weights, lm_recipe, run_accumulated, run_plain
from reproduce.errors import UserError
from reproduce.plan.recipe import parse_recipe

NO_TRANSFORMERS = "transformers not installed (a dependency: pip install -e .)"


def hf_recipe(model: dict, task: str = "language-modeling") -> dict:
    return {
        "batch": {"effective": 8}, "task": task, "model": model, "data": {"factory": "factories:variable_lm"},
        "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"total": {"steps": 3}},
    }


@pytest.mark.parametrize(
    "model, message",
    [
        ({"hf": "gpt2", "builtin": "gpt"}, "model: give only one of builtin, factory, hf (got builtin, hf)"),
        ({"hf": "gpt2", "factory": "a.b:c"}, "model: give only one of builtin, factory, hf (got factory, hf)"),
        ({"builtin": "gpt", "kind": "causal-lm"}, "model.kind: only used with hf"),
        ({"hf": "gpt2", "kind": "seq2seq"}, "model.kind: expected one of 'causal-lm' or 'sequence-classification'"),
        ({"hf": " "}, "model.hf: give a model name or a local folder"),
        ({}, "model: give builtin: NAME, factory: 'package.module:function' or hf: NAME_OR_PATH"),
    ],
)
def test_model_schema(model, message):
    with pytest.raises(UserError) as error:
        parse_recipe(hf_recipe(model), source="r.yaml")
    assert any(line.startswith(f"r.yaml: {message}") for line in error.value.lines), error.value.lines


def test_hf_model_parses_with_kind():
    recipe = parse_recipe(hf_recipe({"hf": "org/name", "kind": "causal-lm", "kwargs": {"revision": "main"}}))
    assert (recipe.model.hf, recipe.model.kind, recipe.model.builtin) == ("org/name", "causal-lm", None)


def test_without_transformers_a_clear_error(monkeypatch):
    from reproduce.models import build_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(UserError, match="needs transformers, which is not installed"):
        build_model(parse_recipe(hf_recipe({"hf": "gpt2"})))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=31, eos_token_id=31,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_causal_lm_returns_token_logits(tiny_gpt2):
    from reproduce.models import build_model
    from reproduce.models.hf import HFLogits
    from reproduce.train.losses import build_loss

    recipe = parse_recipe(hf_recipe({"hf": str(tiny_gpt2)}))
    model = build_model(recipe, {"vocab_size": 32})
    assert isinstance(model, HFLogits) and model.kind == "causal-lm"  # kind defaults from the task
    inputs = torch.randint(0, 32, (3, 7))
    logits = model(inputs)
    assert logits.shape == (3, 7, 32)
    # no shift inside: position t's logits predict target[t], as the data contract aligns them
    targets = torch.randint(0, 32, (3, 7))
    expected = torch.nn.functional.cross_entropy(model.model(input_ids=inputs).logits.flatten(0, 1),
                                                 targets.flatten(), reduction="sum")
    torch.testing.assert_close(build_loss(recipe)(logits, targets), expected)


def test_sequence_classification_returns_class_logits(tiny_gpt2):
    from reproduce.models import build_model

    recipe = parse_recipe(hf_recipe({"hf": str(tiny_gpt2), "kwargs": {"num_labels": 3, "pad_token_id": 0}},
                                    task="classification"))
    model = build_model(recipe)
    assert model.kind == "sequence-classification"
    assert model(torch.randint(1, 32, (4, 6))).shape == (4, 3)
    without_pad = parse_recipe(hf_recipe({"hf": str(tiny_gpt2), "kwargs": {"num_labels": 3}}, task="classification"))
    with pytest.raises(UserError, match="has no pad_token_id"):
        build_model(without_pad)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"hf": "/no/such/folder"}, "model.hf: no such folder '/no/such/folder'"),
        ({"hf": "nobody-xyz/not-cached-anywhere"}, "is not on this machine"),
        ({"hf": "TINY", "kind": "sequence-classification"}, "model.kind: sequence-classification does not fit task"),
    ],
)
def test_load_errors_are_user_errors(tiny_gpt2, model, message):
    from reproduce.models import build_model

    model = {**model, "hf": model["hf"].replace("TINY", str(tiny_gpt2))}
    with pytest.raises(UserError, match=message):
        build_model(parse_recipe(hf_recipe(model)))


@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_accumulated_run_equals_one_batch_of_eight(tiny_gpt2, optimizer, tmp_path, one_thread):
    """micro-batch 2 x accumulation 4 = one batch of 8 padded sequences, normalised by their tokens (float64)."""
    recipe = lm_recipe(optimizer, effective=8, steps=3)
    recipe["model"] = {"hf": str(tiny_gpt2), "kind": "causal-lm"}
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=2, tmp_path=tmp_path)
    assert (plan.micro_batch, plan.accumulation_steps) == (2, 4) and summary["steps"] == 3
    reference = run_plain(recipe, data, steps=3)
    assert_same_weights(ours, reference, rtol=1e-6, atol=1e-12)
    torch.manual_seed(0)
    from reproduce.models import build_model

    initial = build_model(parse_recipe(recipe)).state_dict()
    assert any(not torch.allclose(initial[k].double(), ours[k]) for k in ours if ours[k].is_floating_point())


def test_a_cached_name_loads_from_its_snapshot_without_the_network(tiny_gpt2, tmp_path, monkeypatch):
    """A name in the local hub cache is read from its snapshot folder; nothing asks the hub (transformers alone
    would ask for an adapter_config.json even with local_files_only)."""
    import shutil

    import huggingface_hub.file_download

    from reproduce.models import build_model

    snapshot = tmp_path / "hub" / "models--someone--tiny-gpt2" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_gpt2, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args, **kwargs):
        raise AssertionError("asked the hub")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    model = build_model(parse_recipe(hf_recipe({"hf": "someone/tiny-gpt2"})), {"vocab_size": 32})
    assert model(torch.randint(0, 32, (2, 5))).shape == (2, 5, 32)
