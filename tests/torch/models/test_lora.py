"""LoRA through peft and `model.dtype`: accumulated LoRA training is the large-batch LoRA run (float64), only the
adapters train and the optimizer sees only them, bf16 base weights stay bf16; a single name reads as a list."""

from __future__ import annotations

import pytest
import torch

from helpers import run_plain
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.models import build_model, count_parameters
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.setup import build
from reproduce.train.trainer import RunRequest, train
from reproduce.verify.accumulation import verify

TINY_GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}
TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 32}


def lora_recipe(model: dict, **extra) -> dict:
    return {
        "batch": {"effective": 16},
        "task": "language-modeling",
        "model": model,
        "data": {"factory": "factories:variable_lm", "shuffle": False},
        "optimizer": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total": {"steps": 3}},
        **extra,
    }


GPT2_LORA = lora_recipe({"builtin": "gpt2-124m", "kwargs": TINY_GPT2,
                         "lora": {"r": 4, "alpha": 8, "target_modules": ["c_attn"]}})


def test_lora_accumulation_equals_the_large_batch_float64(tmp_path):
    """transformers' GPT-2 with peft's LoRA on c_attn, 4 x 4 accumulated against one batch of 16 sequences of
    different lengths: the same weights within 1e-6, the base weights untouched, the adapters moved."""
    recipe = parse_recipe(GPT2_LORA)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=4, dataset_size=len(data.train))
    assert (plan.micro_batch, plan.accumulation_steps) == (4, 4)
    train(plan, RunRequest(tmp_path / "run", device="cpu"), dtype=torch.float64, data=data)
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    reference = run_plain(GPT2_LORA, data, steps=3)
    assert ours.keys() == reference.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.manual_seed(recipe.seed)
    initial = build_model(recipe, data.info).to(torch.float64).state_dict()
    adapters = [name for name in ours if "lora_" in name]
    assert adapters and all(torch.equal(ours[n], initial[n]) for n in ours if "lora_" not in n)
    assert all(not torch.equal(ours[n], initial[n]) for n in adapters)


def test_verify_checks_only_what_trains():
    recipe = parse_recipe(GPT2_LORA)
    result = verify(make_plan(recipe, micro_batch_max=4, dataset_size=48), samples=16)
    assert result.equivalent
    names = [row.name for row in result.parameters]
    assert names and all("lora_" in name for name in names)


def test_bf16_base_weights_and_fp32_adapters_only_adapters_train(tmp_path):
    """model.dtype bf16 with LoRA (as Alpaca-LoRA loads LLaMA): the built model keeps its base weights in bf16 in a
    float32 run, peft keeps the adapters in float32, the optimizer holds the adapters only, and a run moves them
    alone. `target_modules: q_proj` (one name, not a list) reads as [q_proj]."""
    recipe_data = lora_recipe(
        {"builtin": "llama-7b", "kwargs": TINY_LLAMA, "dtype": "bf16",
         "lora": {"r": 2, "alpha": 4, "dropout": 0.05, "target_modules": "q_proj"}},
        precision="bf16",
    )
    recipe = parse_recipe(recipe_data)
    assert recipe.model.lora.target_modules == ["q_proj"]
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=8, dataset_size=len(data.train))
    setup = build(plan, torch.device("cpu"), data=data)
    named = dict(setup.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n and named[n].dtype == torch.float32 for n in trainable)
    assert all(p.dtype == torch.bfloat16 for n, p in named.items() if n not in trainable)
    in_optimizer = {id(p) for group in setup.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}
    total, trains = count_parameters(setup.model)
    assert trains == 2 * 32 + 32 * 2  # one q_proj: A (r x 32) and B (32 x r), r = 2
    train(plan, RunRequest(tmp_path / "run", device="cpu", max_steps=2), data=data)
    after = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    before = setup.model.state_dict()
    for name, value in after.items():
        assert value.dtype == before[name].dtype
        assert torch.equal(value, before[name]) == ("lora_" not in name), name  # the adapters, and only they, moved


@pytest.mark.parametrize("field, value, expected", [
    ("model.norm_layers", "batchnorm", ["batchnorm"]),
    ("optimizer.no_decay", "bias", ["bias"]),
    ("paper.authors", "Priya Goyal", ["Priya Goyal"]),
    ("model.lora.target_modules", "c_attn", ["c_attn"]),
])
def test_a_single_name_reads_as_a_list(field, value, expected):
    data = {**GPT2_LORA, "paper": {"title": "t"}}
    section, *rest = field.split(".")
    node = data[section] = dict(data[section])
    for part in rest[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    node[rest[-1]] = value
    recipe = parse_recipe(data)
    found = recipe
    for part in field.split("."):
        found = getattr(found, part)
    assert found == expected


def test_unknown_target_module_names_what_can_be_adapted():
    model = {**GPT2_LORA["model"], "lora": {"r": 4, "target_modules": ["c_atn"]}}
    recipe = parse_recipe({**GPT2_LORA, "model": model})
    with pytest.raises(UserError, match=r"model.lora.target_modules: gpt2-124m has no module named 'c_atn' "
                                        r"\(modules LoRA can adapt: c_attn, c_fc, c_proj, lm_head, wpe, wte\)"):
        build_model(recipe, {"vocab_size": 32})


def offline_llama(dtype: str) -> dict:
    """A tiny LLaMA with LoRA on q_proj and v_proj whose data is not here: the probe's synthetic tokens."""
    return {
        "batch": {"effective": 512, "unit": "tokens", "sequence_length": 16},
        "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": TINY_LLAMA, "dtype": dtype,
                  "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "data": {"name": "instructions we do not have", "available": False},
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "schedule": {"total": {"steps": 10}},
        "precision": "bf16",
    }


def test_estimate_meter_builds_the_recipes_weight_dtype_and_adapters(tensors_only):
    """The estimate meter builds the model as the run does (bf16 base weights, float32 adapters): its fake tensors
    count what the cpu meter's real ones do, and bf16 weights take less than float32 ones."""
    from reproduce.probe.meters import CpuMeter, EstimateMeter
    from reproduce.probe.workload import Workload

    torch.set_num_threads(1)
    workload = Workload(parse_recipe(offline_llama("bf16"))).prepare()
    real = CpuMeter(workload, 64 * 2**20, 0.1, time_steps=False).measure(4)
    fake = EstimateMeter(workload, 256 * 2**20, 0.1).measure(4)
    assert real.fits and fake.fits
    assert abs(fake.tensor_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes
    float32 = Workload(parse_recipe({**offline_llama("fp32"), "precision": "bf16"})).prepare()
    assert EstimateMeter(float32, 256 * 2**20, 0.1).measure(4).tensor_bytes > fake.tensor_bytes


def test_exports_state_the_model_changes_with_code_that_makes_them():
    """Every `--emit` form says `model.dtype` and `model.lora`, and its peft call builds the adapters `run` builds."""
    import peft

    from reproduce.export import FORMATS, export
    from reproduce.export.common import lora_source, model_notes

    recipe = parse_recipe({**GPT2_LORA, "precision": "bf16", "model": {**GPT2_LORA["model"], "dtype": "bf16"}})
    plan = make_plan(recipe, 4, 1)
    notes = model_notes(plan)
    assert len(notes) == 2 and "torch.bfloat16" in notes[0] and lora_source(recipe.model.lora) in notes[1]
    for fmt in FORMATS:  # (slurm launches several processes: the plan on 2)
        emitted = export(plan if fmt != "slurm" else make_plan(recipe, 4, 2), fmt).text
        text = " ".join(line.lstrip("#").strip() for line in emitted.splitlines())
        assert "model.dtype" in text and "model.lora" in text and "peft.LoraConfig(r=4, lora_alpha=8.0" in text

    torch.manual_seed(0)
    ours = build_model(recipe)
    torch.manual_seed(0)
    base = build_model(parse_recipe({**GPT2_LORA, "precision": "bf16",
                                     "model": {"builtin": "gpt2-124m", "kwargs": TINY_GPT2, "dtype": "bf16"}}))
    theirs = eval(lora_source(recipe.model.lora, "base"), {"peft": peft, "base": base})  # noqa: S307 (ours)

    def trainable(model):
        return {name: (p.shape, p.dtype) for name, p in model.named_parameters() if p.requires_grad}

    assert trainable(theirs) == trainable(ours) and len(trainable(ours)) == 4  # A and B of c_attn in 2 layers
    assert theirs.peft_config["default"].to_dict() == ours.peft_config["default"].to_dict()
    assert all(p.dtype == torch.bfloat16 for name, p in theirs.named_parameters() if "lora_" not in name)
