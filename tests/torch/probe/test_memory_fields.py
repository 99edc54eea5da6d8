"""What changes a step's memory is a recipe field the estimate reads: the optimizer's implementation and 8-bit state,
a Hugging Face folder's dtype, LoRA adapters' dtype, nf4's double quantisation, the embeddings and head under a
quantised base."""

from __future__ import annotations

import pytest
import torch

from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe, parse_recipe
from reproduce.probe.meters import CpuMeter, EstimateMeter
from reproduce.probe.workload import Workload
from reproduce.train.optim.optimizers import build_optimizer

MiB = 2**20


def gpt_recipe(**optimizer) -> dict:
    return {"batch": {"effective": 16, "sequence_length": 32}, "task": "language-modeling",
            "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 96, "dropout": 0.0}},
            "data": {"name": "synthetic", "available": False, "train_size": 1000},
            "optimizer": {"name": "adamw", "lr": 1e-3, **optimizer}, "schedule": {"total": {"steps": 4}}}


def estimate(data: dict, micro_batch: int = 4, real: bool = False):
    workload = Workload(parse_recipe(data, source="test")).prepare()
    fake = EstimateMeter(workload, 512 * MiB, 0.1).measure(micro_batch)
    if not real:
        return fake, None
    return fake, CpuMeter(workload, 512 * MiB, 0.1, time_steps=False).measure(micro_batch)


def test_8bit_optimizer_state_is_estimated_as_real_cpu_tensors_hold_it(tensors_only):
    """`state_bits: 8` crashed the estimate (bitsandbytes builds its quantisation map with `.tolist()`, which fake
    tensors cannot answer); now the fake step counts what a real CPU step holds, and the state is about a quarter of
    32-bit AdamW's (1 byte a moment, 32-bit state kept for tensors under 4096 elements)."""
    pytest.importorskip("bitsandbytes")
    fake, real = estimate(gpt_recipe(state_bits=8), real=True)
    assert 0.999 * real.peak_bytes <= fake.tensor_bytes <= 1.001 * real.peak_bytes
    full, _ = estimate(gpt_recipe())
    state, state32 = fake.parts["step"]["optimizer_state"], full.parts["step"]["optimizer_state"]
    assert 0.2 * state32 < state < 0.35 * state32


def test_the_optimizers_implementation_is_chosen_and_changes_the_steps_temporaries():
    """foreach holds temporaries the size of every parameter, one parameter at a time holds one parameter's, fused
    none; the estimate follows the recipe's choice (PyTorch's GPU default, foreach, when none is given)."""
    temporaries = {}
    for implementation in (None, "foreach", "for-loop", "fused"):
        data = gpt_recipe(**({"implementation": implementation} if implementation else {}))
        recipe = parse_recipe(data, source="test")
        model = build_model(recipe, {"vocab_size": 256})
        group = build_optimizer(make_plan(recipe, micro_batch_max=4, dataset_size=1000), model).param_groups[0]
        assert (group["foreach"], group.get("fused")) == {
            None: (None, None), "foreach": (True, None), "for-loop": (False, None), "fused": (False, True)}[
            implementation]
        fake, _ = estimate(data)
        temporaries[implementation] = fake.parts["step"]["step_temporaries"]
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert temporaries[None] == temporaries["foreach"] > parameters > temporaries["for-loop"] > temporaries["fused"]


@pytest.mark.parametrize("optimizer, expected", [
    ({"name": "lars", "implementation": "foreach"}, r"optimizer.implementation: only for torch.optim's"),
    ({"name": "adafactor", "implementation": "fused"}, r"torch.optim has no fused adafactor"),
    ({"name": "adamw", "state_bits": 8, "implementation": "fused"}, r"bitsandbytes' paged and 8-bit optimizers"),
    ({"name": "adamw", "in_backward": True}, r"optimizer.in_backward: .* accumulation needs every micro-batch's "
                                             r"gradients held"),
])
def test_optimizer_choices_that_cannot_run_are_one_line(optimizer, expected):
    data = gpt_recipe()
    data["optimizer"] = {"lr": 1e-3, **optimizer}
    with pytest.raises(UserError, match=expected):
        parse_recipe(data)


def test_an_hf_folder_saved_in_bf16_is_estimated_in_the_dtype_the_run_loads(tmp_path):
    """config.json's torch_dtype bfloat16 made the meta model bf16 while the run loads fp32 (model.dtype's default):
    the estimate halved the weights, gradients and states. Both now follow model.dtype."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    data = gpt_recipe()
    data["model"] = {"hf": str(tmp_path / "bf16")}
    recipe = parse_recipe(data, source="test")
    real = build_model(recipe, {"vocab_size": 64})
    with torch.device("meta"):
        meta = build_model(recipe, {"vocab_size": 64})
    assert {p.dtype for p in real.parameters()} == {p.dtype for p in meta.parameters()} == {torch.float32}
    data["model"]["dtype"], data["precision"] = "bf16", "bf16"
    with torch.device("meta"):
        meta = build_model(parse_recipe(data, source="test"), {"vocab_size": 64})
    assert {p.dtype for p in meta.parameters()} == {torch.bfloat16}


TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}


def qlora_recipe(**model) -> dict:
    data = gpt_recipe()
    data["model"] = {"builtin": "llama-7b", "kwargs": TINY_LLAMA, "quantize": "nf4", "dtype": "bf16",
                     "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, **model}
    data["precision"] = "bf16"
    return data


def test_qlora_fields_adapters_in_bf16_single_quantisation_and_embeddings_kept_in_bf16():
    """QLoRA's choices as recipe fields: bf16 adapters (qlora.py casts every LoraLayer under --bf16), the embeddings
    and head back in bf16 after prepare_model_for_kbit_training (norms in fp32), double quantisation on or off. The
    shipped QLoRA recipe states all three, and the estimate counts them."""
    bnb = pytest.importorskip("bitsandbytes")
    default = build_model(parse_recipe(qlora_recipe(), source="test"), {"vocab_size": 64})
    chosen = build_model(parse_recipe(qlora_recipe(lora={"r": 4, "target_modules": ["q_proj", "v_proj"],
                                                         "dtype": "bf16"}, upcast_embeddings=False,
                                                   double_quant=False), source="test"), {"vocab_size": 64})

    def dtypes(model, part):
        return {p.dtype for name, p in model.named_parameters() if part in name}

    assert dtypes(default, "lora_") == dtypes(default, "embed_tokens") == dtypes(default, "lm_head") == {
        torch.float32}
    assert dtypes(chosen, "lora_") == dtypes(chosen, "embed_tokens") == dtypes(chosen, "lm_head") == {torch.bfloat16}
    assert dtypes(chosen, "norm") == {torch.float32}
    nested = {m.weight.quant_state.nested for model in (default, chosen) for m in model.modules()
              if isinstance(m, bnb.nn.Linear4bit)}
    assert nested == {True, False}
    shipped = load_recipe("papers/dettmers2023-qlora-guanaco-7b.yaml")
    assert (shipped.model.lora.dtype, shipped.model.upcast_embeddings, shipped.model.double_quant) == (
        "bf16", False, True)
    halves = estimate(qlora_recipe(lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "dtype": "bf16"},
                                   upcast_embeddings=False))[0].parts["step"]
    whole = estimate(qlora_recipe())[0].parts["step"]
    embeddings = 2 * 64 * 64 * 2  # embedding and head, 2 bytes saved a weight
    assert whole["weights"] - halves["weights"] >= embeddings
    assert halves["optimizer_state"] < whole["optimizer_state"]


@pytest.mark.parametrize("model, expected", [
    ({"double_quant": False, "quantize": "int8"}, r"model.double_quant: only for quantize: nf4"),
    ({"upcast_embeddings": False, "quantize": None, "lora": None}, r"model.upcast_embeddings: only for a quantised"),
])
def test_quantisation_fields_without_their_base_are_one_line(model, expected):
    with pytest.raises(UserError, match=expected):
        parse_recipe(qlora_recipe(**model))


def test_bf16_adapters_need_bf16_compute():
    data = qlora_recipe(lora={"r": 4, "target_modules": ["q_proj"], "dtype": "bf16"}, quantize=None, dtype="fp32")
    data["precision"] = "fp32"
    with pytest.raises(UserError, match=r"model.lora.dtype: bf16 adapters compute under precision: bf16, not fp32"):
        parse_recipe(data)


def test_a_quantised_bf16_base_that_does_not_fit_is_offered_its_embeddings_in_bf16(capsys, isolated, tmp_path):
    pytest.importorskip("bitsandbytes")
    import yaml

    from helpers import cli

    data = qlora_recipe()
    data["model"]["kwargs"] = {**TINY_LLAMA, "vocab_size": 4096, "hidden_size": 256}
    data["batch"] = {"effective": 16, "sequence_length": 32}
    data["data"] = {"name": "synthetic", "available": False, "train_size": 1000}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    code, out, err = cli(capsys, "probe", "q.yaml", "--memory", "41MiB", "--headroom", "0")
    assert code == 3, err
    offered = [line for line in err.splitlines() if "model.upcast_embeddings: false" in line]
    assert len(offered) == 1 and "costs the frozen embeddings and head computed in the model's dtype" in offered[0]
