"""A quantised frozen base (`model.quantize: int8 | nf4`, bitsandbytes) under LoRA, on this CPU: the layers are
bitsandbytes' own, LoRA trains on them and a run resumes bitwise, accumulation equals the one-pass gradient, and
the bad inputs get one line."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import assert_same_model
from reproduce.data import build_data
from reproduce.errors import UserError
from reproduce.models import build_model, build_on_meta, count_parameters
from reproduce.plan.overlay import variant
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.setup import build
from reproduce.train.trainer import RunRequest, train
from reproduce.verify.accumulation import verify

bnb = pytest.importorskip("bitsandbytes")  # `make setup` installs it (the quantize extra): these tests then run

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 32}


def quantized_recipe(quantize: str, precision: str = "fp32", **model) -> dict:
    return {
        "batch": {"effective": 16},
        "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": TINY_LLAMA, "quantize": quantize,
                  "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}, **model},
        "data": {"factory": "factories:variable_lm", "shuffle": True},
        "optimizer": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total": {"steps": 6}},
        "precision": precision,
    }


@pytest.mark.parametrize("quantize, layer, stored", [("int8", "Linear8bitLt", torch.int8),
                                                     ("nf4", "Linear4bit", torch.uint8)])
def test_the_base_is_bitsandbytes_layers_with_lora_on_top(quantize, layer, stored):
    """Every linear layer but the head is bitsandbytes' (peft's LoRA layer for bitsandbytes on q_proj and v_proj),
    stored in 1 byte (int8) or half a byte (nf4, two weights a byte) a weight; only the adapters train."""
    recipe = parse_recipe(quantized_recipe(quantize))
    model = build_model(recipe, {"vocab_size": 32})
    layers = {name: module for name, module in model.named_modules() if type(module).__name__ == layer}
    q_proj = [name for name in layers if name.endswith("self_attn.q_proj")]
    assert len(q_proj) == 2 and type(layers[q_proj[0]]).__module__ == "peft.tuners.lora.bnb"
    base = [m for m in layers.values() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]
    assert len(base) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    weight = base[0].weight
    assert weight.dtype == stored and weight.numel() * weight.element_size() == (
        32 * 32 if quantize == "int8" else 32 * 32 // 2)
    head = model.get_submodule("base_model.model.model.lm_head")
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    trains = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trains and all("lora_" in name for name in trains)


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_the_model_that_trains_counts_the_parameters_of_its_unquantised_base(quantize):
    """The run counts on the model it trains (a quantised base placed on its device, nf4 packing two weights a
    byte): the same (all, trainable) as the unquantised model built on the meta device (`plan`'s count)."""
    recipe = parse_recipe(quantized_recipe(quantize))
    plan = make_plan(recipe, 4, dataset_size=64)
    setup = build(plan, torch.device("cpu"), data=build_data(recipe))
    packed = [p for p in setup.unwrapped_model.parameters() if getattr(p, "quant_state", None) is not None]
    assert quantize == "int8" or (packed and packed[0].numel() * 2 == packed[0].quant_state.shape.numel())
    unquantised = build_on_meta(variant(recipe, {"model.quantize": None}), {"vocab_size": 32})
    assert count_parameters(setup.unwrapped_model) == count_parameters(unquantised)


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_lora_on_a_quantised_base_trains_and_resumes_bitwise(quantize, tmp_path):
    """4 x 4 accumulated on an int8 / nf4 base with dropout in the adapters: the loss falls, the frozen quantised
    weights are untouched, and a run stopped at step 3 and resumed ends bitwise where the uninterrupted one does."""
    recipe = parse_recipe(quantized_recipe(quantize))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=4, dataset_size=len(data.train))
    assert (plan.micro_batch, plan.accumulation_steps) == (4, 4)
    summary = train(plan, RunRequest(tmp_path / "full", device="cpu", workers=0), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", workers=0, max_steps=3, checkpoint_every=2), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", workers=0, resume=True), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")
    assert summary["steps"] == 6 and summary["final"]["loss"] < 3.6  # ln 32 = 3.47 at the start, random base
    trained = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    torch.manual_seed(recipe.seed)
    initial = build_model(recipe, data.info).state_dict()
    assert trained.keys() == initial.keys()
    frozen = [name for name in trained if "lora_" not in name]
    assert any(trained[name].dtype == (torch.int8 if quantize == "int8" else torch.uint8) for name in frozen)
    assert all(torch.equal(trained[name], initial[name]) for name in frozen)
    assert all(not torch.equal(trained[name], initial[name]) for name in trained if "lora_B" in name)


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_verify_is_equivalent_on_a_quantised_base_in_float64(quantize):
    """The frozen quantised forward is the same for every micro-batch: the window's LoRA gradient equals the one-pass
    gradient to float64 rounding (the dequantised weights are exact in float64; nf4's matmuls are run in it)."""
    recipe = parse_recipe(quantized_recipe(quantize))
    result = verify(make_plan(recipe, micro_batch_max=4, dataset_size=48))
    assert result.equivalent and result.micro_batches == 4, result.verdict
    assert result.global_relative_error < 1e-12
    assert all("lora_" in row.name for row in result.parameters)
    assert any("quantised base" in note for note in result.notes)


def test_nf4_computes_in_the_recipes_precision_and_paged_adamw_steps_on_cpu(tmp_path):
    """nf4 set explicitly (transformers' default is fp4) with double quantisation and the compute dtype of the recipe
    (bf16, not transformers' float32 default); QLoRA's paged AdamW from bitsandbytes steps (unpaged on a CPU)."""
    data = quantized_recipe("nf4", precision="bf16", dtype="bf16")
    data["optimizer"] = {**data["optimizer"], "paged": True}
    recipe = parse_recipe(data)
    from reproduce.models.quantize import quantization_config

    config = quantization_config(recipe)
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant, config.bnb_4bit_compute_dtype) == (
        "nf4", True, torch.bfloat16)
    setup = build(make_plan(recipe, micro_batch_max=8, dataset_size=48), torch.device("cpu"))
    layer = next(m for m in setup.model.modules() if isinstance(m, bnb.nn.Linear4bit))
    state = layer.weight.quant_state
    assert (state.quant_type, state.nested, state.blocksize, layer.compute_dtype) == ("nf4", True, 64, torch.bfloat16)
    assert type(setup.optimizer).__name__ == "PagedAdamW32bit"
    summary = train(setup.plan, RunRequest(tmp_path / "run", device="cpu", workers=0, max_steps=2))
    assert summary["steps"] == 2


@pytest.mark.parametrize("model, expected", [
    ({"builtin": "llama-7b", "kwargs": TINY_LLAMA, "quantize": "int8"},
     r"<recipe>: model.quantize: an int8 base cannot train .* add lora"),
    ({"builtin": "cnn-bn", "quantize": "nf4", "norm_layers": ["batchnorm"],
      "lora": {"r": 2, "target_modules": ["conv1"]}}, None),
])
def test_bad_quantize_inputs_get_one_line(model, expected):
    data = quantized_recipe("int8")
    data["model"] = model
    if expected is not None:
        with pytest.raises(UserError, match=expected):
            parse_recipe(data)
        return
    data.update(task="classification", data={"builtin": "digits"})
    with pytest.raises(UserError, match=r"model.quantize: cnn-bn has no linear layers to quantise"):
        build_model(parse_recipe(data), {})


def test_bitsandbytes_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets where it is absent
    recipe = parse_recipe(quantized_recipe("nf4"))
    with pytest.raises(UserError, match=r"model.quantize: needs bitsandbytes, which is not installed \(pip install "
                                        r"'reproduce\[quantize\]'"):
        build_model(recipe, {"vocab_size": 32})


@pytest.mark.parametrize("quantize, weight_bytes, most_over", [("int8", 1, 0.2), ("nf4", 0.5, 0.01)])
def test_the_estimate_meter_counts_a_quantised_base_as_real_cpu_tensors(quantize, weight_bytes, most_over,
                                                                       tensors_only):
    """The estimate meter's fake step on an int8 / nf4 base: the packed weights (1 or half a byte a weight) with their
    scales and quantisation states, the dequantised temporaries, the adapters' gradients and AdamW state. nf4 counts
    what real CPU tensors hold; int8 counts more (16% on this model, measured: conservative, never less)."""
    from reproduce.probe.meters import CpuMeter, EstimateMeter
    from reproduce.probe.workload import Workload

    config = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 64}
    data = quantized_recipe(quantize, **{"kwargs": config})
    data["model"]["lora"]["dropout"] = 0.0  # the estimate keeps CUDA's 1-byte dropout masks, the CPU a float one
    data.update(batch={"effective": 64, "sequence_length": 32},
                data={"name": "synthetic", "available": False, "train_size": 1000})
    workload = Workload(parse_recipe(data, source="test")).prepare()
    real = CpuMeter(workload, 512 * 2**20, 0.1, time_steps=False).measure(4)
    fake = EstimateMeter(workload, 512 * 2**20, 0.1).measure(4)
    assert 0.99 * real.peak_bytes <= fake.tensor_bytes <= (1 + most_over) * real.peak_bytes
    linear = 2 * (4 * 256 * 256 + 3 * 256 * 512)  # q, k, v, o and gate, up, down in each of the 2 layers
    unquantised = 4 * (2 * 64 * 256 + 5 * 256)  # embedding, head and norms: fp32 (prepare_model_for_kbit_training)
    weights = fake.parts["step"]["weights"]
    assert linear * weight_bytes + unquantised < weights < linear * weight_bytes * 1.1 + unquantised + 65536


def test_the_quantize_option_overrides_the_field_on_plan_run_and_verify(capsys, tmp_path, monkeypatch):
    """`--quantize nf4` on a LoRA recipe: the plan says so, the run trains on bitsandbytes' 4-bit layers, verify is
    equivalent; its resume with another base is refused, as is --quantize on a recipe that trains every weight."""
    import yaml

    from helpers import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[2]))  # tests/factories.py
    data = quantized_recipe("int8")
    del data["model"]["quantize"]
    data["schedule"] = {"total": {"steps": 2}}
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(data))
    code, out, err = cli(capsys, "plan", "lora.yaml", "--micro-batch-max", "4", "--quantize", "nf4")
    assert code == 0 and "nf4 base (QLoRA's 4-bit NormalFloat" in out, err
    code, out, err = cli(capsys, "run", "lora.yaml", "--out", "run", "--micro-batch-max", "4", "--quantize", "nf4",
                         "--device", "cpu", "--workers", "0", "--max-steps", "1")
    assert code == 0 and "done: 1 steps" in out, err
    saved = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert saved["recipe"]["model"]["quantize"] == "nf4"
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert any(name.endswith("weight.quant_state.bitsandbytes__nf4") for name in trained)
    code, out, err = cli(capsys, "run", "lora.yaml", "--out", "run", "--resume", "--quantize", "int8")
    assert code == 2 and "--quantize: the run in run was started with model.quantize nf4" in err
    code, out, err = cli(capsys, "run", "lora.yaml", "--out", "run", "--resume")  # keeps the base it started with
    assert code == 0 and "memory: nf4 base" in out and "done: 2 steps" in out, err
    code, out, err = cli(capsys, "verify", "lora.yaml", "--micro-batch-max", "4", "--quantize", "int8")
    assert code == 0 and "equivalent" in out and "quantised base (int8)" in out, out + err
    del data["model"]["lora"]
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(data))
    code, out, err = cli(capsys, "plan", "full.yaml", "--micro-batch-max", "4", "--quantize", "int8")
    assert code == 2 and err.startswith("error: --quantize: model.quantize: an int8 base cannot train"), err


@pytest.mark.parametrize("args", [["--quantize", "nf4"], []])
def test_a_quantised_base_with_fsdp_is_one_line_on_plan_probe_and_run(args, capsys, tmp_path, monkeypatch):
    """--sharding fsdp on a quantised base (from the field or --quantize): one line, exit 2, nothing written, never
    a pydantic traceback (the options skip the recipe's validators)."""
    import yaml

    from helpers import cli, snapshot

    monkeypatch.chdir(tmp_path)
    data = quantized_recipe("int8")
    if args:
        del data["model"]["quantize"]
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(data))
    before = snapshot(tmp_path)
    fsdp = ["--sharding", "fsdp", *args]
    for command in (["plan", "lora.yaml", "--world-size", "2", "--micro-batch-max", "4"],
                    ["probe", "lora.yaml", "--world-size", "2", "--gpu", "rtx4090"],
                    ["run", "lora.yaml", "--out", "run", "--device", "cpu", "--micro-batch-max", "4"]):
        code, out, err = cli(capsys, *command, *fsdp)
        base = args[1] if args else "int8"
        assert code == 2 and out == "" and err == (
            f"error: {'--quantize' if args else '--sharding'}: model.quantize: an {base} base is not sharded with fsdp "
            "here (FSDP2 cannot shard bitsandbytes' packed weights); use batch.sharding: none\n"), (command, err)
    assert snapshot(tmp_path) == before


@pytest.mark.distributed
@pytest.mark.subprocess
@pytest.mark.parametrize("quantize", [pytest.param("int8", marks=pytest.mark.slow), "nf4"])  # (int8: also passes)
def test_lora_on_a_quantised_base_under_two_gloo_processes_equals_one_process(quantize, tmp_path):
    """DDP over two torchrun processes (gloo) on an int8 / nf4 base with activation checkpointing, where peers fail
    with "Expected to mark a variable ready only once" (artidoro/qlora#223, peft#301): 4 x 2 x 2 ends where one
    process's 4 x 4 does, within float32 rounding, and the frozen quantised weights are untouched."""
    from helpers import assert_close_weights, reproduce_run, reproduce_run_here, weights

    recipe = quantized_recipe(quantize, activation_checkpointing=True)
    recipe["model"]["lora"]["dropout"] = 0.0  # each rank draws its own dropout masks: not one process's
    recipe["schedule"] = {"total": {"steps": 3}}
    two = reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "4", "--nproc-per-node", "2", "--workers", "0")
    assert "micro 4 x accumulation 2 x world 2 = 16" in two.stdout, two.stdout
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "4", "--workers", "0")
    two_weights, one_weights = weights(tmp_path, "two"), weights(tmp_path, "one")
    assert_close_weights(two_weights, one_weights)
    frozen = [name for name in one_weights if "lora_" not in name and one_weights[name].dtype in (torch.int8,
                                                                                                   torch.uint8)]
    assert frozen and all(torch.equal(two_weights[name], one_weights[name]) for name in frozen)
